"""The progress of `profile` on stderr: on a terminal a bar rewritten in place (not with
--json); on a pipe a line when a run or its phase starts, and a heartbeat while a long
phase lasts (with --json too: the document stays alone on stdout). See `progress_bar`."""

from __future__ import annotations

import sys
import time
from typing import IO, TYPE_CHECKING, Optional, Protocol

from qwen_kvprep.profile.protocol import PHASE_WORDS
from qwen_kvprep.smoke.progress import StepLog, step_log, wants_progress

if TYPE_CHECKING:
    from qwen_kvprep.childproc import ShownEvent

_WIDTH = 24


class Progress(Protocol):
    """What the runner tells a display: a child starts, says something, ends."""

    total: int

    def start(self, label: str) -> None: ...

    def event(self, event: ShownEvent) -> None: ...

    def finish_step(self) -> None: ...

    def close(self) -> None: ...


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


class ProgressLog:
    """`[  41.0s] profile: 3/13 int8 batch 16: decoding ...` for a log: a line when a child
    starts and when its phase changes (no counters: a log is not rewritten in place)."""

    def __init__(self, log: StepLog, total: int = 1) -> None:
        self.log = log
        self.total = max(total, 1)
        self.done = 0
        self.label = ""
        self.words = ""  # the phase last written: the child announces its start again

    def start(self, label: str) -> None:
        self.label, self.words = label, ""
        self._line(PHASE_WORDS["start"])

    def event(self, event: ShownEvent) -> None:
        phase = str(event.get("phase", ""))
        if event.get("event") == "phase" and phase != "done":
            self._line(PHASE_WORDS.get(phase, phase))

    def finish_step(self) -> None:
        self.done = min(self.done + 1, self.total)

    def close(self) -> None:
        self.log.close()

    def _line(self, words: str) -> None:
        if words != self.words:
            self.words = words
            self.log.phase(f"{min(self.done + 1, self.total)}/{self.total} {self.label}: {words}")


def progress_bar(as_json: bool, total: int) -> Optional[Progress]:
    log = step_log("profile")
    if log is not None:
        return ProgressLog(log, total)
    return ProgressBar(sys.stderr, total) if wants_progress(as_json) else None
