"""A wheel carries kernels/ and templates/, found through the installed package."""

from __future__ import annotations

import json
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_wheel_carries_kernels_and_templates(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(dist), str(ROOT)],
        check=True,
        timeout=300,
    )
    (wheel,) = dist.glob("qwen_kvprep-*.whl")
    from qwen_kvprep.templating import wheel_name

    assert wheel.name == wheel_name()  # what the Dockerfile of `template docker` copies
    env_dir = tmp_path / "fresh-venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel)],
                   check=True, timeout=300)
    # Run outside the checkout so only the installed copy can be found.
    probe = (
        "import json, qwen_kvprep.resources as r;"
        "k = r.kernels_dir(); t = r.templates_dir();"
        "print(json.dumps({'k': str(k), 't': str(t),"
        # files only: pip byte-compiles the .py template into a __pycache__ beside it
        " 'kf': sorted(p.name for p in k.iterdir() if p.is_file()),"
        " 'tf': sorted(p.name for p in t.iterdir() if p.is_file())}))"
    )
    out = subprocess.run([str(py), "-I", "-c", probe], check=True, capture_output=True,
                         text=True, cwd=tmp_path, timeout=60)
    found = json.loads(out.stdout)
    site = str(env_dir)
    assert found["k"].startswith(site) and found["t"].startswith(site)
    expected_kernels = sorted(p.name for p in (ROOT / "kernels").iterdir() if p.is_file())
    expected_templates = sorted(p.name for p in (ROOT / "templates").iterdir() if p.is_file())
    assert found["kf"] == expected_kernels
    assert found["tf"] == expected_templates
    assert "cache_autogptq_cuda_256.cpp" in found["kf"]
    # the bytes are the checkout's
    for name in expected_kernels:
        installed = Path(found["k"]) / name
        assert installed.read_bytes() == (ROOT / "kernels" / name).read_bytes()
