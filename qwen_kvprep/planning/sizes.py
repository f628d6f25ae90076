"""Parsing and printing memory sizes and integer lists for `plan`'s options."""

from __future__ import annotations

import re
from typing import Optional

from qwen_kvprep.errors import UsageError

GIB = 1024**3

# What people running GPUs type, read as the tool they copied it from reads it:
# - Kubernetes quantities: `24Gi`, `24000Mi` are binary (2^30, 2^20); `24G`, `24M`, `24k`
#   are decimal (10^9, 10^6, 10^3), as Kubernetes defines them.
# - IEC: `24GiB`, `81920MiB` (binary).
# - `24GB`, `24MB` (with a B) are read as binary, as docker reads them (`--memory 24GB` is
#   24 GiB there) and as card makers mean them: a card sold as "24 GB" has 24 GiB. Read as
#   10^9 they would under-state such a card by 7%.
# A number without a unit is refused: 24 bytes is never what was meant. Lower-case single
# letters (`24g`, `24m`) are refused too: docker reads `24g` as 24 GiB, Kubernetes reads
# `24m` as 0.024 bytes, so either reading would surprise someone.
_UNITS = {
    "B": 1,
    "k": 10**3,
    "K": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
    "KB": 2**10,
    "MB": 2**20,
    "GB": 2**30,
    "TB": 2**40,
}
# Case does not matter where no reading depends on it (`24gib`, `24gb`, `24GIB`).
_FOLDED = {unit.lower(): value for unit, value in _UNITS.items() if len(unit) > 1}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")

SIZE_FORMS = (
    "24Gi, 24GiB or 24GB (2^30 bytes each: GB is read as docker reads it, and a card sold "
    "as 24 GB has 24 GiB), 24G (Kubernetes: 10^9 bytes), 24000Mi, 81920MiB"
)


def _unit_value(unit: str) -> Optional[int]:
    if unit in _UNITS:
        return _UNITS[unit]
    return _FOLDED.get(unit.lower())


def parse_size(text: str, option: str = "--gpu-memory") -> int:
    """Bytes in `text` ("80GiB", "80Gi", "80GB", "80G", "81920Mi"); UsageError otherwise,
    a bare number included."""
    m = _SIZE.match(text)
    value_of_unit = _unit_value(m.group(2)) if m and m.group(2) else None
    if m is None or value_of_unit is None:
        if m is not None and not m.group(2):
            why = f"{option} {text}: a size needs a unit (a bare number would be bytes)"
        elif m is not None and m.group(2) in ("g", "m", "t"):
            why = (f"{option} {text}: '{m.group(2)}' is ambiguous (docker reads it as "
                   f"binary, Kubernetes has no '{m.group(2)}')")
        else:
            why = f"{option}: cannot read {text!r} as a memory size"
        raise UsageError(why, fix=f"write it as {SIZE_FORMS}; or name the card: --gpu "
                         "a100-80g (`--gpu list` shows the names)")
    value = int(float(m.group(1)) * value_of_unit)
    if value <= 0:
        raise UsageError(f"{option} must be more than 0 bytes", fix=f"e.g. {option} 80Gi")
    return value


def parse_int_list(text: str, option: str, minimum: int = 1) -> tuple[int, ...]:
    """ "1,4,16" -> (1, 4, 16), in the order given (the first value is the one max_batch and
    max_tokens are reported at); duplicates dropped."""
    items = [part.strip() for part in text.split(",")]
    values: list[int] = []
    for item in items:
        if not item.isdigit() or int(item) < minimum:
            raise UsageError(
                f"{option}: {item!r} is not an integer >= {minimum}",
                fix=f"give a comma-separated list, e.g. {option} 1,4,16",
            )
        if int(item) not in values:
            values.append(int(item))
    return tuple(values)


def gib(n: int, digits: int = 1) -> str:
    return f"{n / GIB:.{digits}f}"


def human(n: int) -> str:
    """Bytes as the largest binary unit that keeps them above 1 (for one-line summaries)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}".replace(".00 ", " ")
    return f"{n} B"
