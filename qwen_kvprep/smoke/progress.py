"""Progress lines for long steps (stderr, never stdout): on a terminal, the smoke's phases
(`PhaseProgress`, not with --json); on a pipe (a CI job, `docker build`, an init
container's log), a line a phase with the time since the start and a heartbeat while a
long phase runs (`StepLog`, with --json too: the document stays alone on stdout). `fix`,
`build`, `smoke` and `profile` all log this way on a pipe."""

from __future__ import annotations

import contextlib
import sys
import threading
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


# A log line at least this often while a phase runs (a build, a model load): CI systems
# and people reading a log take minutes of silence for a hang.
HEARTBEAT_S = 10.0


class StepLog:
    """`[  12.3s] fix: compiling the extension ...` for a log that is not a terminal.

    `phase` starts a phase (one line); `note` adds a line; when nothing was
    written for `heartbeat` seconds a background thread writes `still <phase> (N s)`, so a
    20-second compile or a minutes-long model load shows it is alive. Use it as a context
    manager (or call `close`) to stop that thread.
    """

    def __init__(
        self,
        stream: IO[str],
        label: str = "fix",
        heartbeat: Optional[float] = None,  # None: HEARTBEAT_S
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream = stream
        self.label = label
        self.clock = clock
        self.t0 = clock()
        self._current = ""
        self._phase_t0 = self.t0
        self._last = self.t0
        self._heartbeat = HEARTBEAT_S if heartbeat is None else heartbeat
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="kvprep-heartbeat", daemon=True)
        self._thread.start()

    def phase(self, words: str) -> None:
        with self._lock:
            self._current, self._phase_t0 = words, self.clock()
            self._write(f"{words} ...")

    def note(self, text: str, phase: Optional[str] = None) -> None:
        """A line within the phase; `phase` names what the heartbeat says from now on."""
        with self._lock:
            if phase is not None:
                self._current, self._phase_t0 = phase, self.clock()
            self._write(text)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> StepLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _beat(self) -> None:
        # wake often enough that a line is never more than a second late
        while not self._stop.wait(min(self._heartbeat, 1.0)):
            with self._lock:
                now = self.clock()
                if self._current and now - self._last >= self._heartbeat:
                    self._write(f"still {self._current} ({now - self._phase_t0:.0f} s)")

    def _write(self, text: str) -> None:
        """The caller holds the lock."""
        now = self.clock()
        self._last = now
        # a closed pipe must not stop the work it reports on
        with contextlib.suppress(OSError, ValueError):
            print(f"[{now - self.t0:6.1f}s] {self.label}: {text}", file=self.stream, flush=True)


def log_phases(log: StepLog, prefix: str = "") -> Callable[[str], None]:
    """A child's phases as lines of `log`, whose heartbeat covers a long model load."""

    def phase(name: str) -> None:
        if name != PHASE_DONE:
            log.phase(f"{prefix}{PHASE_WORDS.get(name, name)}")

    return phase


def step_log(label: str = "fix", stream: Optional[IO[str]] = None) -> Optional[StepLog]:
    """A StepLog on stderr when stderr is not a terminal (a log), else None: on a terminal
    the commands keep their live output."""
    stream = stream or sys.stderr
    isatty = getattr(stream, "isatty", None)
    return None if isatty and isatty() else StepLog(stream, label)
