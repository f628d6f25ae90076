"""The CUDA kernels' own code, run on the CPU: no GPU, no nvcc, no torch build needed.

tests/kernel_emu/ supplies host stand-ins for the few CUDA built-ins the kernels use (one
OS thread per CUDA thread, a barrier for __syncthreads) and a driver that runs every
kernel of kernels/cache_autogptq_cuda_kernel_256.cu with the .cu's own launch plans
against a double-precision reference: misaligned rows and base addresses, odd D, D above
one tile, several query tiles, tokens split over blocks with the finalize pass; the
tensor-core kernels through a WMMA stand-in (include/mma.h) and the dequantize kernel of the
GEMM path; the same kernels on capacity views (the cache as the first L tokens of
bigger buffers) against the reference and, bit for bit, against contiguous copies; and
quantize_append's kernel against the model's arithmetic, exactly. The
stand-ins abort on a misaligned 16-byte load or a cache read outside the tensor, and the
driver is built with AddressSanitizer where the compiler has it.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from qwen_kvprep.resources import kernels_dir
from tests import needs

pytestmark = pytest.mark.slow

EMU = Path(__file__).resolve().parent / "kernel_emu"


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cxx = needs.cxx_compiler()
    out = tmp_path_factory.mktemp("kernel_emu") / "emu"
    base = [
        cxx,
        "-std=c++20",
        "-O1",
        "-pthread",
        "-ffp-contract=off",  # the .cu's _rn intrinsics are plain operations here
        f"-I{EMU / 'include'}",
        f"-I{kernels_dir()}",
        str(EMU / "emu_main.cpp"),
        "-o",
        str(out),
    ]
    errors = []
    for extra in (["-fsanitize=address,undefined", "-fno-sanitize-recover=all"], []):
        res = subprocess.run([*base, *extra], capture_output=True, text=True)
        if res.returncode == 0:
            return out
        errors.append(res.stderr[-2000:])
    if any("barrier" in e or "_Float16" in e for e in errors):
        needs.skip("tool", f"this compiler lacks C++20 <barrier> or _Float16:\n{errors[-1]}")
    raise AssertionError("building the kernel emulator failed:\n" + "\n".join(errors))


def test_cuda_kernels_match_reference_when_emulated(emulator: Path) -> None:
    res = subprocess.run([str(emulator)], capture_output=True, text=True, timeout=600)
    report = res.stdout + res.stderr
    assert res.returncode == 0, report
    assert "ALL OK" in res.stdout, report
    assert "FAIL" not in res.stdout, report
    # Both kernels, including the split-token path, actually ran.
    assert res.stdout.count("\nqk ") + res.stdout.startswith("qk ") >= 5, report
    assert "splits=3" in res.stdout, report
    # The tensor-core kernels (exact and single-rounding P·V) and the GEMM path's dequantize.
    for tag in ("qk[tc]", "pv[tc]", "pv[tc1]", "dequant"):
        assert res.stdout.count(f"\n{tag} ") >= 1, f"no {tag} case ran:\n{report}"
    # Capacity views through every kernel, compared with contiguous copies.
    lines = res.stdout.splitlines()
    for tag in ("qk", "qk[tc]", "pv", "pv[tc]", "pv[tc1]"):
        views = [ln for ln in lines if ln.startswith(f"{tag} ") and "view == contiguous" in ln]
        assert views, f"no {tag} capacity-view case ran:\n{report}"
    assert any(ln.startswith("pv ") and "view" in ln and "splits=1:" not in ln for ln in lines)
    assert sum(ln.startswith("dequant ") and "cap=" in ln for ln in lines) >= 3, report
    # quantize_append in every dtype, both layouts, per chunk and per token.
    for dt in ("f32", "f16", "bf16"):
        for key in (0, 1):
            for per_token in (0, 1):
                tag = f"qa[{dt}] "
                words = f"key_layout={key} per_token={per_token}"
                assert any(ln.startswith(tag) and words in ln for ln in lines), (tag, words)
