"""Our KV-cache extension, CUDA side: it compiles for every architecture the local nvcc
supports, and the full extension (.cpp + .cu) links and imports with a CUDA build of torch.

No GPU is needed. Where one is present, the CUDA results are also checked against a float64
reference. Run with the CUDA torch environment, e.g.
`CUDA_HOME=/usr/local/cuda-13.0 .venv-cuda/bin/python -m pytest -m cuda_build tests/...`.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Optional

import pytest
import torch
import torch.utils.cpp_extension as cpp_extension

from qwen_kvprep.buildcache.builder import nvcc_compile_flags
from qwen_kvprep.probe.toolchain import NvccInfo, torch_info
from qwen_kvprep.resources import KERNEL_FILES, kernels_dir
from tests import needs

pytestmark = [pytest.mark.cuda_build, pytest.mark.slow]

CPP = kernels_dir() / KERNEL_FILES[0]
CU = kernels_dir() / KERNEL_FILES[1]


def _torch_cuda_headers() -> Optional[list[str]]:
    """torch's include dirs, when they carry the c10/cuda headers of a CUDA build."""
    dirs = cpp_extension.include_paths()
    for d in dirs:
        if (Path(d) / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").is_file():
            return dirs
    return None


@pytest.fixture(scope="module")
def toolkit() -> NvccInfo:
    """The CUDA toolkit the builder itself would compile with, matching torch's CUDA."""
    info: NvccInfo = needs.nvcc()
    return info


def test_cu_compiles_for_every_supported_arch(toolkit: NvccInfo, tmp_path: Path) -> None:
    headers = _torch_cuda_headers()
    assert headers is not None, "a CUDA build of torch without its c10/cuda headers"
    # every architecture this nvcc accepts, and PTX for the newest
    arch_list = (*toolkit.arches[:-1], f"{toolkit.arches[-1]}+PTX")
    archs = [a.replace(".", "") for a in toolkit.arches]
    cmd = [
        str(toolkit.nvcc),
        # what the builder gives nvcc with this torch (C++ standard, ABI, torch's flags)
        *nvcc_compile_flags(torch_info(), arch_list),
        *(f"-I{d}" for d in headers),
        "--resource-usage",
        "-c",
        str(CU),
        "-o",
        str(tmp_path / "kernels.o"),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, f"nvcc failed:\n{res.stdout}\n{res.stderr}"
    report = res.stdout + res.stderr
    # Our source must compile cleanly (nvcc's own notices, e.g. on old targets, are fine).
    ours = [ln for ln in report.splitlines() if CU.name in ln and "warning" in ln.lower()]
    assert not ours, "\n".join(ours)
    for a in archs:  # ptxas reports every kernel it assembled, per target
        assert f"for 'sm_{a}'" in report, f"no code for sm_{a}:\n{report}"
    assert (tmp_path / "kernels.o").stat().st_size > 0


@pytest.fixture(scope="module")
def cuda_ext(
    toolkit: NvccInfo, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ModuleType]:
    cuda_home = toolkit.cuda_home
    archs = [a for a in (80, 90) if f"{a // 10}.{a % 10}" in toolkit.arches]
    build = tmp_path_factory.mktemp("kvprep_cuda_ext")
    with pytest.MonkeyPatch.context() as mp:
        # torch reads the toolkit location from this module global when it builds.
        mp.setattr(cpp_extension, "CUDA_HOME", str(cuda_home))
        mp.setenv("CUDA_HOME", str(cuda_home))
        mp.setenv("TORCH_CUDA_ARCH_LIST", ";".join(f"{a // 10}.{a % 10}" for a in archs))
        mod = cpp_extension.load(
            name="kvprep_test_cuda_ext",
            sources=[str(CPP), str(CU)],
            build_directory=str(build),
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3", "--use_fast_math"],
            verbose=False,
        )
    yield mod


def test_full_extension_links_and_imports(cuda_ext: ModuleType) -> None:
    assert cuda_ext.built_with_cuda() is True
    assert cuda_ext.__file__ is not None
    nm = shutil.which("nm")
    if nm is not None:
        undefined = subprocess.run(
            [nm, "-D", "--undefined-only", cuda_ext.__file__],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "kvprep_v1" not in undefined
        defined = subprocess.run(
            [nm, cuda_ext.__file__], capture_output=True, text=True, check=True
        ).stdout
        for entry in (
            "kvprep_v1_qk_cuda",
            "kvprep_v1_pv_cuda",
            "kvprep_v1_pv_workspace_floats",
            "kvprep_v1_tuning",
            "kvprep_v1_dequant_cuda",
            "kvprep_v1_quantize_append_cuda",
        ):
            assert re.search(rf" [tT] {entry}$", defined, re.M), f"{entry} not defined"


def _inputs(b: int, h: int, q: int, d: int, seq: int, pv: bool, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    vec = torch.randn(b, h, q, seq if pv else d, generator=g).half()
    shape = (b, h, seq, d) if pv else (b, h, d, seq)
    mat = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    scales = (torch.rand(b, h, seq, 1, generator=g) * 0.03 + 0.002).half()
    zeros = (torch.rand(b, h, seq, 1, generator=g) * 255).half()
    mul = torch.full((b, h, q, d if pv else seq), float("nan"), dtype=torch.float16)
    return [vec, mat, mul, scales, zeros]


def _reference(args: list[torch.Tensor], pv: bool) -> tuple[torch.Tensor, torch.Tensor]:
    vec, mat, _, scales, zeros = (t.cpu().double() for t in args)
    if pv:
        dq = (mat - zeros) * scales
    else:
        dq = (mat - zeros.transpose(-1, -2)) * scales.transpose(-1, -2)
    return vec @ dq, vec.abs() @ dq.abs()


def _check(out: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor, rel: float = 2e-5) -> None:
    out = out.cpu()
    assert not torch.isnan(out).any(), "output not fully written"
    tol = ref.abs() * 2.0**-10 + mag * rel + 1e-6
    worst = ((out.double() - ref).abs() - tol).max().item()
    assert worst <= 0, f"error exceeds tolerance by {worst:.3g}"


def test_cuda_build_names_its_features(cuda_ext: ModuleType) -> None:
    assert {"capacity-views", "quantize-append"} <= set(cuda_ext.features())


def test_cpu_path_of_the_cuda_build(cuda_ext: ModuleType) -> None:
    for pv, name in (
        (False, "vecquant8matmul_batched_faster_old"),
        (True, "vecquant8matmul_batched_column_compression_faster_old"),
    ):
        args = _inputs(2, 3, 2, 40, 33, pv, seed=11)
        getattr(cuda_ext, name)(*args)
        _check(args[2], *_reference(args, pv))


GPU_SHAPES = [
    # b, h, q, d, seq: aligned, misaligned rows (seq % 16 != 0), odd d, prefill tiles, splits
    (1, 32, 1, 128, 512),
    (1, 32, 1, 128, 8191),
    (2, 4, 1, 128, 1),
    (2, 4, 1, 128, 129),
    (3, 5, 5, 64, 1000),
    (1, 2, 9, 80, 777),
    (2, 3, 1, 3, 7),
    (1, 2, 3, 600, 40),
    (1, 1, 2, 72, 2050),
    (8, 32, 17, 128, 300),
    (1, 4, 130, 128, 263),  # tensor-core tiles with tails
    (1, 2, 300, 72, 1000),  # the GEMM path by default
]


NEVER = 1 << 40
# cuda_tuning settings that force one CUDA path: tensor-core min Q (QK, PV), PV hi/lo split,
# GEMM-path min Q (QK, PV). The GEMM path rounds each dequantized value to fp16 once.
PATHS = {
    "default": None,
    "cuda-cores": (NEVER, NEVER, -1, NEVER, NEVER),
    "tensor-cores": (1, 1, -1, NEVER, NEVER),
    "gemm": (NEVER, NEVER, -1, 1, 1),
}


def test_cuda_tuning_reads_and_restores(cuda_ext: ModuleType) -> None:
    before = cuda_ext.cuda_tuning()
    assert set(before) == {
        "tensor_core_min_q_qk",
        "tensor_core_min_q_pv",
        "pv_split_fp16",
        "gemm_min_q_qk",
        "gemm_min_q_pv",
    }
    assert before["pv_split_fp16"] == 1
    assert 1 <= before["tensor_core_min_q_qk"] <= before["gemm_min_q_qk"]
    assert 1 <= before["tensor_core_min_q_pv"] <= before["gemm_min_q_pv"]
    prev = cuda_ext.cuda_tuning(7, 8, 0, 9, 10)
    assert prev == before
    assert cuda_ext.cuda_tuning() == {
        "tensor_core_min_q_qk": 7,
        "tensor_core_min_q_pv": 8,
        "pv_split_fp16": 0,
        "gemm_min_q_qk": 9,
        "gemm_min_q_pv": 10,
    }
    cuda_ext.cuda_tuning(*before.values())
    assert cuda_ext.cuda_tuning() == before


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("pv", (False, True), ids=("qk", "pv"))
@pytest.mark.parametrize(("b", "h", "q", "d", "seq"), GPU_SHAPES)
def test_gpu_matches_reference(
    cuda_ext: ModuleType, pv: bool, b: int, h: int, q: int, d: int, seq: int, path: str
) -> None:
    needs.gpu()
    saved = cuda_ext.cuda_tuning()
    setting = PATHS[path]
    if setting is not None:
        cuda_ext.cuda_tuning(*setting)
    try:
        _check_on_gpu(cuda_ext, pv, b, h, q, d, seq, gemm=_takes_gemm(cuda_ext, pv, q))
    finally:
        cuda_ext.cuda_tuning(*saved.values())


def _takes_gemm(cuda_ext: ModuleType, pv: bool, q: int) -> bool:
    return q >= cuda_ext.cuda_tuning()["gemm_min_q_pv" if pv else "gemm_min_q_qk"]


def _check_on_gpu(
    cuda_ext: ModuleType, pv: bool, b: int, h: int, q: int, d: int, seq: int, gemm: bool
) -> None:
    name = (
        "vecquant8matmul_batched_column_compression_faster_old"
        if pv
        else "vecquant8matmul_batched_faster_old"
    )
    args = _inputs(b, h, q, d, seq, pv, seed=b * 7 + q * 3 + seq)
    dev = [t.cuda() for t in args]
    getattr(cuda_ext, name)(*dev)
    torch.cuda.synchronize()
    rel = 2.0**-10 if gemm else 2e-5
    _check(dev[2], *_reference(args, pv), rel=rel)
    # A cache that starts at an odd address (a contiguous slice of a bigger buffer).
    flat = torch.empty(args[1].numel() + 1, dtype=torch.uint8, device="cuda")
    shifted = flat[1:].view(args[1].shape)
    shifted.copy_(dev[1])
    dev[2].fill_(float("nan"))
    getattr(cuda_ext, name)(dev[0], shifted, dev[2], dev[3], dev[4])
    torch.cuda.synchronize()
    _check(dev[2], *_reference(args, pv), rel=rel)


# ---- capacity views and quantize_append on the GPU ---------------------------------------


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(
    ("b", "h", "q", "d", "seq", "cap"),
    # L = C, C % 16 == 0, C not a multiple of 16, one token, odd L, a prefill block
    [(2, 3, 1, 128, 64, 64), (2, 4, 1, 128, 500, 512), (1, 2, 5, 80, 129, 151),
     (2, 2, 1, 128, 1, 48), (1, 4, 130, 128, 263, 300)],
)
def test_gpu_capacity_views_equal_contiguous_copies(
    cuda_ext: ModuleType, b: int, h: int, q: int, d: int, seq: int, cap: int, path: str
) -> None:
    from tests.test_kernels import capacity_views

    needs.gpu()
    saved = cuda_ext.cuda_tuning()
    setting = PATHS[path]
    if setting is not None:
        cuda_ext.cuda_tuning(*setting)
    try:
        for pv, name in (
            (False, "vecquant8matmul_batched_faster_old"),
            (True, "vecquant8matmul_batched_column_compression_faster_old"),
        ):
            mat, scales, zeros = capacity_views(
                b, h, d, seq, cap, seed=cap + q, key=not pv, device="cuda"
            )
            assert seq == cap or not mat.is_contiguous()
            vec = torch.randn(b, h, q, seq if pv else d).half().cuda()
            shape = (b, h, q, d if pv else seq)
            got = torch.full(shape, float("nan"), dtype=torch.float16, device="cuda")
            want = got.clone()
            getattr(cuda_ext, name)(vec, mat, got, scales, zeros)
            getattr(cuda_ext, name)(
                vec, mat.contiguous(), want, scales.contiguous(), zeros.contiguous()
            )
            torch.cuda.synchronize()
            assert torch.equal(got, want), f"{name}: view differs from contiguous copy"
    finally:
        cuda_ext.cuda_tuning(*saved.values())


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32))
@pytest.mark.parametrize("key", (False, True))
@pytest.mark.parametrize("per_token", (False, True))
@pytest.mark.parametrize("s", (1, 37))
def test_gpu_quantize_append_matches_torch_on_the_gpu(
    cuda_ext: ModuleType, dtype: torch.dtype, key: bool, per_token: bool, s: int
) -> None:
    """Exact against the model's quantization run by torch on CUDA in the same dtype."""
    from tests.test_kernels import projection_slice, qa_buffers, quantize_reference

    needs.gpu()
    b, h, d, cap, pos = 2, 8, 128, 64, 7
    x = projection_slice(b, s, h, d, dtype, seed=s + int(key), device="cuda")
    assert not x.is_contiguous()
    codes, scales, zeros = (t.cuda() for t in qa_buffers(b, h, d, cap, key))
    before = [t.clone() for t in (codes, scales, zeros)]
    cuda_ext.quantize_append(x, codes, scales, zeros, pos, key, per_token)
    q, sc, ze = quantize_reference(x, per_token)
    got = codes[..., pos : pos + s].transpose(-1, -2) if key else codes[:, :, pos : pos + s]
    assert torch.equal(got, q), f"{(got != q).sum().item()} codes differ"
    assert torch.equal(scales[:, :, pos : pos + s], sc)
    assert torch.equal(zeros[:, :, pos : pos + s], ze)
    for new, old in zip((codes, scales, zeros), before):
        axis = 3 if (key and new is codes) else 2
        assert torch.equal(new.narrow(axis, 0, pos), old.narrow(axis, 0, pos))
        rest = cap - pos - s
        assert torch.equal(new.narrow(axis, pos + s, rest), old.narrow(axis, pos + s, rest))
