"""`python -m qwen_kvprep ARGS`, or `python -c CODE ARGS`, without paying for `import
torch` in every child.

Each command a test runs starts a new interpreter, and about 2 s of each (as much with the
CUDA build of torch, more under load) is `import torch`, which fix and doctor need and the
suite's several hundred children paid again and again. A template process per test worker
imports torch once and nothing else; each child is forked from it, then made what
`python -m qwen_kvprep ARGS` would be: its own environment (replaced whole, before anything
of ours, transformers or huggingface_hub is imported, since they read it at import), its
own working directory, `sys.argv`, and stdin, stdout and stderr on the pipes the caller
reads, exactly as `subprocess.run(..., capture_output=True)` gives them; it exits as the
interpreter does (non-daemon threads joined, atexit handlers run, the code of SystemExit).

What differs from a real start is only that torch is already imported, so run() refuses
(returns None, and the caller starts a real process) whatever that could change: another
interpreter or a wrapper, interpreter options, a different PYTHON*/locale environment, a
preexec_fn, a call while another is running. `QWEN_KVPREP_TEST_NO_FORK=1` turns the
template off for a whole run.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import locale
import os
import selectors
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Optional

# Read by the interpreter as it starts, or by torch and the libraries it loads as it is
# imported: a child whose environment differs in one of these gets a real interpreter.
# The rest of torch's variables are read later (CUDA_HOME and the build variables by
# torch.utils.cpp_extension, which `import torch` leaves unimported; CUDA_VISIBLE_DEVICES at
# CUDA's first use; TORCHINDUCTOR_* by the compiler, which torch sets in a process that
# used it), and PYTHONPATH is applied to the child's sys.path (see _pythonpath_shadows).
_START_PREFIXES = ("PYTHON", "LC_", "LANG", "LANGUAGE", "LD_", "MALLOC", "OMP_", "MKL_",
                   "KMP_", "GOMP_", "TORCH_CPP_", "TORCH_SHOW_", "TORCH_LOGS", "PYTORCH_JIT")
_READ_LATER = ("PYTHONPATH",)

_TEMPLATE = r'''
import json, os, socket, sys, threading, warnings
import torch  # what every child would import again

sock = socket.socket(fileno=int(sys.argv[1]))
sys.argv = sys.argv[:1]
# what a PYTHONPATH of the child must not shadow, and the path below the template's own
# PYTHONPATH, which a child's PYTHONPATH replaces
own = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
base = [p for p in sys.path[1:] if p not in own]
loaded = sorted({name.split(".")[0] for name in sys.modules})
# torch.utils.cpp_extension reads CUDA_HOME when imported: a torch that imports it with
# itself cannot serve children with their own CUDA_HOME
early = "torch.utils.cpp_extension" in sys.modules
sock.sendall(json.dumps({"modules": loaded, "path": base, "usable": not early}).encode() + b"\n")


def child(request, fds):
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        os.close(fd)
    sock.close()
    code = 1
    try:
        import atexit, builtins, runpy, tempfile, traceback, types
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # read TMPDIR again
        # `python -m` puts the full path of the working directory first, then PYTHONPATH
        extra = request["env"].get("PYTHONPATH", "").split(os.pathsep)
        sys.path[:] = [os.getcwd(), *(os.path.abspath(p) for p in extra if p), *base]
        try:
            if request["code"] is None:
                sys.argv = ["-m", *request["args"]]
                runpy.run_module("qwen_kvprep", run_name="__main__", alter_sys=True)
            else:  # `python -c CODE`: sys.path starts with "", the code runs as __main__
                sys.path[0] = ""
                sys.argv = ["-c", *request["args"]]
                main = types.ModuleType("__main__")
                main.__dict__["__builtins__"] = builtins
                sys.modules["__main__"] = main
                exec(compile(request["code"], "<string>", "exec"), main.__dict__)
            code = 0
        except SystemExit as exc:
            if exc.code is None:
                code = 0
            elif isinstance(exc.code, int):
                code = exc.code & 0xFF
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        threading._shutdown()
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                code = code or 120
    finally:
        os._exit(code)


while True:
    try:
        data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 3)
    except OSError:
        break
    if not data:
        break
    request = json.loads(data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with torch's threads
        pid = os.fork()
    if pid == 0:
        child(request, fds)
    for fd in fds:
        os.close(fd)
    sock.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    _, status = os.waitpid(pid, 0)
    sock.sendall(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
'''


class _Template:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.sock: Optional[socket.socket] = None
        self.env: dict[str, str] = {}
        self.modules: list[str] = []
        self.path: list[str] = []
        self.broken = False

    def start(self) -> bool:
        if self.proc is not None and self.proc.poll() is None:
            return True
        if self.broken:
            return False
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.env = dict(os.environ)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _TEMPLATE, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=self.env,
            )
        except OSError:
            self.broken = True
            return False
        finally:
            theirs.close()
        self.sock = ours
        atexit.register(self.stop)
        # the template's greeting: the modules it imported, its sys.path below PYTHONPATH
        ours.settimeout(300)
        hello = b""
        try:
            while not hello.endswith(b"\n"):
                data = ours.recv(1 << 16)
                if not data:
                    raise OSError("the template process exited")
                hello += data
        except OSError:
            self.broken = True
            return False
        finally:
            ours.settimeout(None)
        greeting = json.loads(hello)
        self.modules, self.path = greeting["modules"], greeting["path"]
        self.broken = not greeting["usable"]
        return not self.broken

    def stop(self) -> None:
        if self.sock is not None:
            self.sock.close()
        if self.proc is not None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


_template = _Template()


def _same_start(env: Mapping[str, str], template: Mapping[str, str]) -> bool:
    def start_vars(e: Mapping[str, str]) -> dict[str, str]:
        return {k: v for k, v in e.items()
                if k.startswith(_START_PREFIXES) and k not in _READ_LATER}

    return start_vars(env) == start_vars(template)


def _pythonpath_shadows(env: Mapping[str, str]) -> bool:
    """Whether a folder of the child's PYTHONPATH that the template does not have could
    hold a module the template imported (a test's stand-in for torch, say): a real start
    would import that one."""
    value = env.get("PYTHONPATH", "")
    entries = value.split(os.pathsep) if value else []
    for entry in entries:
        if not entry:
            return True  # an empty entry means the working directory: not worth the care
        folder = os.path.abspath(entry)
        if folder in _template.path:
            continue
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        tops = {name.split(".")[0] for name in names}
        if tops & set(_template.modules):
            return True
    return False


def run(
    args: Sequence[str],
    env: Optional[Mapping[str, str]],
    cwd: Optional[str],
    timeout: float,
    code: Optional[str] = None,
) -> Optional[subprocess.CompletedProcess[str]]:
    """`python -m qwen_kvprep ARGS` (or `python -c CODE ARGS`) forked from the template, as
    subprocess.run with capture_output=True and text=True would give it; None when it must
    be a real start."""
    if os.environ.get("QWEN_KVPREP_TEST_NO_FORK") == "1" or not hasattr(socket, "send_fds"):
        return None
    child_env = dict(os.environ if env is None else env)
    if not _template.lock.acquire(blocking=False):
        return None
    try:
        if (not _template.start() or not _same_start(child_env, _template.env)
                or _pythonpath_shadows(child_env)):
            return None
        return _run_locked(list(args), child_env, cwd or os.getcwd(), timeout, code)
    finally:
        _template.lock.release()


def _run_locked(
    args: list[str], env: dict[str, str], cwd: str, timeout: float, code: Optional[str]
) -> Optional[subprocess.CompletedProcess[str]]:
    sock = _template.sock
    assert sock is not None
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    request = json.dumps({"args": args, "env": env, "cwd": cwd, "code": code}).encode()
    stdin = 0 if _is_open(0) else os.open(os.devnull, os.O_RDONLY)
    try:
        socket.send_fds(sock, [request], [stdin, out_w, err_w])
    except OSError:
        for fd in (out_r, err_r):
            os.close(fd)
        _template.broken = True
        return None
    finally:
        for fd in (out_w, err_w) + ((stdin,) if stdin else ()):
            os.close(fd)
    deadline = time.monotonic() + timeout
    chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
    replies = b""
    pid: Optional[int] = None
    status: Optional[int] = None
    killed = False
    with selectors.DefaultSelector() as sel:
        sel.register(out_r, selectors.EVENT_READ)
        sel.register(err_r, selectors.EVENT_READ)
        sel.register(sock, selectors.EVENT_READ)
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                if pid is not None and not killed:
                    _kill(pid)  # as subprocess.run does on its timeout
                killed = True
                if now >= deadline + 5:
                    break  # a grandchild still holds the pipes
            for key, _ in sel.select(timeout=max(0.05, min(deadline - now, 1.0))):
                if key.fileobj is sock:
                    data = sock.recv(4096)
                    if not data:
                        sel.unregister(sock)
                        _template.broken = True
                        continue
                    replies += data
                    while b"\n" in replies:
                        line, replies = replies.split(b"\n", 1)
                        msg: dict[str, Any] = json.loads(line)
                        if "pid" in msg:
                            pid = msg["pid"]
                        else:
                            status = msg["status"]
                            sel.unregister(sock)
                    continue
                fd = key.fd
                data = os.read(fd, 65536)
                if data:
                    chunks[fd].append(data)
                else:
                    sel.unregister(fd)
        for fd in chunks:
            os.close(fd)
    out, err = _text(chunks[out_r]), _text(chunks[err_r])
    head = ["-m", "qwen_kvprep"] if code is None else ["-c", code]
    cmd = [sys.executable, *head, *args]
    if killed:
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err)
    if status is None:
        raise RuntimeError(f"the template process of tests/forked.py died running {cmd}")
    return subprocess.CompletedProcess(cmd, status, out, err)


def _text(chunks: list[bytes]) -> str:
    """As subprocess's text mode reads it: the locale's encoding, universal newlines."""
    text = b"".join(chunks).decode(locale.getpreferredencoding(False))
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, 9)

