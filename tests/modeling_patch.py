"""A tiny checkpoint's model code made to misbehave where it is loaded: a statement run at
the start of every attention layer's __init__ (raise, sleep), for the tests of a model that
fails or hangs while a child process loads it."""

from __future__ import annotations

from pathlib import Path

_ANCHOR = "class QWenAttention(nn.Module):\n    def __init__(self, config):\n"


def patch_modeling(ckpt: Path, statement: str) -> None:
    path = ckpt / "modeling_qwen.py"
    text = path.read_text()
    assert _ANCHOR in text
    path.write_text(text.replace(_ANCHOR, _ANCHOR + f"        {statement}\n", 1))
