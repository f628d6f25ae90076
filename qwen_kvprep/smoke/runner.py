"""Parent side of the smoke test: run the child, bounded in time, and collect what it said.

The child runs in its own session (process group), so a timeout or Ctrl-C kills it and
everything it started (ninja, nvcc, a hung CUDA context) in one signal. Its stdout and
stderr go to a log file (a pipe could fill up and stall it; a file cannot), of which the
last lines are quoted when it fails. Its findings travel as JSON lines on a dedicated pipe.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from qwen_kvprep.smoke.protocol import (
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_PROMPT,
    DEFAULT_TIMEOUT_S,
    PHASE_START,
)

PhaseCallback = Callable[[str], None]

# How long a child gets to exit after SIGTERM before SIGKILL: enough for Python to run
# its exit handlers, short enough that a wedged CUDA context does not stall the CLI.
_TERM_GRACE_S = 3.0
_LOG_TAIL_LINES = 20
_LOG_TAIL_BYTES = 64 * 1024


@dataclass(frozen=True)
class SmokeOptions:
    device: str = "auto"
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    prompt: str = DEFAULT_PROMPT
    timeout: float = DEFAULT_TIMEOUT_S


@dataclass
class ChildOutcome:
    """What the child said and how it ended."""

    pid: Optional[int] = None  # also the id of its process group
    returncode: Optional[int] = None
    timed_out: bool = False
    elapsed: float = 0.0
    phase: str = PHASE_START
    result: Optional[dict[str, Any]] = None
    error: Optional[dict[str, Any]] = None
    log_tail: list[str] = field(default_factory=list)
    bad_lines: int = 0  # lines on the event pipe that were not JSON


def child_command(directory: Path, options: SmokeOptions, fd: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "qwen_kvprep.smoke.child",
        str(directory),
        "--fd",
        str(fd),
        "--device",
        options.device,
        "--max-new-tokens",
        str(options.max_new_tokens),
        "--prompt",
        options.prompt,
    ]


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    # The child must import this very qwen_kvprep, also when it runs from a checkout (the
    # child's working directory is elsewhere). An installed one is found anyway, and a
    # site-packages folder on PYTHONPATH would go ahead of the standard library.
    pkg_parent = Path(__file__).resolve().parents[2]
    if not pkg_parent.name.endswith("-packages"):
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(pkg_parent), env.get("PYTHONPATH")) if p
        )
    # Flush prints as they happen: after a crash the log must hold the last words.
    env["PYTHONUNBUFFERED"] = "1"
    # A local directory needs no network; without this, a tokenizer or config lookup on an
    # air-gapped host can sit in connection timeouts for minutes before the real error.
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    return env


def _read_events(
    fd: int, outcome: ChildOutcome, lock: threading.Lock, on_phase: Optional[PhaseCallback]
) -> None:
    with os.fdopen(fd, "r", encoding="utf-8", errors="replace") as stream:
        for line in stream:
            try:
                event = json.loads(line)
            except ValueError:
                with lock:
                    outcome.bad_lines += 1
                continue
            if not isinstance(event, dict):
                continue
            kind = event.get("event")
            with lock:
                if kind == "phase":
                    outcome.phase = str(event.get("phase"))
                elif kind == "result":
                    outcome.result = event.get("result")
                elif kind == "error":
                    outcome.error = event
            if kind == "phase" and on_phase is not None:
                with contextlib.suppress(Exception):  # progress display must not break a run
                    on_phase(str(event.get("phase")))


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the child's whole process group, SIGKILL whatever is left after a grace."""
    for sig, wait in ((signal.SIGTERM, _TERM_GRACE_S), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        if wait is None:
            break
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # grandchildren that ignored SIGTERM
    proc.wait()


def tail_lines(path: Path, n: int = _LOG_TAIL_LINES) -> list[str]:
    """Last `n` non-empty lines; progress bars (\\r-rewritten lines) reduced to their end."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - _LOG_TAIL_BYTES))
            data = fh.read()
    except OSError:
        return []
    lines = []
    for raw in data.decode("utf-8", errors="replace").split("\n"):
        line = raw.rstrip("\r").rsplit("\r", 1)[-1].rstrip()
        if line:
            lines.append(line)
    return lines[-n:]


def run_child(
    directory: Path, options: SmokeOptions, on_phase: Optional[PhaseCallback] = None
) -> ChildOutcome:
    outcome = ChildOutcome()
    lock = threading.Lock()
    with tempfile.TemporaryDirectory(prefix="qwen-kvprep-smoke-") as tmp:
        log_path = Path(tmp) / "child.log"
        read_fd, write_fd = os.pipe()
        try:
            with open(log_path, "wb") as log:
                t0 = time.monotonic()
                proc = subprocess.Popen(
                    child_command(directory, options, write_fd),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    pass_fds=(write_fd,),
                    # a neutral working directory: a server's is arbitrary, and the
                    # original cpp_kernels.py only works from one particular folder
                    cwd=tmp,
                    env=child_env(),
                    start_new_session=True,
                )
        except BaseException:
            os.close(read_fd)
            os.close(write_fd)
            raise
        outcome.pid = proc.pid
        os.close(write_fd)  # only the child holds the write end now: EOF when it dies
        reader = threading.Thread(
            target=_read_events, args=(read_fd, outcome, lock, on_phase), daemon=True
        )
        reader.start()
        try:
            proc.wait(timeout=options.timeout)
        except subprocess.TimeoutExpired:
            outcome.timed_out = True
            _kill_group(proc)
        except BaseException:  # Ctrl-C: the child is in its own session and gets no SIGINT
            _kill_group(proc)
            raise
        else:
            # the child is gone; anything it left running in its group goes with it
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        outcome.elapsed = time.monotonic() - t0
        outcome.returncode = proc.returncode
        reader.join(timeout=5.0)
        outcome.log_tail = tail_lines(log_path)
    return outcome
