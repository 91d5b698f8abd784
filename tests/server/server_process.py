"""`serve` in a process of its own, on the fake model over a pack's tokenizer, for tests that watch the
process from outside (its memory, its open files, its log).

    python server_process.py PACK PORT SETTINGS_JSON

Everything but the model is the real `flashpack serve` path: the open-file limit raised, the
connection cap, the guarded protocol, uvicorn's logging, the warm-up and its "ready in" line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(pack: str, port: int, settings: dict) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    import flashpack.runtime.engine.build
    from server_fakes import fake_engine

    from flashpack.runtime.server import ServerSettings, serve
    from flashpack.runtime.tokenizer import PackTokenizer

    tokenizer = PackTokenizer.load(Path(pack))
    flashpack.runtime.engine.build.load_engine = lambda *args, **kwargs: fake_engine(tokenizer)
    serve(pack, ServerSettings(**settings), port=port, log_level="warning")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]))
