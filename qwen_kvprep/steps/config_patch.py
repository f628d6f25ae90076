"""Patch config.json: quantized KV cache and its kernel on, flash-attn off.

Every other key keeps its value and its place; the file is written atomically through the
journal (which keeps the original, and replaces a symlink instead of writing into a
huggingface_hub blob).
"""

from __future__ import annotations

import json
import re
import shlex
from collections import OrderedDict
from pathlib import Path
from typing import Any

from qwen_kvprep.errors import ConfigError, current_user
from qwen_kvprep.findings import Finding, info, ok
from qwen_kvprep.untrusted import DuplicateKey, NotRegularFile, load_json, read_regular

CONFIG = "config.json"

# flash-attn must be off explicitly: the remote code does not switch it off when the
# cache is quantized, and the flash path then crashes on the quantized tuples.
KV_FLAGS: OrderedDict[str, Any] = OrderedDict(
    [("use_cache_quantization", True), ("use_cache_kernel", True), ("use_flash_attn", False)]
)


# A model config is a few KiB; anything near this is not one (and is never read whole).
CONFIG_LIMIT = 16 << 20
CONFIG_DEPTH = 64


def _redownload(path: Path) -> str:
    return (
        f"re-download it: `hf download <repo> {CONFIG} --local-dir "
        f"{shlex.quote(str(path.parent))} --force-download`"
    )


def _ordered_unique(pairs: list[tuple[str, Any]]) -> OrderedDict[str, Any]:
    out: OrderedDict[str, Any] = OrderedDict()
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(f"the key {key!r} appears twice in one object")
        out[key] = value
    return out


def parse_config_bytes(raw: bytes, path: Path) -> OrderedDict[str, Any]:
    """config.json as doctor and fix both judge it: strict UTF-8, JSON, unique keys (a
    duplicate would be merged silently by json.loads, the last one winning), an object.
    Raises ConfigError (its __cause__ a JSONDecodeError when the parser stopped)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path} is not UTF-8 text (byte {exc.start} is 0x{raw[exc.start]:02x}), so "
            "transformers cannot read it",
            fix=f"convert it to UTF-8, or {_redownload(path)}",
        ) from exc
    return parse_config(text, path)


def parse_config(text: str, path: Path) -> OrderedDict[str, Any]:
    try:
        data = load_json(text.encode("utf-8"), CONFIG_DEPTH, _ordered_unique)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{path} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}",
            fix=f"repair line {exc.lineno} of {shlex.quote(str(path))}, or {_redownload(path)}",
        ) from exc
    except DuplicateKey as exc:
        raise ConfigError(
            f"{path} is ambiguous: {exc} (transformers would silently keep the last value)",
            fix=f"remove the duplicate from {shlex.quote(str(path))}, or {_redownload(path)}",
        ) from exc
    except ValueError as exc:  # hostile nesting (or a lone surrogate): refuse, no traceback
        raise ConfigError(
            f"{path} cannot be a model config: {exc}", fix=_redownload(path)
        ) from exc
    if not isinstance(data, OrderedDict):
        raise ConfigError(
            f"{path} does not hold a JSON object", fix=_redownload(path)
        )
    return data


def read_config(path: Path) -> OrderedDict[str, Any]:
    """Read and parse config.json (a regular file, or a link to one). ConfigError when it
    is missing, not a regular file, unreadable, too large or not a valid config."""
    return parse_config_bytes(read_config_bytes(path), path)


def read_config_bytes(path: Path) -> bytes:
    try:
        return read_regular(path, CONFIG_LIMIT)
    except FileNotFoundError as exc:
        raise ConfigError(f"{path} does not exist", fix=_redownload(path)) from exc
    except NotRegularFile as exc:
        raise ConfigError(
            f"{path} {exc.strerror}", fix=f"replace it with the real file: {_redownload(path)}"
        ) from exc
    except PermissionError as exc:
        raise ConfigError(
            f"{path} cannot be read by user {current_user()}: {exc.strerror}",
            fix=f"make it readable (`chmod a+r {shlex.quote(str(path))}`) or run as its owner",
        ) from exc
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from exc


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


def run(ctx: Any) -> None:
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
