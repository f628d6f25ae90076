"""The one renderer of findings: human text, JSON (versioned) and Markdown."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import IO, Any, Optional

from qwen_kvprep import __version__
from qwen_kvprep.checks import AREAS
from qwen_kvprep.findings import Finding, Severity

SCHEMA_VERSION = 1

_SYMBOL = {
    Severity.OK: "ok  ",
    Severity.INFO: "info",
    Severity.WARN: "WARN",
    Severity.FAIL: "FAIL",
    Severity.SKIP: "skip",
}
_COLOUR = {
    Severity.OK: "32",
    Severity.INFO: "36",
    Severity.WARN: "33",
    Severity.FAIL: "31;1",
    Severity.SKIP: "2",
}
_AREA_TITLE = {
    "env": "Environment",
    "checkpoint": "Checkpoint",
    "config": "config.json",
    "kernels": "Kernel sources",
    "build": "Build",
    "modules": "Modules cache",
    "state": "Recorded state (.qwen-kvprep)",
    "smoke": "Smoke test",
}


def use_colour(stream: IO[str]) -> bool:
    if os.environ.get("NO_COLOR") is not None:
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def _paint(text: str, code: str, colour: bool) -> str:
    return f"\x1b[{code}m{text}\x1b[0m" if colour else text


def _grouped(findings: Iterable[Finding]) -> list[tuple[str, list[Finding]]]:
    groups: dict[str, list[Finding]] = {}
    for f in findings:
        groups.setdefault(f.area, []).append(f)
    order = {a: i for i, a in enumerate(AREAS)}
    return sorted(groups.items(), key=lambda kv: order.get(kv[0], len(order)))


def render_human(findings: Sequence[Finding], colour: bool = False, verbose: bool = False) -> str:
    """One line a finding, grouped by area; details and fixes for what is not ok."""
    lines: list[str] = []
    for area, items in _grouped(findings):
        lines.append(_paint(_AREA_TITLE.get(area, area), "1", colour))
        for f in items:
            tag = _paint(_SYMBOL[f.severity], _COLOUR[f.severity], colour)
            lines.append(f"  {tag}  {f.id:<28} {f.message}")
            if f.severity in (Severity.WARN, Severity.FAIL) or verbose:
                for p in f.paths:
                    lines.append(f"        path: {p}")
                if f.fix:
                    lines.append(f"        fix:  {f.fix}")
    lines.append(summary_line(findings))
    return "\n".join(lines)


def summary_line(findings: Sequence[Finding]) -> str:
    counts = {s: 0 for s in Severity}
    for f in findings:
        counts[f.severity] += 1
    parts = [f"{counts[s]} {s.value}" for s in Severity if counts[s]]
    return "summary: " + (", ".join(parts) if parts else "nothing checked")


def document(findings: Sequence[Finding], **extra: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "tool_version": __version__,
        "ok": not any(f.severity is Severity.FAIL for f in findings),
        "findings": [f.to_json() for f in findings],
    }
    doc.update(extra)
    return doc


def render_json(findings: Sequence[Finding], **extra: Any) -> str:
    return json.dumps(document(findings, **extra), indent=2, default=str)


def render_markdown(
    findings: Sequence[Finding], facts_table: Optional[Mapping[str, str]] = None
) -> str:
    """A block to paste into a bug report."""
    out = ["### qwen-kvprep report", "", f"qwen-kvprep {__version__}", ""]
    if facts_table:
        out += ["| item | value |", "|---|---|"]
        out += [f"| {k} | {v} |" for k, v in facts_table.items()]
        out.append("")
    out += ["| check | severity | message |", "|---|---|---|"]
    for f in findings:
        msg = f.message.replace("|", "\\|").replace("\n", " ")
        out.append(f"| `{f.id}` | {f.severity.value} | {msg} |")
    return "\n".join(out) + "\n"


def emit(text: str, stream: Optional[IO[str]] = None) -> None:
    """Print a report or message. Everything qwen-kvprep prints goes through here or
    through the CLI's error reporting, so secrets are removed here as a last net."""
    from qwen_kvprep.redact import scrub

    print(scrub(text), file=stream or sys.stdout)
