"""flashpack: run Qwen3.8-Flash-Next from a tiered expert pack."""

__version__ = "0.1.0"
