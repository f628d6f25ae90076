"""Parsing and printing memory sizes and integer lists for `plan`'s options."""

from __future__ import annotations

import re

from qwen_kvprep.errors import UsageError

GIB = 1024**3

# Decimal units as disk and card makers write them, binary ones as nvidia-smi and torch
# report. A bare "G" or "M" is refused rather than guessed: the two readings of "80G"
# differ by 7%, more than the margins plan is asked to judge.
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")

SIZE_EXAMPLES = "80GiB, 24GB, 81920MiB or a number of bytes"


def parse_size(text: str, option: str = "--gpu-memory") -> int:
    """Bytes in `text` ("80GiB", "24GB", "81920MiB", "85899345920"); UsageError otherwise."""
    m = _SIZE.match(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise UsageError(
            f"{option}: cannot read {text!r} as a memory size",
            fix=f"write it as {SIZE_EXAMPLES} (GB = 10^9 bytes, GiB = 2^30)",
        )
    value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise UsageError(f"{option} must be more than 0 bytes", fix=f"e.g. {option} 80GiB")
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
