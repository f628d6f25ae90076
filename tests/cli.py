"""Running `qwen-kvprep` from a test.

`kvprep` starts it in a process of its own, the way a user or a container does; `invoke`
runs the same entry point, `qwen_kvprep.cli.main`, inside the test's process, for tests
that patch what the command sees or that would pay for importing torch once per case.
Both answer with a CompletedProcess, so a test reads either the same way.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any, Optional

from qwen_kvprep.cli import main
from tests import forked

# `python -m qwen_kvprep` of the interpreter running the tests.
ENTRY: tuple[str, ...] = (sys.executable, "-m", "qwen_kvprep")


def kvprep(
    *args: str,
    env: Optional[dict[str, str]] = None,
    cwd: Optional[Path] = None,
    timeout: float = 120,
    entry: Sequence[str] = ENTRY,
    preexec_fn: Optional[Callable[[], object]] = None,
    fork: bool = True,
) -> subprocess.CompletedProcess[str]:
    """`qwen-kvprep ARGS` in a child process, its output captured as text.

    `env` replaces the environment (None: this process's); `entry` is the command that
    starts qwen-kvprep: another interpreter, the console script, or ENTRY behind a wrapper
    such as `unshare`. A child of ENTRY is forked from a process that has imported torch
    (tests/forked.py) where nothing else would differ from a real start; fork=False for a
    test of what a start itself imports or costs."""
    if fork and tuple(entry) == ENTRY and preexec_fn is None:
        forked_run = forked.run(args, env, None if cwd is None else str(cwd), timeout)
        if forked_run is not None:
            return forked_run
    return subprocess.run(
        [*entry, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=cwd,
        preexec_fn=preexec_fn,
    )


def python(
    code: str,
    *args: str,
    env: Optional[dict[str, str]] = None,
    cwd: Optional[Path] = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """`python -c CODE ARGS` in a child process, its output captured as text; forked as
    kvprep's children are where nothing else would differ from a real start (for the
    scripts that load a model as a server would: each import of torch is about 2 s)."""
    forked_run = forked.run(args, env, None if cwd is None else str(cwd), timeout, code)
    if forked_run is not None:
        return forked_run
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


def invoke(*args: str) -> subprocess.CompletedProcess[str]:
    """`qwen-kvprep ARGS` through `cli.main` in this process: its exit code and what it
    wrote to stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            main(list(args))
        except SystemExit as exc:
            code = exc.code
        else:
            raise AssertionError(f"`qwen-kvprep {' '.join(args)}` returned without exiting")
    assert isinstance(code, int), code
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def document(res: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The JSON document a `--json` run printed on stdout."""
    try:
        doc: dict[str, Any] = json.loads(res.stdout)
    except ValueError:
        raise AssertionError(
            f"`{' '.join(res.args)}` printed no JSON (exit {res.returncode}):\n"
            f"{res.stdout}\n{res.stderr}"
        ) from None
    return doc
