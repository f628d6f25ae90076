"""convert's lines on stderr: one a step, a heartbeat when a step is long, and for the
counted steps (shard i/N, proof block i/N) the time left at the rate so far; on a
terminal also a bar. stdout is left to the result."""

from __future__ import annotations

import re
import time
from typing import IO, Callable, Optional

from qwen_kvprep.smoke.progress import StepLog

# a line at least this often, whatever the step (a 10 GB shard, a model load)
HEARTBEAT_S = 10.0
_COUNTED = re.compile(r"\b(shard|block|checked) (\d+)/(\d+)\b")
_BAR = 20


class ConvertLog:
    def __init__(self, stream: IO[str], tty: bool,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log = StepLog(stream, "convert", heartbeat=HEARTBEAT_S, clock=clock)
        self.tty = tty
        self.clock = clock
        self._counting: Optional[tuple[tuple[str, int], float]] = None  # (kind, total), start
        self._prev = clock()  # when the previous line was written

    def __call__(self, message: str) -> None:
        text = self.decorated(message)
        m = _COUNTED.search(message)
        if m is None or int(m.group(2)) >= int(m.group(3)):
            self.log.phase(text)
            return
        # "shard 6/8 ...: 1,934 MB in 4.9 s" is done: the heartbeat speaks of shard 7/8
        following = f"{message[:m.start()]}{m.group(1)} {int(m.group(2)) + 1}/{m.group(3)}"
        self.log.note(f"{text} ...", phase=following)

    def decorated(self, message: str) -> str:
        now = self.clock()
        prev, self._prev = self._prev, now
        m = _COUNTED.search(message)
        if m is None:
            self._counting = None
            return message
        key = (m.group(1), int(m.group(3)))
        done, total = int(m.group(2)), key[1]
        if self._counting is None or self._counting[0] != key:
            self._counting = (key, prev)  # the first one began with the line before it
        left = (now - self._counting[1]) / max(done, 1) * (total - done)
        text = f"{message}, about {left:.0f} s left" if done < total else message
        if self.tty:
            filled = _BAR * done // max(total, 1)
            text = f"[{'#' * filled}{'.' * (_BAR - filled)}] {text}"
        return text

    def close(self) -> None:
        self.log.close()
