"""The prepared view of a read-only model directory (`fix/prestart DIR --output OUT`).

OUT holds a symlink to every entry of DIR (weights included), so it costs no disk; `fix`
then runs on OUT, and its journal replaces the links of the files it changes (config.json,
cpp_kernels.py, the kernel sources) with real files — fsutil never writes through a link —
so DIR is never touched. OUT's own state (journal, state.json, the view marker) lives in
OUT/.qwen-kvprep, which is never linked from DIR.

`view_mismatch` is on prestart's quick start: standard library only (no pathlib either), and
it hashes only the few small files fix changes.
"""

from __future__ import annotations

import json
import os

from qwen_kvprep import fsutil
from qwen_kvprep.common import STATE_DIRNAME, TRACKED_FILES, sha256_small
from qwen_kvprep.errors import RefusedError, UsageError
from qwen_kvprep.findings import info
from qwen_kvprep.fsutil import atomic_write_text
from qwen_kvprep.untrusted import read_record

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing costs milliseconds at import; the quick start does not need it
    from collections.abc import Mapping
    from pathlib import Path
    from typing import Optional

    from qwen_kvprep.findings import Finding
    from qwen_kvprep.jsontypes import JSONObject

MARKER = "view.json"
VIEW_VERSION = 1
# What fix may replace in a checkpoint. Their source hashes are kept in the marker so that
# a change in DIR (a new config.json) resets the view's patched copy on the next refresh.
CHANGED_FILES = TRACKED_FILES


def marker_path(out: str) -> str:
    return os.path.join(out, STATE_DIRNAME, MARKER)


def read_marker(out: str) -> Optional[JSONObject]:
    """OUT's view.json as plain JSON (every reader compares it with what it expects):
    {"view_version", "source", "linked": [names], "base": {name: sha256 or null}}."""
    try:
        data = read_record(marker_path(out))  # a regular file, size and depth limited
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _object(value: object) -> Mapping[str, object]:
    return value if isinstance(value, dict) else {}


def source_entries(source: str) -> list[str]:
    return sorted(n for n in os.listdir(source) if n != STATE_DIRNAME)


def view_mismatch(source: str, out: str) -> Optional[str]:
    """Why OUT is not an up-to-date view of SOURCE (None: it is). Cheap: one listdir and
    at most four small hashes."""
    marker = read_marker(out)
    if marker is None:
        return f"{out} is not a prepared view yet"
    if marker.get("linked") is None:
        return f"{out} is a view still being made (or one whose making was cut short)"
    if marker.get("source") != os.path.abspath(source):
        return f"{out} is a view of {marker.get('source')}, not of {os.path.abspath(source)}"
    try:
        entries = source_entries(source)
    except OSError as exc:
        return f"cannot list {source}: {exc.strerror}"
    if entries != marker.get("linked"):
        return f"the entries of {source} changed since the view was made"
    base = _object(marker.get("base"))
    for name in CHANGED_FILES:
        if sha256_small(os.path.join(source, name)) != base.get(name):
            return f"{name} in {source} changed since the view was made"
    return None


# ---------------------------------------------------------------- building (slow path)


def check_output_dir(source: Path, out: Path) -> None:
    """Refuse an OUT that cannot work or would damage something, before touching it."""
    from pathlib import Path as _Path


    source = _Path(os.path.abspath(source))  # the form the marker and the links hold
    out = _Path(os.path.abspath(out))
    src = os.path.realpath(source)
    dst = os.path.realpath(out)
    if "." in out.name:
        # transformers imports the remote code as a module named after the folder;
        # a dot in that name splits it into packages and the import fails.
        raise UsageError(
            f"the output folder name {out.name!r} contains a dot, which transformers cannot "
            "import remote code from",
            fix=f"use a name without dots, e.g. {out.with_name(out.name.replace('.', '_'))}",
        )
    if src == dst or dst.startswith(src + os.sep) or src.startswith(dst + os.sep):
        raise UsageError(
            f"--output {out} must be a separate folder, neither {source} nor inside it "
            "(nor containing it)",
            fix="choose a folder outside the model directory, e.g. /tmp/prepared/<model>",
        )
    if not out.exists():
        return
    if not out.is_dir():
        raise UsageError(f"--output {out} exists and is not a folder")
    if (out / STATE_DIRNAME / MARKER).exists():
        marker = read_marker(str(out)) or {}
        if marker.get("source") != str(source):
            raise RefusedError(
                f"{out} is a prepared view of {marker.get('source')}, not of {source}",
                fix=f"use another --output folder, or remove {out} first",
            )
        return
    # Only our own state folder (a concurrent prestart that is about to write the marker)
    # may be there already; anything else belongs to someone and is not overwritten.
    foreign = [n for n in os.listdir(out) if n != STATE_DIRNAME]
    if foreign:
        raise RefusedError(
            f"--output {out} is not empty and is not a view made by qwen-kvprep "
            f"(it holds {', '.join(sorted(foreign)[:3])}{'…' if len(foreign) > 3 else ''})",
            fix="use an empty or new folder for --output",
        )


class ViewResult:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.linked: list[str] = []  # links created or re-pointed
        self.reset: list[str] = []  # patched copies dropped because the source changed
        self.removed: list[str] = []  # links to entries the source no longer has
        self.kept: list[str] = []  # real files in OUT that shadow a source entry

    @property
    def changed(self) -> bool:
        return bool(self.linked or self.reset or self.removed)


def prepare_view(source: Path, out: Path) -> ViewResult:
    """Create or refresh OUT as a view of SOURCE. Idempotent."""
    from datetime import datetime, timezone
    from pathlib import Path as _Path


    # Links and the marker hold this absolute form; prestart compares against it.
    source = _Path(os.path.abspath(source))
    out = _Path(os.path.abspath(out))
    check_output_dir(source, out)
    out.mkdir(parents=True, exist_ok=True)
    result = ViewResult(out)
    marker = read_marker(str(out)) or {}
    if not marker:
        # Claim OUT before the first link: a replica that finds it half-made (or a run after
        # a kill half-way) must see our view in progress, not someone's folder to refuse.
        # `linked: null` never matches a listing, so the view counts as not ready.
        (out / STATE_DIRNAME).mkdir(exist_ok=True)
        claim = {"view_version": VIEW_VERSION, "source": str(source), "linked": None, "base": {}}
        atomic_write_text(marker_path(str(out)), json.dumps(claim, indent=2) + "\n")
    old_base = _object(marker.get("base"))
    entries = source_entries(str(source))
    base: dict[str, Optional[str]] = {}
    for name in CHANGED_FILES:
        base[name] = sha256_small(str(source / name))

    for name in entries:
        target = str(source / name)
        link = out / name
        if link.is_symlink():
            if os.readlink(link) != target:
                fsutil.atomic_symlink(target, link)
                result.linked.append(name)
        elif link.exists():
            if name in CHANGED_FILES and old_base.get(name) != base[name]:
                # fix's patched copy of a file that DIR has since replaced: back to a link,
                # so that the following fix patches the new one (the journal's original for
                # it is this same link, so revert stays right).
                fsutil.atomic_symlink(target, link)
                result.reset.append(name)
            elif name not in CHANGED_FILES:
                result.kept.append(name)
        else:
            fsutil.atomic_symlink(target, link)
            result.linked.append(name)

    prefix = str(source) + os.sep
    for name in sorted(set(os.listdir(out)) - set(entries) - {STATE_DIRNAME}):
        link = out / name
        # Only our own dangling links go; real files there were written by fix (kernel
        # sources the source lacks) or by someone else, and stay.
        if link.is_symlink() and os.readlink(link).startswith(prefix) and not link.exists():
            link.unlink()
            result.removed.append(name)

    (out / STATE_DIRNAME).mkdir(exist_ok=True)
    doc = {
        "view_version": VIEW_VERSION,
        "source": str(source),
        "linked": entries,
        "base": base,
        "updated": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if {k: marker.get(k) for k in ("source", "linked", "base")} != {
        k: doc[k] for k in ("source", "linked", "base")
    }:
        atomic_write_text(marker_path(str(out)), json.dumps(doc, indent=2) + "\n")
    return result


def fix_target(source: Path, out: Path, dry_run: bool) -> tuple[Path, list[Finding]]:
    """For `fix --output`: the folder fix's steps run on, and a finding saying so.

    In dry-run nothing is created: the steps read the existing view, or the source itself
    (a dry run writes nothing, so the source is safe)."""
    from pathlib import Path as _Path


    source = _Path(os.path.abspath(source))
    out = _Path(os.path.abspath(out))
    check_output_dir(source, out)
    if dry_run:
        if read_marker(str(out)) is not None:
            return out, [info("checkpoint.view", f"would refresh the view {out} of {source}")]
        return source, [
            info("checkpoint.view", f"would create {out} as a view of {source} and fix it there")
        ]
    result = prepare_view(source, out)
    parts = [f"{len(result.linked)} linked"] if result.linked else []
    if result.reset:
        parts.append(f"{', '.join(result.reset)} changed in the source (re-patched)")
    if result.removed:
        parts.append(f"{len(result.removed)} gone from the source (unlinked)")
    message = f"view {out} of {source}" + (f": {'; '.join(parts)}" if parts else " is current")
    return out, [info("checkpoint.view", message, paths=[out], kept_real_files=result.kept)]
