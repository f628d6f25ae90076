"""Our KV-cache extension, CPU build: results against a float64 reference, and bad input.

Builds kernels/cache_autogptq_cuda_256.cpp alone (the CPU-only mode) once per module.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import ModuleType
from typing import Callable

import pytest
import torch

from qwen_kvprep.resources import KERNEL_FILES, kernels_dir
from tests import needs

pytestmark = pytest.mark.slow

QK = "vecquant8matmul_batched_faster_old"
PV = "vecquant8matmul_batched_column_compression_faster_old"


@pytest.fixture(scope="module")
def ext(cpu_kernel_ext: ModuleType) -> ModuleType:
    return cpu_kernel_ext


def _scales_zeros(
    g: torch.Generator, b: int, h: int, seq: int
) -> tuple[torch.Tensor, torch.Tensor]:
    # Like the model's: scale = (max - min) / 255 of a chunk, zero = -min / scale in [0, 255].
    scales = (torch.rand(b, h, seq, 1, generator=g) * 0.03 + 0.002).half()
    zeros = (torch.rand(b, h, seq, 1, generator=g) * 255).half()
    return scales, zeros


def make_qk(
    b: int, h: int, q: int, d: int, seq: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    vec = torch.randn(b, h, q, d, generator=g).half()
    mat = torch.randint(0, 256, (b, h, d, seq), generator=g, dtype=torch.uint8)
    scales, zeros = _scales_zeros(g, b, h, seq)
    return vec, mat, scales, zeros


def make_pv(
    b: int, h: int, q: int, d: int, seq: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    vec = torch.randn(b, h, q, seq, generator=g).half()  # signed, harder than probabilities
    mat = torch.randint(0, 256, (b, h, seq, d), generator=g, dtype=torch.uint8)
    scales, zeros = _scales_zeros(g, b, h, seq)
    return vec, mat, scales, zeros


def ref_qk(
    vec: torch.Tensor, mat: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 result of the interface's formula (docs/qwen-v1.md), and the sum of the
    absolute terms (error scale)."""
    s = scales.double().transpose(-1, -2)  # [B, H, 1, L]
    dq = (mat.double() - zeros.double().transpose(-1, -2)) * s  # [B, H, D, L]
    return vec.double() @ dq, vec.double().abs() @ dq.abs()


def ref_pv(
    vec: torch.Tensor, mat: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    dq = (mat.double() - zeros.double()) * scales.double()  # [B, H, L, D]
    return vec.double() @ dq, vec.double().abs() @ dq.abs()


def assert_close(out: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor) -> None:
    assert not torch.isnan(out).any(), "output not fully written (NaN poison left)"
    err = (out.double() - ref).abs()
    # One fp16 rounding of the result, plus fp32 accumulation error (bounded by the sum of
    # the absolute terms), plus fp16's subnormal spacing.
    tol = ref.abs() * 2.0**-10 + mag * 2e-5 + 1e-6
    worst = (err - tol).max().item()
    assert worst <= 0, f"max error {err.max().item():.3g} exceeds tolerance by {worst:.3g}"


SHAPES_L = (1, 2, 7, 127, 128, 129, 1000)
SHAPES_D = (128, 64, 80, 96, 3)


@pytest.mark.parametrize("seq", SHAPES_L)
@pytest.mark.parametrize("d", SHAPES_D)
@pytest.mark.parametrize("q", (1, 5))
def test_qk_matches_reference(ext: ModuleType, q: int, d: int, seq: int) -> None:
    b, h = 2, 3
    vec, mat, scales, zeros = make_qk(b, h, q, d, seq, seed=seq * 1000 + d * 10 + q)
    mul = torch.full((b, h, q, seq), float("nan"), dtype=torch.float16)
    assert getattr(ext, QK)(vec, mat, mul, scales, zeros) is None
    assert_close(mul, *ref_qk(vec, mat, scales, zeros))


@pytest.mark.parametrize("seq", SHAPES_L)
@pytest.mark.parametrize("d", SHAPES_D)
@pytest.mark.parametrize("q", (1, 5))
def test_pv_matches_reference(ext: ModuleType, q: int, d: int, seq: int) -> None:
    b, h = 2, 3
    vec, mat, scales, zeros = make_pv(b, h, q, d, seq, seed=seq * 1000 + d * 10 + q + 7)
    mul = torch.full((b, h, q, d), float("nan"), dtype=torch.float16)
    assert getattr(ext, PV)(vec, mat, mul, scales, zeros) is None
    assert_close(mul, *ref_pv(vec, mat, scales, zeros))


@pytest.mark.parametrize(("d", "seq"), [(128, 1), (128, 129), (3, 7), (80, 1000)])
def test_prefill_sized_query_blocks(ext: ModuleType, d: int, seq: int) -> None:
    """Q >= 32 takes the CPU GEMM route: same results, fully written."""
    b, h, q = 2, 3, 40
    vec, mat, scales, zeros = make_qk(b, h, q, d, seq, seed=d + seq)
    mul = torch.full((b, h, q, seq), float("nan"), dtype=torch.float16)
    getattr(ext, QK)(vec, mat, mul, scales, zeros)
    assert_close(mul, *ref_qk(vec, mat, scales, zeros))

    vec, mat, scales, zeros = make_pv(b, h, q, d, seq, seed=d + seq + 1)
    mul = torch.full((b, h, q, d), float("nan"), dtype=torch.float16)
    getattr(ext, PV)(vec, mat, mul, scales, zeros)
    assert_close(mul, *ref_pv(vec, mat, scales, zeros))


@pytest.mark.parametrize(
    ("b", "h", "q", "seq"),
    # the last one: 64 heads of 1000 x 128 dequantized in fp32 take two GEMM chunks
    [(2, 32, 1, 1000), (4, 16, 33, 129), (64, 1, 3, 7), (2, 32, 40, 1000)],
)
def test_many_heads_and_query_tiles(ext: ModuleType, b: int, h: int, q: int, seq: int) -> None:
    d = 128
    vec, mat, scales, zeros = make_qk(b, h, q, d, seq, seed=1)
    mul = torch.full((b, h, q, seq), float("nan"), dtype=torch.float16)
    getattr(ext, QK)(vec, mat, mul, scales, zeros)
    assert_close(mul, *ref_qk(vec, mat, scales, zeros))

    vec, mat, scales, zeros = make_pv(b, h, q, d, seq, seed=2)
    mul = torch.full((b, h, q, d), float("nan"), dtype=torch.float16)
    getattr(ext, PV)(vec, mat, mul, scales, zeros)
    assert_close(mul, *ref_pv(vec, mat, scales, zeros))


def test_attention_like_inputs(ext: ModuleType) -> None:
    """Probabilities that sum to one and a cache quantized the way the model does it."""
    g = torch.Generator().manual_seed(3)
    b, h, q, seq, d = 1, 4, 1, 300, 128
    x = torch.randn(b, h, seq, d, generator=g) * 3
    mn = x.amin(dim=(2, 3), keepdim=True)
    mx = x.amax(dim=(2, 3), keepdim=True)
    scale = (mx - mn) / 255
    zero = -mn / scale
    qx = torch.clamp(x / scale + zero, 0, 255).to(torch.uint8)  # [B, H, L, D]
    scales = scale.expand(b, h, seq, 1).half().contiguous()
    zeros = zero.expand(b, h, seq, 1).half().contiguous()

    query = torch.randn(b, h, q, d, generator=g).half()
    scores = torch.full((b, h, q, seq), float("nan"), dtype=torch.float16)
    getattr(ext, QK)(query, qx.transpose(-1, -2).contiguous(), scores, scales, zeros)
    assert_close(scores, *ref_qk(query, qx.transpose(-1, -2), scales, zeros))
    # The quantized scores track the unquantized ones.
    exact = query.double() @ x.double().transpose(-1, -2)
    assert (scores.double() - exact).abs().max() < 0.05 * exact.abs().max()

    probs = torch.softmax(torch.randn(b, h, q, seq, generator=g), dim=-1).half()
    out = torch.full((b, h, q, d), float("nan"), dtype=torch.float16)
    getattr(ext, PV)(probs, qx, out, scales, zeros)
    assert_close(out, *ref_pv(probs, qx, scales, zeros))


def test_output_is_overwritten_not_accumulated(ext: ModuleType) -> None:
    vec, mat, scales, zeros = make_qk(1, 2, 2, 16, 9, seed=4)
    first = torch.zeros(1, 2, 2, 9, dtype=torch.float16)
    getattr(ext, QK)(vec, mat, first, scales, zeros)
    again = first.clone()
    getattr(ext, QK)(vec, mat, again, scales, zeros)
    assert torch.equal(first, again)


def test_empty_sums_write_zeros(ext: ModuleType) -> None:
    vec, mat, scales, zeros = make_qk(1, 2, 3, 0, 5, seed=5)
    mul = torch.full((1, 2, 3, 5), float("nan"), dtype=torch.float16)
    getattr(ext, QK)(vec, mat, mul, scales, zeros)
    assert torch.equal(mul, torch.zeros_like(mul))

    vec, mat, scales, zeros = make_pv(1, 2, 3, 4, 0, seed=6)
    mul = torch.full((1, 2, 3, 4), float("nan"), dtype=torch.float16)
    getattr(ext, PV)(vec, mat, mul, scales, zeros)
    assert torch.equal(mul, torch.zeros_like(mul))


def test_reports_cpu_only_build(ext: ModuleType) -> None:
    assert ext.built_with_cuda() is False


def test_cpu_only_build_has_no_cuda_entry_points(ext: ModuleType) -> None:
    """The weak CUDA entry points resolved to null at link time: nothing left to bind."""
    nm = needs.tool("nm")
    assert ext.__file__ is not None
    syms = subprocess.run(
        [nm, "-D", ext.__file__], capture_output=True, text=True, check=True
    ).stdout
    assert "PyInit_kvprep_test_cpu_ext" in syms
    assert "kvprep_v1" not in syms


# ---- bad input -------------------------------------------------------------------------

Args = list[torch.Tensor]


def qk_args() -> Args:
    vec, mat, scales, zeros = make_qk(2, 3, 4, 16, 9, seed=8)
    return [vec, mat, torch.zeros(2, 3, 4, 9, dtype=torch.float16), scales, zeros]


def pv_args() -> Args:
    vec, mat, scales, zeros = make_pv(2, 3, 4, 16, 9, seed=9)
    return [vec, mat, torch.zeros(2, 3, 4, 16, dtype=torch.float16), scales, zeros]


NAMES = ("vec", "mat", "mul", "scales", "zeros")


def _set(i: int, f: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Args], Args]:
    def change(args: Args) -> Args:
        args = list(args)
        args[i] = f(args[i])
        return args

    return change


def _wrong_dtype(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float16 if t.dtype == torch.uint8 else torch.float32)


def _drop_first_dim(t: torch.Tensor) -> torch.Tensor:
    return t[0]


def _shrink_last_but_one(t: torch.Tensor) -> torch.Tensor:
    return t[:, :, :-1].contiguous()


def _shrink_heads(t: torch.Tensor) -> torch.Tensor:
    return t[:, :-1].contiguous()


def _non_contiguous(t: torch.Tensor) -> torch.Tensor:
    # Same shape and values, transposed memory.
    return t.transpose(0, 1).contiguous().transpose(0, 1)


BAD: list[tuple[str, Callable[[Args], Args], type[Exception], str]] = []
for _i, _n in enumerate(NAMES):
    BAD.append((f"{_n}-dtype", _set(_i, _wrong_dtype), TypeError, f"{_n} must be"))
    BAD.append((f"{_n}-meta", _set(_i, lambda t: t.to("meta")), RuntimeError, "same device"))
    BAD.append((f"{_n}-3d", _set(_i, _drop_first_dim), ValueError, f"{_n} must be a 4-d"))
    BAD.append((f"{_n}-heads", _set(_i, _shrink_heads), ValueError, "must have shape"))
    BAD.append((f"{_n}-noncontig", _set(_i, _non_contiguous), ValueError, "contiguous"))
for _i, _n in enumerate(NAMES):
    if _n != "vec":  # vec defines Q; its dim 2 is free
        BAD.append((f"{_n}-dim2", _set(_i, _shrink_last_but_one), ValueError, "must have shape"))


@pytest.mark.parametrize("fn", (QK, PV))
@pytest.mark.parametrize(
    ("change", "exc", "words"), [pytest.param(c, e, w, id=i) for i, c, e, w in BAD]
)
def test_bad_input_raises(
    ext: ModuleType,
    fn: str,
    change: Callable[[Args], Args],
    exc: type[Exception],
    words: str,
) -> None:
    args = change(qk_args() if fn == QK else pv_args())
    with pytest.raises(exc, match=words) as info:
        getattr(ext, fn)(*args)
    assert fn in str(info.value)


@pytest.mark.parametrize("fn", (QK, PV))
def test_all_tensors_on_an_unsupported_device(ext: ModuleType, fn: str) -> None:
    args = [t.to("meta") for t in (qk_args() if fn == QK else pv_args())]
    with pytest.raises(RuntimeError, match="unsupported device meta"):
        getattr(ext, fn)(*args)


def test_output_aliasing_an_input_is_refused(ext: ModuleType) -> None:
    # PV with L == D: vec and mul have the same shape and dtype.
    vec, mat, scales, zeros = make_pv(1, 2, 3, 8, 8, seed=10)
    with pytest.raises(ValueError, match="share memory"):
        getattr(ext, PV)(vec, mat, vec, scales, zeros)


def test_last_dim_of_scales_must_be_one(ext: ModuleType) -> None:
    vec, mat, mul, scales, zeros = qk_args()
    with pytest.raises(ValueError, match=r"\[B, H, L, 1\]"):
        getattr(ext, QK)(vec, mat, mul, scales.expand(2, 3, 9, 2).contiguous(), zeros)


def test_non_tensor_argument_raises(ext: ModuleType) -> None:
    vec, mat, mul, scales, _ = qk_args()
    with pytest.raises(TypeError):
        getattr(ext, QK)(vec, mat, mul, scales, None)


def test_sources_exist() -> None:
    for name in KERNEL_FILES:
        assert Path(kernels_dir() / name).is_file()
