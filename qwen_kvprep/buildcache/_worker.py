"""Compile the extension in a process of its own: `python _worker.py SPEC.json`.

Run by builder.py as a plain script (it imports nothing from qwen-kvprep) because:
- torch's JIT versioner renames a second build of the same name in one process to
  `<name>_v1`, whose PyInit symbol the loader would not find;
- the compiler's output goes to file descriptor 1, which is redirected to build.log here;
- a killed parent must take the build down with it (see _die_with_parent), so an orphan
  compiler never keeps writing into a folder that the next builder cleans up.

Writes a JSON result (WorkerResult) to spec["result"]; the exit status is 0 only on
success.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
import traceback
from typing import TYPE_CHECKING, NoReturn, Optional, TypedDict

if TYPE_CHECKING:
    from types import FrameType, ModuleType


class WorkerSpec(TypedDict):
    """SPEC.json: what to compile and where (builder.py writes it)."""

    parent: int  # the builder's pid: the build dies with it
    name: str  # the extension's module name
    sources: list[str]  # absolute paths of the files to compile
    extra_cflags: list[str]
    extra_cuda_cflags: list[str]
    with_cuda: bool
    # the CUDA toolkit the build uses (None: a CPU-only build); torch is given it as its
    # CUDA_HOME before torch.utils.cpp_extension reads it at import
    cuda_home: Optional[str]
    build_directory: str
    require: list[str]  # functions the built module must have
    result: str  # where to write the WorkerResult


class WorkerResult(TypedDict, total=False):
    ok: bool
    stage: str  # "build" | "import" (compiled, does not load) | "check" (incomplete)
    so: Optional[str]  # the built library, on success
    error: str  # "<exception type>: <message>", on failure
    seconds: float


def _descendants(root: int) -> list[int]:
    """Live processes below `root`, from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":  # zombies are dead already
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _kill_tree(signum: int, frame: Optional[FrameType]) -> NoReturn:
    # ninja starts every compiler in a process group of its own, so killing our group is
    # not enough. As a child subreaper we adopt whatever loses its parent, so the tree
    # below us stays complete while it is being killed.
    for _ in range(100):
        pids = _descendants(os.getpid())
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            pass
        time.sleep(0.02)
    os._exit(1)


def _die_with_parent(parent: int) -> None:
    """When the process that started us dies (SIGKILL included), take the build down."""
    signal.signal(signal.SIGTERM, _kill_tree)
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        pr_set_pdeathsig, pr_set_child_subreaper = 1, 36
        libc.prctl(pr_set_child_subreaper, 1)
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the parent's cleanup has to do
        pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        _kill_tree(signal.SIGTERM, None)


def _import_cpp_extension(cuda_home: Optional[str]) -> ModuleType:
    """torch.utils.cpp_extension with the CUDA home the build uses. The module settles its
    CUDA_HOME when it is imported (from $CUDA_HOME, else `which nvcc`, else
    /usr/local/cuda) and, without a GPU, logs the one it took: its answer must be ours."""
    import contextlib
    import io
    import logging

    if cuda_home:
        os.environ["CUDA_HOME"] = cuda_home
        from torch.utils import cpp_extension

        cpp_extension.CUDA_HOME = cuda_home
        return cpp_extension
    # A CPU-only build uses no CUDA home: torch's guess at one would only mislead. torch
    # >= 2.1 logs it, torch 2.0 prints it to stderr while the module is imported.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    with contextlib.redirect_stderr(io.StringIO()):
        from torch.utils import cpp_extension
    return cpp_extension


def main() -> int:
    with open(sys.argv[1], encoding="utf-8") as fh:
        spec: WorkerSpec = json.load(fh)
    _die_with_parent(int(spec["parent"]))
    result: WorkerResult = {"ok": False, "stage": "build"}
    start = time.time()
    try:
        cpp_extension = _import_cpp_extension(spec.get("cuda_home"))
        print(
            f"qwen-kvprep: building {spec['name']} with MAX_JOBS={os.environ.get('MAX_JOBS')}"
            f" CUDA_HOME={os.environ.get('CUDA_HOME')}",
            flush=True,
        )
        module = None
        try:
            module = cpp_extension.load(
                name=spec["name"],
                sources=spec["sources"],
                extra_cflags=spec["extra_cflags"],
                extra_cuda_cflags=spec["extra_cuda_cflags"] or None,
                build_directory=spec["build_directory"],
                with_cuda=spec["with_cuda"],
                is_python_module=True,
                verbose=True,
            )
        except ImportError:
            # compiled and linked, but does not load (undefined symbol, missing library)
            so = os.path.join(spec["build_directory"], spec["name"] + ".so")
            if os.path.exists(so):
                result["stage"] = "import"
            raise
        result["stage"] = "check"
        missing = [f for f in spec["require"] if not hasattr(module, f)]
        if missing:
            raise RuntimeError(f"the built extension lacks {', '.join(missing)}")
        result["ok"] = True
        result["so"] = module.__file__
    except BaseException as exc:  # everything is reported through the result file
        traceback.print_exc()
        result["error"] = f"{type(exc).__name__}: {exc}"[-4000:]
    result["seconds"] = time.time() - start
    sys.stdout.flush()
    with open(spec["result"], "w", encoding="utf-8") as fh:
        json.dump(result, fh)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    status = main()
    # the result file is closed: leave without the interpreter's teardown of torch (most
    # of a second, with the builder waiting on it)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
