"""The names prestart prints its findings with; they live in qwen_kvprep.render."""

from __future__ import annotations

from qwen_kvprep.render import emit, render_human

__all__ = ["emit", "render_human"]
