"""Controls shared by the tests of what is built on SequenceState.restore."""

from __future__ import annotations


def restore_without(monkeypatch, part: str) -> None:
    """The control for anything built on SequenceState.restore: restores now leave out `part`
    ("deltanet", "attention" or "ple"), which must change what follows."""
    from flashpack.runtime.state import SequenceState

    real = SequenceState.restore

    def partial(self, snapshot):
        kept = SequenceState(snapshot.position, snapshot.deltanet, snapshot.attention, snapshot.ple)
        setattr(kept, part, {})
        real(self, kept)

    monkeypatch.setattr(SequenceState, "restore", partial)
