"""qwen-kvprep: make the Int8 KV cache of Qwen (v1) chat models work."""

__version__ = "0.1.0"
