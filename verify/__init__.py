"""`flashpack verify`: our engine on a pack against transformers on the pack's source snapshot.

    verify_pack(pack, reference, *, dtype, device, prompts, decode_tokens, control, json_path, seed)
        -> VerifyReport (.passed, .table(), .to_json())
"""

from flashpack.verify.report import VerifyReport
from flashpack.verify.run import verify_pack

__all__ = ["VerifyReport", "verify_pack"]
