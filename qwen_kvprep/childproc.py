"""Both ends of the child processes that load models (smoke, profile).

A model is only ever loaded in a child process, so that whatever the model code does
(crash in a CUDA kernel, hang in a JIT build lock, call os._exit, run out of memory)
cannot take the CLI with it, and so that one run's memory peak cannot leak into the next.

Parent side (`run_events_child`): the child runs in its own session (process group), so a
timeout or Ctrl-C kills it and everything it started (ninja, nvcc, a hung CUDA context) in
one signal. A parent killed outright (SIGKILL) sends nothing, so the child arranges its own
end: on Linux the kernel kills it when the parent dies (`die_with_parent`), and a child
whose parent is already gone when it starts exits at once. Its stdout and stderr go to a
log file (a pipe could fill up and stall it; a file cannot), of which the last lines are
quoted when it fails.

Child side (`Events`, `child_main`): one JSON object per line on a dedicated file
descriptor, never on stdout or stderr, where model code and compilers print whatever they
like:

    {"event": "phase", "phase": "load"}            a phase starts
    {"event": "progress", ...}                      anything else a display may show
    {"event": "error", "phase": ..., "type": ..., "message": ..., "traceback": ...}
    {"event": "result", "result": {...}}            everything measured

Light imports only: the CLI imports this module without torch.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import (
    IO,
    Callable,
    Generic,
    Literal,
    NoReturn,
    Optional,
    TypedDict,
    TypeVar,
    Union,
    cast,
)

from qwen_kvprep.fsutil import remove_tree
from qwen_kvprep.jsontypes import JSON

PHASE_START = "start"
PHASE_DONE = "done"
# The parent's pid, for the child to check that it is still there (`die_with_parent`).
ENV_PARENT = "QWEN_KVPREP_PARENT_PID"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


class PhaseEvent(TypedDict):
    event: Literal["phase"]
    phase: str
    t: float  # time.time() when the phase started


class ProgressEvent(TypedDict):
    event: Literal["progress"]
    phase: str
    done: int
    total: int


class ErrorEvent(TypedDict):
    event: Literal["error"]
    phase: str
    type: str  # the exception's class name
    message: str
    traceback: str


class ResultEvent(TypedDict):
    event: Literal["result"]
    result: object  # the child's own result type; JSON once it has travelled


Event = Union[PhaseEvent, ProgressEvent, ErrorEvent, ResultEvent]
# what a display is shown: every event but the result and the error
ShownEvent = Union[PhaseEvent, ProgressEvent]

EventCallback = Callable[[ShownEvent], None]
CommandFactory = Callable[[int], list[str]]  # the event descriptor -> argv

# The result a child sent: JSON as it arrives; smoke and profile each know the type their
# own child builds.
R = TypeVar("R")

# How long a child gets to exit after SIGTERM before SIGKILL: enough for Python to run
# its exit handlers, short enough that a wedged CUDA context does not stall the CLI.
TERM_GRACE_S = 3.0
LOG_TAIL_LINES = 20
_LOG_TAIL_BYTES = 64 * 1024


@dataclass
class ChildOutcome(Generic[R]):
    """What the child said and how it ended."""

    pid: Optional[int] = None  # also the id of its process group
    returncode: Optional[int] = None
    timed_out: bool = False
    elapsed: float = 0.0
    phase: str = PHASE_START
    result: Optional[R] = None
    error: Optional[ErrorEvent] = None
    log_tail: list[str] = field(default_factory=list)
    bad_lines: int = 0  # lines on the event pipe that were not JSON


# -- parent side -----------------------------------------------------------------------------


# In every temporary folder of ours: a file locked (flock) by the process that made the
# folder, for as long as it lives. The kernel drops the lock when that process dies, even
# by SIGKILL, in any pid namespace (a container sharing /tmp), so a folder whose owner file
# is not locked was left by a run that was killed before it could remove it.
OWNER_FILE = ".qwen-kvprep-owner"


def _lock_owner(folder: Path) -> int:
    """The open, locked owner file of `folder`. Locked under a temporary name, then renamed:
    a sweep never sees the owner file unlocked while its folder is in use."""
    pending = folder / f"{OWNER_FILE}.new"
    fd = os.open(pending, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, f"{os.getpid()}\n".encode())
        os.rename(pending, folder / OWNER_FILE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def sweep_tempdirs(prefix: str) -> list[Path]:
    """Remove the temporary folders `prefix`* that killed runs of this user left in the
    temporary folder (TMPDIR): only real folders (never through a link) of this user that
    hold our owner file, with nobody holding its lock. Returns what was removed."""
    removed: list[Path] = []
    try:
        entries = list(os.scandir(tempfile.gettempdir()))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(prefix):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            continue
        try:
            fd = os.open(os.path.join(entry.path, OWNER_FILE),
                         os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO: no wait
        except OSError:
            continue  # not ours (or not readable): left alone
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # its run is alive
            # never through a link, never into a mount inside it (a bind mount's files
            # are someone's own, not this run's leftovers)
            remove_tree(entry.path)
            removed.append(Path(entry.path))
        finally:
            os.close(fd)
    return removed


@contextlib.contextmanager
def owned_tempdir(prefix: str) -> Iterator[Path]:
    """A new temporary folder `prefix`*, removed at the end of the block; what runs killed
    before they could remove theirs left (sweep_tempdirs) is removed first."""
    sweep_tempdirs(prefix)
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        fd = _lock_owner(folder)
    except BaseException:
        remove_tree(folder)
        raise
    try:
        yield folder
    finally:
        try:
            remove_tree(folder)
        finally:
            os.close(fd)



def child_env(extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    env = dict(os.environ)
    # The child must import this very qwen_kvprep, also when it runs from a checkout (the
    # child's working directory is elsewhere). An installed one is found anyway, and a
    # site-packages folder on PYTHONPATH would go ahead of the standard library.
    pkg_parent = Path(__file__).resolve().parents[1]
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
    env.update(extra or {})
    env[ENV_PARENT] = str(os.getpid())
    return env


def _read_events(
    fd: int,
    outcome: ChildOutcome[JSON],
    lock: threading.Lock,
    on_event: Optional[EventCallback],
) -> None:
    with os.fdopen(fd, "r", encoding="utf-8", errors="replace") as stream:
        for line in stream:
            try:
                event: JSON = json.loads(line)
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
                    # written by `child_main` below, in the same installation
                    outcome.error = cast(ErrorEvent, event)
            if kind not in ("result", "error") and on_event is not None:
                try:  # the phase and progress events of `Events` below
                    on_event(cast(ShownEvent, event))
                except Exception as exc:  # a broken display must not break the run ...
                    on_event = None
                    _display_failed(exc)  # ... nor fail unseen


def _display_failed(exc: Exception) -> None:
    """A warning (the library prints nothing itself), then no more progress for this
    child: its result still counts."""
    warnings.warn(
        f"qwen-kvprep: the progress display failed ({type(exc).__name__}: {exc}); "
        "the run goes on without it",
        RuntimeWarning,
        stacklevel=1,
    )


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the child's whole process group, SIGKILL whatever is left after a grace."""
    for sig, wait in ((signal.SIGTERM, TERM_GRACE_S), (signal.SIGKILL, None)):
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


def tail_lines(path: Path, n: int = LOG_TAIL_LINES) -> list[str]:
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


def run_events_child(
    command: CommandFactory,
    timeout: float,
    on_event: Optional[EventCallback] = None,
    env: Optional[dict[str, str]] = None,
    prefix: str = "qwen-kvprep-child-",
) -> ChildOutcome[JSON]:
    """Run `command(fd)` in its own session, bounded by `timeout` seconds, and collect the
    events it writes to descriptor `fd`. Never raises for what the child does."""
    outcome: ChildOutcome[JSON] = ChildOutcome()
    lock = threading.Lock()
    with owned_tempdir(prefix) as tmp:
        log_path = tmp / "child.log"
        read_fd, write_fd = os.pipe()
        try:
            with open(log_path, "wb") as log:
                t0 = time.monotonic()
                proc = subprocess.Popen(
                    command(write_fd),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    pass_fds=(write_fd,),
                    # a neutral working directory: a server's is arbitrary, and the
                    # original cpp_kernels.py only works from one particular folder
                    cwd=tmp,
                    env={**(env if env is not None else child_env()), ENV_PARENT: str(os.getpid())},
                    start_new_session=True,
                )
        except BaseException:
            os.close(read_fd)
            os.close(write_fd)
            raise
        outcome.pid = proc.pid
        os.close(write_fd)  # only the child holds the write end now: EOF when it dies
        reader = threading.Thread(
            target=_read_events, args=(read_fd, outcome, lock, on_event), daemon=True
        )
        reader.start()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            outcome.timed_out = True
            kill_group(proc)
        except BaseException:  # Ctrl-C: the child is in its own session and gets no SIGINT
            kill_group(proc)
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


# -- child side ------------------------------------------------------------------------------


class Events:
    """Line-delimited JSON on the dedicated descriptor; flushed per line so that the
    parent still has everything up to a crash."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.phase = PHASE_START

    def send(self, obj: Event) -> None:
        self.stream.write(json.dumps(obj, default=str) + "\n")
        self.stream.flush()

    def start(self, phase: str) -> None:
        self.phase = phase
        self.send({"event": "phase", "phase": phase, "t": time.time()})


def die_with_parent(environ: Optional[dict[str, str]] = None) -> None:
    """In a child: be killed (SIGKILL) when the parent that started it dies, so a model
    load (minutes on a 72B) never goes on with nobody to stop it. Linux only (prctl);
    the parent's pid from ENV_PARENT closes the race of a parent that died before."""
    env = os.environ if environ is None else environ
    try:
        parent = int(env.get(ENV_PARENT, ""))
    except ValueError:
        return  # not started by run_events_child (a child run by hand)
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)  # the parent died before the line above: nobody waits for us


def exit_child(code: int) -> NoReturn:
    """End a child whose result is written: flush what it printed, then leave without the
    interpreter's teardown. With torch and a model loaded, that teardown (the garbage
    collector going over every object, then the libraries' destructors) took about a
    second of each child's life on a 2-core machine while the parent waited for the exit,
    and nothing in it is ours: events are flushed line by line, and the files a child
    writes are closed before its work returns."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def child_parser(prog: str) -> argparse.ArgumentParser:
    """A model child's options, --fd (where its events go) among them."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument(
        "--fd", type=int, default=None, help="event descriptor (stdout if unset)"
    )
    return parser


def offline_child_main(
    argv: Optional[list[str]],
    parse: Callable[[list[str]], argparse.Namespace],
    work: Callable[[argparse.Namespace, Events], object],
) -> int:
    """child_main for a child that loads models, on its options `argv` (the command
    line's when None): no accidental downloads (the parent sets HF_HUB_OFFLINE too; a child
    run by hand gets it here)."""
    args = parse(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return child_main(args.fd, lambda ev: work(args, ev))


def child_main(fd: Optional[int], work: Callable[[Events], object]) -> int:
    """Run `work` in a child: its result, or the exception it raised, as events on `fd`
    (stdout when None, for running a child by hand)."""
    die_with_parent()
    stream = os.fdopen(fd, "w", encoding="utf-8") if fd is not None else sys.stdout
    if fd is not None:
        # model code, transformers and compilers print freely: send their stdout to our
        # stderr (the parent's log) so nothing can corrupt the event stream
        os.dup2(2, 1)
    ev = Events(stream)
    ev.start(PHASE_START)
    try:
        result = work(ev)
    except BaseException as exc:  # report everything, even SystemExit from model code
        traceback.print_exc()
        ev.send(
            {
                "event": "error",
                "phase": ev.phase,
                "type": type(exc).__name__,
                "message": str(exc),
                "traceback": traceback.format_exc(),
            }
        )
        return 1
    ev.send({"event": "result", "result": result})
    ev.start(PHASE_DONE)
    return 0
