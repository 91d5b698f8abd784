"""Named experiments for `flashpack bench --preset NAME`: each is a list of `--set` settings, the
control against which the engine's default for that setting was chosen (bench/HISTORY.md has the
measurements). A preset changes nothing else, so it benches one setting against the default."""

from __future__ import annotations

from flashpack.errors import FlashpackError

PRESETS: dict[str, tuple[str, ...]] = {
    "cublas": ("dense_matvec_max_tokens=0",),  # every BF16 projection on cuBLAS, no matvec kernel
    "no-combo": ("combo_kernels=false",),  # decode pieces compiled without Inductor's combo kernels
    "unfused-mix": ("fused_mix=false",),  # hyper-connection mixes as the module's code
    "eager": ("cuda_graphs=false",),  # every decode kernel issued from Python
    "one-graph": ("layers_per_graph=1000",),  # the whole step in one CUDA graph (capped at the pack's layers)
    "no-prefetch": ("prefetch=false",),  # no next-layer expert prefetch
    "no-read-ahead": ("read_ahead=false",),  # no disk reads for the layer after next
    "late-prefetch": ("prefetch_during_loads=false",),  # prefetch once a layer's own loads have landed
    "promote": ("store.promote=true",),  # staged experts that outrank their victim take a device slot
    "guesses-wait": ("store.guesses_beside_required=false",),  # a prefetch read waits for a running required read
    "copy-thread": ("store.copy_on_requesting_thread=false",),  # a layer's host copies handed to the copy thread
    "whole-reads": ("store.read_pieces=1",),  # each record read in one piece
    "none-beside": ("staged_beside_experts=0",),  # no next-graph records staged beside a graph's last experts
    "two-beside": ("staged_beside_experts=2",),
    "staging-64": ("staging_programs=64",),  # the side stream's staging kernel on 64 programs
}


def preset_settings(names: list[str] | tuple[str, ...]) -> list[str]:
    """The `--set` settings of the named presets, in order."""
    settings: list[str] = []
    for name in names:
        if name not in PRESETS:
            raise FlashpackError(f"unknown bench preset {name!r}: choose one of {', '.join(PRESETS)}")
        settings.extend(PRESETS[name])
    return settings
