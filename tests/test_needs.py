"""The test suite's own rules about skips (tests/needs.py, conftest.py): a skip names what
it needs, and a run that allows only some kinds of skip fails on any other."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import needs

SAMPLE = """
from tests import needs

def test_runs():
    pass

def test_no_gpu():
    needs.skip("gpu", "no GPU here")

def test_no_venv():
    needs.skip("venv-4.53", "not made")
"""


def _run(tmp_path: Path, allowed: str | None) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    env = dict(os.environ)
    env.pop(needs.ENV_ALLOWED, None)
    if allowed is not None:
        env[needs.ENV_ALLOWED] = allowed
    return subprocess.run(
        # the project's own configuration (its addopts list every skip's reason)
        [sys.executable, "-m", "pytest", "-q", "-c", str(needs.REPO / "pyproject.toml"),
         "-p", "tests.conftest", "-p", "no:cacheprovider", str(tmp_path / "test_sample.py")],
        cwd=needs.REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_every_skip_allowed_when_unset(tmp_path: Path) -> None:
    done = _run(tmp_path, None)
    assert done.returncode == 0, done.stdout
    assert "needs gpu: no GPU here" in done.stdout  # -ra lists the reasons


def test_a_skip_of_another_kind_fails_the_run(tmp_path: Path) -> None:
    done = _run(tmp_path, "gpu")
    assert done.returncode == 1, done.stdout
    assert "skips this run does not allow" in done.stdout
    assert "test_no_venv" in done.stdout and "needs venv-4.53: not made" in done.stdout
    assert "::test_no_gpu" not in done.stdout.split("does not allow")[1]


def test_all_listed_kinds_pass(tmp_path: Path) -> None:
    assert _run(tmp_path, "gpu, venv-4.53").returncode == 0


def test_kind_of_reads_the_reason() -> None:
    assert needs.kind_of("Skipped: needs gpu: no GPU here") == "gpu"
    assert needs.kind_of("needs nvcc: nvcc 13.0 and torch's CUDA 12.1 differ") == "nvcc"
    assert needs.kind_of("Skipped: could not import 'matplotlib'") is None
    assert needs.kind_of("needs unicorns: none") is None


def test_unknown_kind_is_a_mistake() -> None:
    with pytest.raises(ValueError, match="unknown need"):
        needs.skip("unicorns", "none")
