"""CUDA builds without a GPU: nvcc + a CUDA build of torch (CI's CUDA stage; here run with
.venv-cuda/bin/python -m pytest -m cuda_build tests/test_build_cuda.py).

Skips, with the reason, where there is no nvcc or torch is a CPU build.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qwen_kvprep.buildcache import arch as archmod
from qwen_kvprep.buildcache.manifest import problem, read_manifest
from qwen_kvprep.probe.binary import read_archs
from qwen_kvprep.probe.toolchain import NvccInfo
from tests import needs

pytestmark = [pytest.mark.cuda_build, pytest.mark.slow]


@pytest.fixture(scope="module")
def nvcc() -> NvccInfo:
    info: NvccInfo = needs.nvcc()
    return info


def test_build_for_two_architectures_links_both(nvcc: NvccInfo, tmp_path: Path) -> None:
    if not {"8.0", "9.0"} <= set(nvcc.arches):
        needs.skip("nvcc", f"nvcc {nvcc.version} cannot target both 8.0 and 9.0")
    env = dict(os.environ, MAX_JOBS=os.environ.get("MAX_JOBS", "2"))
    env.pop("TORCH_CUDA_ARCH_LIST", None)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "qwen_kvprep",
            "build",
            "--arch",
            "8.0;9.0",
            "--cache-dir",
            str(tmp_path),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=1800,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    doc = json.loads(done.stdout)
    build = doc["build"]
    assert build["cuda"] is True and build["compiled"] is True
    folder = Path(build["dir"])
    manifest = read_manifest(folder)
    assert manifest is not None and problem(folder, manifest) is None
    assert manifest["inputs"]["arch_list"] == ["8.0", "9.0"]
    assert manifest["inputs"]["nvcc"] == nvcc.version
    flags = manifest["inputs"]["flags"]["cuda_cflags"]
    assert "-gencode=arch=compute_80,code=sm_80" in flags
    assert "-gencode=arch=compute_90,code=sm_90" in flags
    # the linked binary itself carries exactly that device code
    archs = read_archs(folder / manifest["so"])
    assert archs.error is None
    assert archs.labels() == ["sm_80", "sm_90"]
    # and it loads here without a GPU, with the CUDA entry points linked in
    code = (
        "import importlib.util, sys, torch\n"
        "spec = importlib.util.spec_from_file_location('cache_autogptq_cuda_256', sys.argv[1])\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "print(m.built_with_cuda())\n"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code, str(folder / manifest["so"])],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert loaded.stdout.strip() == "True", loaded.stderr[-3000:]


def test_default_architectures_cover_everything_nvcc_supports(nvcc: NvccInfo) -> None:
    default = archmod.family_default(nvcc.arches)
    assert default[-1].endswith("+PTX")
    for arch in nvcc.arches:
        major, minor = arch.split(".")
        assert archmod.covers(default, (int(major), int(minor))), arch
