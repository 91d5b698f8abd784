"""Synthetic Qwen3.8-Flash-Next snapshots: `synthesize` is what `flashpack synth` calls."""

from flashpack.convert.synth.synthesize import synthesize

__all__ = ["synthesize"]
