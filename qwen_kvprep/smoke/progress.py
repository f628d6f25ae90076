"""Progress lines for long steps, on a terminal only (stderr; never with --json)."""

from __future__ import annotations

import sys
import time
from typing import IO, Callable, Optional

from qwen_kvprep.smoke.protocol import PHASE_DONE, PHASE_WORDS


class PhaseProgress:
    """One line a phase, with the time since the start, so a slow load is visibly alive."""

    def __init__(self, stream: IO[str], label: str = "smoke") -> None:
        self.stream = stream
        self.label = label
        self.t0 = time.monotonic()

    def __call__(self, phase: str) -> None:
        if phase == PHASE_DONE:
            return
        words = PHASE_WORDS.get(phase, phase)
        elapsed = time.monotonic() - self.t0
        print(f"  {self.label} [{elapsed:5.1f}s] {words} ...", file=self.stream, flush=True)


def wants_progress(as_json: bool, stream: Optional[IO[str]] = None) -> bool:
    stream = stream or sys.stderr
    isatty = getattr(stream, "isatty", None)
    return not as_json and bool(isatty and isatty())


def phase_progress(as_json: bool, label: str = "smoke") -> Optional[Callable[[str], None]]:
    return PhaseProgress(sys.stderr, label) if wants_progress(as_json) else None
