"""The progress bar of `profile` on a terminal (stderr, rewritten in place; nothing on a
pipe or with --json: see `progress_bar`)."""

from __future__ import annotations

import sys
import time
from typing import IO, TYPE_CHECKING, Optional

from qwen_kvprep.profile.protocol import PHASE_WORDS
from qwen_kvprep.smoke.progress import wants_progress

if TYPE_CHECKING:
    from qwen_kvprep.childproc import ShownEvent

_WIDTH = 24


class ProgressBar:
    """`[#######.................] 3/13  int8 batch 16: decoding 512/1024  41s`

    One step per child process; within a step the child's phases and decode progress are
    shown, so a long load or a slow batch is visibly alive.
    """

    def __init__(self, stream: IO[str], total: int) -> None:
        self.stream = stream
        self.total = max(total, 1)
        self.done = 0
        self.label = ""
        self.detail = ""
        self.t0 = time.monotonic()
        self._last_len = 0

    def start(self, label: str) -> None:
        self.label, self.detail = label, PHASE_WORDS["start"]
        self._draw()

    def event(self, event: ShownEvent) -> None:
        phase = str(event.get("phase", ""))
        words = PHASE_WORDS.get(phase, phase)
        if event.get("event") == "progress" and event.get("total"):
            words = f"{words} {event.get('done')}/{event.get('total')}"
        self.detail = words
        self._draw()

    def finish_step(self) -> None:
        self.done = min(self.done + 1, self.total)
        self.detail = ""
        self._draw()

    def close(self) -> None:
        self.stream.write("\r" + " " * self._last_len + "\r")
        self.stream.flush()

    def _draw(self) -> None:
        filled = int(_WIDTH * self.done / self.total)
        bar = "#" * filled + "." * (_WIDTH - filled)
        elapsed = time.monotonic() - self.t0
        text = f"[{bar}] {self.done}/{self.total}  {self.label}"
        if self.detail:
            text += f": {self.detail}"
        text += f"  {elapsed:.0f}s"
        pad = max(self._last_len - len(text), 0)
        self.stream.write("\r" + text + " " * pad)
        self.stream.flush()
        self._last_len = len(text)


def progress_bar(as_json: bool, total: int) -> Optional[ProgressBar]:
    return ProgressBar(sys.stderr, total) if wants_progress(as_json) else None
