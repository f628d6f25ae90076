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

from qwen_kvprep.buildcache.manifest import EXTENSION_NAME
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
    assert f"PyInit_{EXTENSION_NAME}" in syms
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


# ---- capacity views: mat/scales/zeros as the first L tokens of bigger buffers ----------

# (B, H, D, L, C): L = C, L < C, C not a multiple of 16, L = 1, odd L
CAPACITY_SHAPES = [
    (2, 3, 64, 32, 32),
    (2, 3, 64, 40, 64),
    (1, 2, 80, 7, 21),
    (2, 2, 128, 1, 48),
    (1, 3, 16, 129, 144),
    (3, 1, 3, 5, 9),
]


def capacity_views(
    b: int, h: int, d: int, seq: int, cap: int, seed: int, key: bool, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mat, scales, zeros as views of the first `seq` tokens of capacity-`cap` buffers whose
    unused tail holds garbage (0xFF codes, NaN scales), so a read past L shows."""
    g = torch.Generator().manual_seed(seed)
    shape = (b, h, d, cap) if key else (b, h, cap, d)
    buf = torch.full(shape, 255, dtype=torch.uint8, device=device)
    sbuf = torch.full((b, h, cap, 1), float("nan"), dtype=torch.float16, device=device)
    zbuf = torch.full((b, h, cap, 1), float("nan"), dtype=torch.float16, device=device)
    if key:
        mat = buf[..., :seq]
    else:
        mat = buf[:, :, :seq, :]
    mat.copy_(torch.randint(0, 256, mat.shape, generator=g, dtype=torch.uint8))
    scales, zeros = _scales_zeros(g, b, h, seq)  # copied across devices by copy_
    sbuf[:, :, :seq].copy_(scales)
    zbuf[:, :, :seq].copy_(zeros)
    return mat, sbuf[:, :, :seq], zbuf[:, :, :seq]


@pytest.mark.parametrize(("b", "h", "d", "seq", "cap"), CAPACITY_SHAPES)
@pytest.mark.parametrize("q", (1, 5, 40))  # decode, short block, the CPU GEMM route
def test_capacity_views_equal_contiguous_copies(
    ext: ModuleType, b: int, h: int, d: int, seq: int, cap: int, q: int
) -> None:
    g = torch.Generator().manual_seed(seq * 7 + cap + q)
    mat, scales, zeros = capacity_views(b, h, d, seq, cap, seed=cap + q, key=True)
    assert seq == cap or not mat.is_contiguous()
    vec = torch.randn(b, h, q, d, generator=g).half()
    got = torch.full((b, h, q, seq), float("nan"), dtype=torch.float16)
    want = got.clone()
    getattr(ext, QK)(vec, mat, got, scales, zeros)
    getattr(ext, QK)(vec, mat.contiguous(), want, scales.contiguous(), zeros.contiguous())
    assert torch.equal(got, want)

    mat, scales, zeros = capacity_views(b, h, d, seq, cap, seed=cap + q + 1, key=False)
    vec = torch.randn(b, h, q, seq, generator=g).half()
    got = torch.full((b, h, q, d), float("nan"), dtype=torch.float16)
    want = got.clone()
    getattr(ext, PV)(vec, mat, got, scales, zeros)
    getattr(ext, PV)(vec, mat.contiguous(), want, scales.contiguous(), zeros.contiguous())
    assert torch.equal(got, want)
    assert_close(got, *ref_pv(vec, mat, scales, zeros))


def test_capacity_views_mixed_with_contiguous_scales_when_heads_are_one(
    ext: ModuleType,
) -> None:
    """B = H = 1: contiguous scales fit any capacity, so they go with a view of mat."""
    mat, scales, zeros = capacity_views(1, 1, 32, 9, 24, seed=1, key=True)
    vec = torch.randn(1, 1, 2, 32).half()
    got = torch.empty(1, 1, 2, 9, dtype=torch.float16)
    want = torch.empty_like(got)
    getattr(ext, QK)(vec, mat, got, scales.contiguous(), zeros.contiguous())
    getattr(ext, QK)(vec, mat.contiguous(), want, scales.contiguous(), zeros.contiguous())
    assert torch.equal(got, want)


def _view_args(fn: str) -> Args:
    mat, scales, zeros = capacity_views(2, 3, 16, 9, 24, seed=3, key=fn == QK)
    vec = torch.randn(2, 3, 4, 16 if fn == QK else 9).half()
    mul = torch.zeros(2, 3, 4, 9 if fn == QK else 16, dtype=torch.float16)
    return [vec, mat, mul, scales, zeros]


def _wrong_axis_view(t: torch.Tensor) -> torch.Tensor:
    # A view cut along another axis than the token axis: not a capacity view.
    big = torch.zeros(*t.shape[:-1], t.shape[-1] + 3, dtype=t.dtype)
    view = big[..., : t.shape[-1]]
    view.copy_(t)
    return view


@pytest.mark.parametrize("fn", (QK, PV))
@pytest.mark.parametrize(
    ("which", "change", "words"),
    [
        (1, _non_contiguous, "must be contiguous"),
        (3, _non_contiguous, "must be contiguous"),
        (4, lambda t: t.contiguous(), "same token capacity"),  # C = L beside C = 24
        (0, lambda t: t.transpose(-1, -2).contiguous().transpose(-1, -2), "vec must be contig"),
        (2, _wrong_axis_view, "mul must be contiguous"),
    ],
)
def test_refused_layouts_beside_capacity_views(
    ext: ModuleType,
    fn: str,
    which: int,
    change: Callable[[torch.Tensor], torch.Tensor],
    words: str,
) -> None:
    args = _view_args(fn)
    if fn == PV and which == 1:
        args[1] = args[1].contiguous()  # a transposed copy of a contiguous PV cache
        args[3], args[4] = args[3].contiguous(), args[4].contiguous()
    args[which] = change(args[which])
    with pytest.raises(ValueError, match=words) as info:
        getattr(ext, fn)(*args)
    assert fn in str(info.value)


def test_pv_mat_cut_along_head_dim_is_refused(ext: ModuleType) -> None:
    vec, mat, mul, scales, zeros = pv_args()
    with pytest.raises(ValueError, match=r"must be contiguous .* or the first L tokens"):
        getattr(ext, PV)(vec, _wrong_axis_view(mat), mul, scales, zeros)


def test_qk_rows_overlapping_is_refused(ext: ModuleType) -> None:
    """Strides that say C < L (rows overlap) are not a capacity view."""
    vec, mat, mul, scales, zeros = qk_args()
    flat = torch.zeros(2 * 3 * 16 * 9, dtype=torch.uint8)
    squeezed = flat.as_strided(mat.shape, (3 * 16 * 5, 16 * 5, 5, 1))
    with pytest.raises(ValueError, match="holds C = 5 tokens, fewer than the L = 9"):
        getattr(ext, QK)(vec, squeezed, mul, scales, zeros)


def test_output_inside_the_capacity_buffer_is_refused(ext: ModuleType) -> None:
    """mul must not share memory with a view, which torch's own overlap test cannot tell."""
    vec, mat, scales, _ = make_pv(1, 2, 4, 16, 9, seed=11)
    big = torch.zeros(200, dtype=torch.float16)
    sbuf = big[:24].view(1, 2, 12, 1)
    sbuf[:, :, :9].copy_(scales)
    mul = big[10:138].view(1, 2, 4, 16)
    zbuf = torch.zeros(1, 2, 12, 1, dtype=torch.float16)
    mbuf = torch.zeros(1, 2, 12, 16, dtype=torch.uint8)
    mbuf[:, :, :9].copy_(mat)
    mat = mbuf[:, :, :9]
    with pytest.raises(ValueError, match="share memory with scales"):
        getattr(ext, PV)(vec, mat, mul, sbuf[:, :, :9], zbuf[:, :, :9])
    # The same views beside an unrelated output are fine.
    getattr(ext, PV)(
        vec, mat, torch.empty(1, 2, 4, 16, dtype=torch.float16), sbuf[:, :, :9], zbuf[:, :, :9]
    )


def test_features_name_the_additions(ext: ModuleType) -> None:
    assert {"capacity-views", "quantize-append"} <= set(ext.features())


# ---- quantize_append -------------------------------------------------------------------


def quantize_reference(
    x: torch.Tensor, per_token: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The model's quantization in torch, in x's dtype: codes [B,H,S,D] uint8, scale and
    zero [B,H,S,1] fp16 (per-chunk values repeated over the S tokens)."""
    f = x.permute(0, 2, 1, 3)  # [B, H, S, D]
    flat = f if per_token else f.flatten(2)
    mx = flat.amax(-1, keepdim=True)
    mn = flat.amin(-1, keepdim=True)
    scale = (mx - mn) / torch.tensor(255)
    zero = torch.tensor(0) - mn / scale
    s4 = scale if per_token else scale.unsqueeze(-1)
    z4 = zero if per_token else zero.unsqueeze(-1)
    # clamped in fp32: exact, and torch < 2.1 has no fp16 clamp on the CPU
    q = torch.clamp((f / s4 + z4).float(), 0, 255).to(torch.uint8)
    shape = (*f.shape[:3], 1)
    return q, s4.half().expand(shape), z4.half().expand(shape)


def qa_buffers(
    b: int, h: int, d: int, cap: int, key: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(cap * 3 + d)
    codes = torch.randint(
        0, 256, (b, h, d, cap) if key else (b, h, cap, d), generator=g, dtype=torch.uint8
    )
    scales = torch.randn(b, h, cap, 1, generator=g).half()
    zeros = torch.randn(b, h, cap, 1, generator=g).half()
    return codes, scales, zeros


def projection_slice(
    b: int, s: int, h: int, d: int, dtype: torch.dtype, seed: int, device: str = "cpu"
) -> torch.Tensor:
    """x as the model has it: the key or value third of a fused projection, [B,S,H,D] with
    the strides of a split (not contiguous)."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(b, s, 3 * h * d, generator=g) * 4 + 1.5).to(device=device, dtype=dtype)
    x = qkv[:, :, h * d : 2 * h * d].view(b, s, h, d)
    assert not x.is_contiguous()
    return x


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("key", (False, True))
@pytest.mark.parametrize("per_token", (False, True))
@pytest.mark.parametrize(("s", "pos"), [(1, 0), (1, 37), (5, 3), (37, 0), (19, 45)])
def test_quantize_append_matches_the_models_quantization(
    ext: ModuleType, dtype: torch.dtype, key: bool, per_token: bool, s: int, pos: int
) -> None:
    b, h, d, cap = 2, 3, 24, 64
    x = projection_slice(b, s, h, d, dtype, seed=s * 100 + pos)
    codes, scales, zeros = qa_buffers(b, h, d, cap, key)
    before = (codes.clone(), scales.clone(), zeros.clone())
    assert ext.quantize_append(x, codes, scales, zeros, pos, key, per_token) is None
    q, sc, ze = quantize_reference(x, per_token)
    got = codes[..., pos : pos + s].transpose(-1, -2) if key else codes[:, :, pos : pos + s]
    assert torch.equal(got, q), f"{(got != q).sum().item()} codes differ"
    assert torch.equal(scales[:, :, pos : pos + s], sc)
    assert torch.equal(zeros[:, :, pos : pos + s], ze)
    # Everything outside [pos, pos + s) is untouched.
    for new, old in zip((codes, scales, zeros), before):
        keep = torch.ones(new.shape, dtype=torch.bool)
        if key and new is codes:
            keep[..., pos : pos + s] = False
        else:
            keep[:, :, pos : pos + s] = False
        assert torch.equal(new[keep], old[keep])


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
def test_quantize_append_exact_over_many_chunks(ext: ModuleType, dtype: torch.dtype) -> None:
    """Many independent (b, h) chunks with varied ranges: where a division or rounding step
    differs from torch's, some code shows it."""
    b, s, h, d = 4, 3, 64, 32
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(b, s, h, d, generator=g) * torch.rand(1, 1, h, 1, generator=g) * 50).to(dtype)
    x = x.transpose(1, 2).contiguous().transpose(1, 2)  # [B,S,H,D] with heads outermost
    for per_token in (False, True):
        codes, scales, zeros = qa_buffers(b, h, d, s, key=False)
        ext.quantize_append(x, codes, scales, zeros, 0, False, per_token)
        q, sc, ze = quantize_reference(x, per_token)
        assert torch.equal(codes, q)
        assert torch.equal(scales, sc) and torch.equal(zeros, ze)


def test_quantize_append_then_attention_reads_the_buffers(ext: ModuleType) -> None:
    """Decode steps appended in place feed the two functions through capacity views."""
    b, h, d, cap = 1, 2, 16, 32
    kbuf, ks, kz = qa_buffers(b, h, d, cap, key=True)
    g = torch.Generator().manual_seed(9)
    keys = torch.randn(b, 6, h, d, generator=g).half()
    ext.quantize_append(keys[:, :4], kbuf, ks, kz, 0, True, False)
    ext.quantize_append(keys[:, 4:5], kbuf, ks, kz, 4, True, False)
    ext.quantize_append(keys[:, 5:6], kbuf, ks, kz, 5, True, False)
    seq = 6
    query = torch.randn(b, h, 1, d, generator=g).half()
    out = torch.empty(b, h, 1, seq, dtype=torch.float16)
    getattr(ext, QK)(query, kbuf[..., :seq], out, ks[:, :, :seq], kz[:, :, :seq])
    deq = (kbuf[..., :seq].double() - kz[:, :, :seq].double().transpose(-1, -2)) * ks[
        :, :, :seq
    ].double().transpose(-1, -2)
    exact = query.double() @ keys.permute(0, 2, 3, 1).double()
    assert (out.double() - query.double() @ deq).abs().max() < 1e-2
    assert (out.double() - exact).abs().max() < 0.1 * exact.abs().max()


QA_BAD: list[tuple[str, Callable[[Args], Args], type[Exception], str]] = [
    ("x-dtype", _set(0, lambda t: t.double()), TypeError, "x must be torch.float32"),
    ("codes-dtype", _set(1, lambda t: t.to(torch.int8)), TypeError, "codes must be torch.uint8"),
    ("scales-dtype", _set(2, lambda t: t.float()), TypeError, "scales must be torch.float16"),
    ("zeros-dtype", _set(3, lambda t: t.bfloat16()), TypeError, "zeros must be torch.float16"),
    ("x-3d", _set(0, lambda t: t[0]), ValueError, "x must be a 4-d"),
    ("codes-shape", _set(1, lambda t: t[:, :, :, :-1].contiguous()), ValueError, r"\[B, H, C, D\]"),
    ("scales-shape", _set(2, lambda t: t[:, :-1].contiguous()), ValueError, r"\[B, H, C, 1\]"),
    ("zeros-capacity", _set(3, lambda t: t[:, :, :-1].contiguous()), ValueError, "zeros must have"),
    (
        "codes-view",
        _set(1, lambda t: t.transpose(0, 1).contiguous().transpose(0, 1)),
        ValueError,
        "codes must be a contiguous buffer",
    ),
    ("device", _set(2, lambda t: t.to("meta")), RuntimeError, "same device"),
    ("alias", lambda a: [a[0], a[1], a[2], a[2]], ValueError, "scales must not share memory"),
]


def qa_args() -> Args:
    codes, scales, zeros = qa_buffers(2, 3, 8, 10, key=False)
    return [torch.randn(2, 4, 3, 8).half(), codes, scales, zeros]


@pytest.mark.parametrize(
    ("change", "exc", "words"), [pytest.param(c, e, w, id=i) for i, c, e, w in QA_BAD]
)
def test_quantize_append_refuses_bad_input(
    ext: ModuleType, change: Callable[[Args], Args], exc: type[Exception], words: str
) -> None:
    args = change(qa_args())
    before = [t.clone() for t in args[1:] if t.device.type == "cpu"]
    with pytest.raises(exc, match=words) as info:
        ext.quantize_append(*args, 2, False, False)
    assert "quantize_append" in str(info.value)
    assert all(
        torch.equal(a, b) for a, b in zip([t for t in args[1:] if t.device.type == "cpu"], before)
    )


@pytest.mark.parametrize(
    ("pos", "key", "words"),
    [
        (-1, False, "pos must be >= 0"),
        (7, False, r"pos \+ S \(pos = 7, S = 4\) exceeds the buffers' capacity C = 10"),
        (2**62, False, "exceeds the buffers' capacity"),  # no overflow in pos + S
        (0, True, r"\[B, H, D, C\]"),
    ],
)
def test_quantize_append_refuses_bad_positions_and_layouts(
    ext: ModuleType, pos: int, key: bool, words: str
) -> None:
    with pytest.raises(ValueError, match=words):
        ext.quantize_append(*qa_args(), pos, key, False)


def test_quantize_append_on_an_unsupported_device(ext: ModuleType) -> None:
    args = [t.to("meta") for t in qa_args()]
    with pytest.raises(RuntimeError, match="quantize_append: unsupported device meta"):
        ext.quantize_append(*args, 0, False, False)


def test_quantize_append_with_no_tokens_writes_nothing(ext: ModuleType) -> None:
    x, codes, scales, zeros = qa_args()
    before = codes.clone()
    ext.quantize_append(x[:, :0], codes, scales, zeros, 10, False, False)
    assert torch.equal(codes, before)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("value", (0.0, 2.5, -1.0))
def test_quantize_append_constant_tokens_like_torch(
    ext: ModuleType, dtype: torch.dtype, value: float
) -> None:
    """A token whose values are all equal gives scale 0 and a NaN or infinite zero; the
    codes and the stored scale/zero still follow torch (NaN codes become 0)."""
    x = torch.full((1, 3, 2, 40), value, dtype=dtype)
    x[0, 1, 0] = torch.arange(40)
    for per_token in (True, False):
        codes, scales, zeros = qa_buffers(1, 2, 40, 5, key=False)
        ext.quantize_append(x, codes, scales, zeros, 1, False, per_token)
        q, sc, ze = quantize_reference(x, per_token)
        assert torch.equal(codes[:, :, 1:4], q)
        for got, want in ((scales[:, :, 1:4], sc), (zeros[:, :, 1:4], ze)):
            assert bool(((got == want) | (got.isnan() & want.isnan())).all())


# ---- attention_step ----------------------------------------------------------------------


def step_buffers(b: int, h: int, d: int, cap: int) -> Args:
    return [*qa_buffers(b, h, d, cap, key=True), *qa_buffers(b, h, d, cap, key=False)]


def _softmax_last(w: torch.Tensor) -> torch.Tensor:
    """The model's softmax over the last dimension. torch < 2.1 has none in fp16 on the CPU:
    there attention_step goes through fp32 and back, and so does its reference."""
    try:
        return torch.softmax(w, dim=-1)
    except RuntimeError:
        if w.dtype != torch.float16 or w.device.type != "cpu":
            raise
        return torch.softmax(w.float(), dim=-1).half()


def step_reference(
    ext: ModuleType, query_key: torch.Tensor, value: torch.Tensor, bufs: Args, pos: int,
    head_mask: torch.Tensor | None,
) -> torch.Tensor:
    """The model's decoding step with its kernels, one operation at a time from Python:
    quantize the new keys and values into the buffers, then its _attn."""
    b, s, h, d = value.shape
    kbuf, ks, kz, vbuf, vs, vz = bufs
    ext.quantize_append(query_key[:, :, h:], kbuf, ks, kz, pos, True, False)
    ext.quantize_append(value, vbuf, vs, vz, pos, False, False)
    n = pos + s
    query = query_key[:, :, :h].permute(0, 2, 1, 3)
    w = torch.zeros(b, h, s, n, dtype=torch.float16)
    getattr(ext, QK)(query.to(torch.float16).contiguous(), kbuf[..., :n], w, ks[:, :, :n],
                     kz[:, :, :n])
    w = _softmax_last(w / d**0.5).type(query.dtype)
    if head_mask is not None:
        w = w * head_mask
    out = torch.zeros(b, h, s, d, dtype=torch.float16)
    getattr(ext, PV)(w.to(torch.float16).contiguous(), vbuf[:, :, :n], out, vs[:, :, :n],
                     vz[:, :, :n])
    return out.to(query.dtype).transpose(1, 2).contiguous().view(b, s, h * d)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("masked", (False, True))
def test_attention_step_is_the_model_s_step_exactly(
    ext: ModuleType, dtype: torch.dtype, masked: bool
) -> None:
    """One call does what the model's code does with the two kernels, bit for bit, and
    hands back the cache as views of the buffers in the model's layout."""
    b, h, d, cap, pos = 2, 3, 16, 12, 5
    g = torch.Generator().manual_seed(21)
    qkv = (torch.randn(b, 1, 3 * h, d, generator=g) * 3).to(dtype)
    query_key, value = qkv[:, :, : 2 * h], qkv[:, :, 2 * h :]
    head_mask = torch.rand(1, h, 1, 1, generator=g).to(dtype) if masked else None
    bufs = step_buffers(b, h, d, cap)
    mine = [t.clone() for t in bufs]
    want = step_reference(ext, query_key, value, bufs, pos, head_mask)
    context, ((k, ks, kz), (v, vs, vz)) = ext.attention_step(
        query_key, value, *mine, pos, None, False, d**0.5, False, head_mask, False
    )
    assert context.dtype == dtype and torch.equal(context, want)
    assert all(torch.equal(x, y) for x, y in zip(mine, bufs))
    n = pos + 1
    assert k.shape == (b, h, n, d) and torch.equal(k, mine[0][..., :n].transpose(-1, -2))
    assert k.data_ptr() == mine[0].data_ptr() and v.data_ptr() == mine[3].data_ptr()
    for got, buf in zip((ks, kz, vs, vz), (mine[1], mine[2], mine[4], mine[5])):
        assert got.shape == (b, h, n, 1) and got.data_ptr() == buf.data_ptr()


StepArgs = tuple[torch.Tensor, torch.Tensor, Args, int]


def step_args(pos: int = 2) -> StepArgs:
    """fp16 query_key [1, 1, 4, 8] and value [1, 1, 2, 8], buffers for 8 tokens."""
    qkv = torch.randn(1, 1, 6, 8).half()
    return qkv[:, :, :4], qkv[:, :, 4:], step_buffers(1, 2, 8, 8), pos


def _past_capacity(a: StepArgs) -> StepArgs:
    return a[0], a[1], a[2], 8


def _one_set_of_scales(a: StepArgs) -> StepArgs:
    bufs = a[2]
    return a[0], a[1], [*bufs[:4], bufs[1], bufs[5]], a[3]


def _value_inside_key_zeros(a: StepArgs) -> StepArgs:
    bufs = a[2]
    return a[0], bufs[2].view(1, 1, 2, 8), bufs, a[3]  # the 16 fp16 zero points


def _no_keys(a: StepArgs) -> StepArgs:
    return a[0][:, :, :2], a[1], a[2], a[3]


STEP_BAD: list[tuple[str, Callable[[StepArgs], StepArgs], str]] = [
    ("past the capacity", _past_capacity, r"exceeds the buffers' capacity C = 8"),
    ("one set of scales for both", _one_set_of_scales,
     "the key buffers must not share memory with the value buffers"),
    ("values inside the key zeros", _value_inside_key_zeros,
     "the buffers must not share memory with query_key or value"),
    ("query_key without the keys", _no_keys, r"query_key must be \[B, S, 2H, D\]"),
]


@pytest.mark.parametrize(("change", "words"), [pytest.param(c, w, id=i) for i, c, w in STEP_BAD])
def test_attention_step_refuses_before_it_writes(
    ext: ModuleType, change: Callable[[StepArgs], StepArgs], words: str
) -> None:
    query_key, value, bufs, pos = change(step_args())
    before = [t.clone() for t in bufs]
    with pytest.raises(ValueError, match=words) as info:
        ext.attention_step(query_key, value, *bufs, pos, None, False, 1.0, False, None, False)
    assert "attention_step" in str(info.value)
    assert all(torch.equal(x, y) for x, y in zip(bufs, before))
