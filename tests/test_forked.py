"""tests/forked.py: a child forked from the template answers as a real start does."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import forked
from tests.cli import ENTRY


def _real(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*ENTRY, *args], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=120)


def _forked(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    if os.environ.get("QWEN_KVPREP_TEST_NO_FORK") == "1":
        pytest.skip("QWEN_KVPREP_TEST_NO_FORK=1 turns the template off")
    res = forked.run(args, env, str(cwd), 120)
    assert res is not None, "the template refused a plain start"
    return res


@pytest.mark.parametrize("args", [
    ["--version"],
    ["doctor", "--no-such-option"],
    ["--json", "doctor", "--check", "env.no_such_check"],
    ["revert", "no-such-folder"],
])
def test_same_answer_as_a_real_start(tmp_path: Path, args: list[str]) -> None:
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"))
    real, fork = _real(args, env, tmp_path), _forked(args, env, tmp_path)
    assert (fork.returncode, fork.stdout, fork.stderr) == (
        real.returncode, real.stdout, real.stderr)


_CODE = """
import os, sys
print(__name__, repr(sys.argv), repr(sys.path[0]), os.getcwd(), os.environ.get("PROBE"))
print("to stderr", file=sys.stderr)
try:
    import __main__
    print("main", __main__.__dict__.get("__file__"), "torch" in dir(__main__))
finally:
    raise SystemExit(int(sys.argv[2]))
"""


def test_python_code_answers_as_python_c_does(tmp_path: Path) -> None:
    """`python -c CODE ARGS`: the same argv, sys.path[0], __main__, environment, folder,
    output and exit code as a real `python -c`."""
    if os.environ.get("QWEN_KVPREP_TEST_NO_FORK") == "1":
        pytest.skip("QWEN_KVPREP_TEST_NO_FORK=1 turns the template off")
    env = dict(os.environ, PROBE="the child's")
    args = ["an argument", "3"]
    real = subprocess.run([sys.executable, "-c", _CODE, *args], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=120)
    fork = forked.run(args, env, str(tmp_path), 120, code=_CODE)
    assert fork is not None, "the template refused a plain start"
    assert real.returncode == 3 and "the child's" in real.stdout, real.stdout + real.stderr
    assert (fork.returncode, fork.stdout, fork.stderr) == (
        real.returncode, real.stdout, real.stderr)


def test_the_environment_and_the_folder_are_the_childs(tmp_path: Path) -> None:
    """The environment is replaced whole (HF_HOME names the modules cache doctor reports),
    a relative DIR is read from the child's working directory."""
    (tmp_path / "here").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env["HF_HOME"] = str(tmp_path / "a-home-of-its-own")
    args = ["doctor", "here", "--check", "modules.cache"]
    fork = _forked(args, env, tmp_path)
    assert str(tmp_path / "a-home-of-its-own") in fork.stdout, fork.stdout + fork.stderr
    real = _real(args, env, tmp_path)
    assert (fork.returncode, fork.stdout) == (real.returncode, real.stdout)


def test_a_timeout_kills_the_child_as_subprocess_run_does(tmp_path: Path) -> None:
    """The child (here a stand-in for the CLI that only sleeps, first on its PYTHONPATH) is
    killed at the timeout and TimeoutExpired raised, as subprocess.run does."""
    if os.environ.get("QWEN_KVPREP_TEST_NO_FORK") == "1":
        pytest.skip("QWEN_KVPREP_TEST_NO_FORK=1 turns the template off")
    marker = tmp_path / "pid"
    slow = tmp_path / "site" / "qwen_kvprep"
    slow.mkdir(parents=True)
    (slow / "__init__.py").write_text("")
    (slow / "__main__.py").write_text(
        f"import os, time\nopen({str(marker)!r}, 'w').write(str(os.getpid()))\ntime.sleep(60)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(slow.parent))
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        forked.run([], env, str(tmp_path), 5)
    assert time.monotonic() - start < 30
    pid = int(marker.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return  # killed and reaped by the template
        time.sleep(0.1)
    raise AssertionError(f"the timed-out child {pid} still runs")


def test_a_stand_in_for_torch_gets_a_real_start(tmp_path: Path) -> None:
    """A PYTHONPATH folder holding a module the template imported (here torch) would be
    imported by a real start, so the template refuses and kvprep starts an interpreter."""
    shim = tmp_path / "shim"
    (shim / "torch").mkdir(parents=True)
    (shim / "torch" / "__init__.py").write_text("raise ImportError('a stand-in')\n")
    env = dict(os.environ, PYTHONPATH=str(shim))
    assert forked.run(["--version"], env, str(tmp_path), 60) is None
