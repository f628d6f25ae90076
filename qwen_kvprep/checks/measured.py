"""What was measured of Qwen (v1)'s own tokenizer on each transformers 5.x minor release.

Measured by bench/transformers_releases.py (Qwen's tokenization_qwen.py through
`AutoTokenizer` with trust_remote_code: load, encode, decode back to the same text), on
the newest patch release of each minor release. docs/reference.md ("Measured on each 5.x
release") shows the same table; tests/test_docs.py checks that the two agree. `doctor`
warns only on a release measured to fail: a release newer than the table is not judged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

# (major, minor) -> (the release measured, how Qwen's tokenizer fails there; None: it works)
QWEN_TOKENIZER: Mapping[tuple[int, int], tuple[str, Optional[str]]] = {
    (5, 0): (
        "5.0.0",
        "the load fails inside transformers (the error it raises is itself replaced by "
        "`ImportError` from its protobuf handler where protobuf is not installed)",
    ),
    (5, 1): (
        "5.1.0",
        "encoding fails (`ValueError: type of None unknown`: transformers reads no token ids "
        "from the tokenizer)",
    ),
    (5, 2): ("5.2.0", None),
    (5, 3): ("5.3.0", None),
    (5, 4): ("5.4.0", None),
    (5, 5): ("5.5.4", None),
    (5, 6): ("5.6.2", None),
    (5, 7): ("5.7.0", None),
    (5, 8): ("5.8.1", None),
    (5, 9): ("5.9.0", None),
    (5, 10): ("5.10.4", None),
    (5, 11): ("5.11.0", None),
    (5, 12): ("5.12.1", None),
    (5, 13): ("5.13.1", None),
    (5, 14): ("5.14.1", None),
    (5, 15): ("5.15.1", None),
    (5, 16): ("5.16.1", None),
    (5, 17): ("5.17.0", None),
    (5, 18): ("5.18.0", None),
    (5, 19): ("5.19.0", None),
    (5, 20): ("5.20.2", None),
    (5, 21): ("5.21.1", None),
    (5, 22): ("5.22.2", None),
    (5, 23): ("5.23.0", None),
    (5, 24): ("5.24.0", None),
}


def _first_working() -> Optional[tuple[int, int]]:
    """The first minor release from which every measured one works."""
    failing = [minor for minor, (_, how) in QWEN_TOKENIZER.items() if how is not None]
    if not failing:
        return None
    after = max(failing)
    later = [minor for minor in QWEN_TOKENIZER if minor > after]
    return min(later) if later else None


FIRST_WORKING = _first_working()


def tokenizer_failure(release: tuple[int, ...]) -> Optional[tuple[str, str]]:
    """(the release measured, how Qwen's tokenizer failed there) for a release of a minor
    release measured to fail; None where it was measured to work or was not measured."""
    if len(release) < 2:
        return None
    measured = QWEN_TOKENIZER.get((release[0], release[1]))
    if measured is None or measured[1] is None:
        return None
    return measured[0], measured[1]
