"""Whether a prepared folder serves from a modules cache fix never prepared.

From this release on, fix's compatibility module (templates/qwen_kvprep_compat.py) gives a
load whose modules-cache folder lacks the kernel sources or the fast path's module what it
needs from the checkpoint itself (the fast path's module, checked against the sha256 the
loader records; the extension, from the loader, which needs no sources while the build
cache holds its build). A folder fixed by an earlier release does not: a fresh modules
cache then runs the slow path until `prestart` (or `fix`) prepares it. Doctor tells the
two apart with `serves_any_modules_cache`.
"""

from __future__ import annotations

import ast
from typing import Optional, Union

# The loader's assignments the compatibility module reads (it parses, never imports, it).
LOADER_VALUES = ("_CHECKPOINT", "_FIX", "_PRESTART", "_FAST_SHA256")

Literal = Union[str, None]


def loader_values(text: str) -> dict[str, Literal]:
    """The literal string (or None) assignments LOADER_VALUES names in a loader's text;
    empty when it does not parse."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return {}
    values: dict[str, Literal] = {}
    for node in tree.body:
        if not (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id in LOADER_VALUES
        ):
            continue
        try:
            value = ast.literal_eval(node.value)
        except ValueError:
            continue
        if value is None or isinstance(value, str):
            values[node.targets[0].id] = value
    return values


def serves_any_modules_cache(
    loader_text: Optional[str],
    compat_imported: bool,
    compat_current: bool,
    fast_path_imported: bool,
    fast_module_sha256: Optional[str],
) -> bool:
    """Whether a load from any modules cache gets the kernel and the fast path from the
    checkpoint: its code imports this release's compatibility module, its loader records
    the prepared folder and, where the fast path is in the code, the sha256 of the fast
    path's module the checkpoint holds."""
    if loader_text is None or not compat_imported or not compat_current:
        return False
    values = loader_values(loader_text)
    if not isinstance(values.get("_CHECKPOINT"), str) or "_FAST_SHA256" not in values:
        return False
    if fast_path_imported:
        return fast_module_sha256 is not None and values["_FAST_SHA256"] == fast_module_sha256
    return True
