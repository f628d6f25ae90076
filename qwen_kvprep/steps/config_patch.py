"""Patch config.json: quantized KV cache and its kernel on, flash-attn off.

Every other key keeps its value and its place; the file is written atomically through the
journal (which keeps the original, and replaces a symlink instead of writing into a
huggingface_hub blob).
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from pathlib import Path

from qwen_kvprep.configjson import CONFIG, parse_config, parse_config_bytes, read_config_bytes
from qwen_kvprep.findings import Finding, info, ok
from qwen_kvprep.steps.context import FixContext

# flash-attn must be off explicitly: the remote code does not switch it off when the
# cache is quantized, and the flash path then crashes on the quantized tuples.
KV_FLAGS: OrderedDict[str, bool] = OrderedDict(
    [("use_cache_quantization", True), ("use_cache_kernel", True), ("use_flash_attn", False)]
)


def _indent_of(text: str) -> int:
    m = re.match(r"\{\s*\n([ \t]+)\"", text)
    return len(m.group(1).expandtabs(4)) if m else 2


def patch_text(text: str, path: Path) -> tuple[str, list[str]]:
    """Return the patched text and the keys whose value changed (empty: nothing to do)."""
    data = parse_config(text, path)
    changed = [k for k, v in KV_FLAGS.items() if k not in data or data[k] is not v]
    if not changed:
        return text, []
    for key in changed:
        data[key] = KV_FLAGS[key]
    new = json.dumps(data, indent=_indent_of(text), ensure_ascii=False)
    if text.endswith("\n"):
        new += "\n"
    return new, changed


def run(ctx: FixContext) -> None:
    """Fix step: patch <dir>/config.json (through the context's journal)."""
    path: Path = ctx.directory / CONFIG
    raw = read_config_bytes(path)
    parse_config_bytes(raw, path)
    text = raw.decode("utf-8")
    new, changed = patch_text(text, path)
    finding: Finding
    if not changed:
        finding = ok(
            "config.patch", "config.json already has the quantized KV cache on and flash-attn off",
            paths=[path],
        )
    else:
        ctx.journal.write(CONFIG, new.encode("utf-8"))
        verb = "would set" if ctx.options.dry_run else "set"
        finding = info(
            "config.patch",
            f"{verb} " + ", ".join(f"{k}={json.dumps(KV_FLAGS[k])}" for k in changed),
            paths=[path],
        )
    ctx.add(finding)
