"""Compile the extension in a process of its own: `python _worker.py SPEC.json`.

Run by builder.py as a plain script (it imports nothing from qwen-kvprep) because:
- torch's JIT versioner renames a second build of the same name in one process to
  `<name>_v1`, whose PyInit symbol the loader would not find;
- the compiler's output goes to file descriptor 1, which is redirected to build.log here;
- a killed parent must take the build down with it (see _die_with_parent), so an orphan
  compiler never keeps writing into a folder that the next builder cleans up.

Writes a JSON result to spec["result"]; the exit status is 0 only on success.
"""

import json
import os
import signal
import sys
import time
import traceback


def _die_with_parent(parent: int) -> None:
    def _kill_group(signum, frame):  # type: ignore[no-untyped-def]
        # ninja and the compilers are in our process group (we lead a new session)
        os.killpg(0, signal.SIGKILL)

    signal.signal(signal.SIGTERM, _kill_group)
    try:
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the parent's cleanup has to do
        pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        _kill_group(signal.SIGTERM, None)


def main() -> int:
    with open(sys.argv[1], encoding="utf-8") as fh:
        spec = json.load(fh)
    _die_with_parent(int(spec["parent"]))
    result = {"ok": False, "stage": "build"}
    start = time.time()
    try:
        from torch.utils import cpp_extension

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
        result.update(ok=True, so=module.__file__)
    except BaseException as exc:  # everything is reported through the result file
        traceback.print_exc()
        result["error"] = f"{type(exc).__name__}: {exc}"[-4000:]
    result["seconds"] = time.time() - start
    sys.stdout.flush()
    with open(spec["result"], "w", encoding="utf-8") as fh:
        json.dump(result, fh)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
