"""Benchmark our Int8 KV-cache kernels against what the model would do without them.

For each shape it first checks the extension against a float64 reference on fresh random
inputs, then times:

  ext       our kernel (vecquant8matmul_batched_faster_old / ..._column_compression_...)
  ext+T     QK only: the kernel plus the `.transpose(-1, -2).contiguous()` of the key cache
            that modeling_qwen.py does before every call
  deq+mm    the pure-torch fallback: `scale * (q - zero)` to fp16, then torch.matmul
  fp16 mm   the unquantized fp16 matmul of the same shapes (what no Int8 cache costs)

GPU: CUDA events, warm-up, median of many, inputs rotated over several copies so the L2
cache does not flatter. CPU: time.perf_counter, same structure. The effective bandwidth
counts the bytes the operation must move at least (quantized: uint8 cache + fp16 scales
and zeros + fp16 input + fp16 output; fp16 mm: fp16 cache + input + output) and is
compared with a measured device-to-device (or RAM) copy.

On CUDA each op has two kernels: CUDA cores (decoding, short query blocks) and tensor
cores (long query blocks), chosen by the query length. `--sweep` times both on a grid of
query lengths and prints the crossover the extension's default threshold comes from.
`--targets` checks the performance targets (decode: >= 4x the fallback and >= 60% of the
copy bandwidth at B = 32, L >= 2048; prefill: >= 1.0x the fallback everywhere).

    python bench/kernels.py                 # GPU if there is one, else CPU; full set
    python bench/kernels.py --quick         # a few shapes
    python bench/kernels.py --sweep         # CUDA: crossover between the two kernels
    python bench/kernels.py --floors        # byte counts and bandwidth floors only
    python bench/kernels.py --json FILE     # also write every row as JSON
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable, Optional

import torch

KERNELS = Path(__file__).resolve().parent.parent / "kernels"
CPP = KERNELS / "cache_autogptq_cuda_256.cpp"
CU = KERNELS / "cache_autogptq_cuda_kernel_256.cu"
QK = "vecquant8matmul_batched_faster_old"
PV = "vecquant8matmul_batched_column_compression_faster_old"
H, D = 32, 128  # Qwen-7B: 32 heads of 128


@dataclass(frozen=True)
class Shape:
    phase: str  # "decode" or "prefill"
    b: int
    q: int
    seq: int  # cached tokens (L)

    def quant_bytes(self, op: str) -> int:
        """Least bytes moved by the quantized op: cache, scales+zeros, input, output."""
        cache = self.b * H * self.seq * D
        sz = 2 * 2 * self.b * H * self.seq
        vec = 2 * self.b * H * self.q * (D if op == "qk" else self.seq)
        out = 2 * self.b * H * self.q * (self.seq if op == "qk" else D)
        return cache + sz + vec + out

    def fp16_bytes(self, op: str) -> int:
        cache = 2 * self.b * H * self.seq * D
        vec = 2 * self.b * H * self.q * (D if op == "qk" else self.seq)
        out = 2 * self.b * H * self.q * (self.seq if op == "qk" else D)
        return cache + vec + out

    def flops(self) -> int:
        return 2 * self.b * H * self.q * self.seq * D


def shape_set(quick: bool) -> list[Shape]:
    if quick:
        out = [Shape("decode", b, 1, s) for b in (1, 8) for s in (512, 2048)]
        out += [Shape("prefill", 1, 128, s) for s in (512, 2048)]
        return out
    out = [Shape("decode", b, 1, s) for b in (1, 8, 32) for s in (512, 2048, 8192)]
    out += [
        Shape("prefill", b, q, s) for q in (128, 512) for b in (1, 8, 32) for s in (512, 2048, 8192)
    ]
    return out


# ---- building ---------------------------------------------------------------------------


def _cuda_home() -> Optional[str]:
    import torch.utils.cpp_extension as ce

    for c in (os.environ.get("CUDA_HOME"), ce.CUDA_HOME, "/usr/local/cuda"):
        if (
            c
            and Path(c, "bin", "nvcc").is_file()
            and Path(c, "include", "cuda_runtime.h").is_file()
        ):
            return c
    return None


def build(device: str, build_root: Optional[str]) -> ModuleType:
    import torch.utils.cpp_extension as ce

    sources = [CPP] if device == "cpu" else [CPP, CU]
    h = hashlib.sha256()
    for s in sources:
        h.update(s.read_bytes())
    h.update(torch.__version__.encode())
    if device == "cuda":
        cap = torch.cuda.get_device_capability()
        arch = os.environ.get("TORCH_CUDA_ARCH_LIST") or f"{cap[0]}.{cap[1]}"
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch
        h.update(arch.encode())
        home = _cuda_home()
        if home is None:
            sys.exit("no CUDA toolkit found (set CUDA_HOME): cannot build the CUDA kernels")
        ce.CUDA_HOME = home
        os.environ["CUDA_HOME"] = home
    key = h.hexdigest()[:16]
    root = Path(build_root or Path(tempfile.gettempdir()) / "qwen-kvprep-bench")
    bdir = root / f"{device}-{key}"
    bdir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MAX_JOBS", str(max(1, min(4, os.cpu_count() or 1))))
    t0 = time.perf_counter()
    mod = ce.load(
        name=f"kvprep_bench_{device}_{key}",
        sources=[str(s) for s in sources],
        build_directory=str(bdir),
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3", "--use_fast_math"],
        verbose=False,
    )
    print(f"# extension ready in {time.perf_counter() - t0:.1f} s ({bdir})")
    return mod


# ---- inputs and reference ---------------------------------------------------------------


@dataclass
class Inputs:
    query: torch.Tensor  # [B,H,Q,D] fp16
    probs: torch.Tensor  # [B,H,Q,L] fp16
    k_q: torch.Tensor  # [B,H,L,D] uint8, the model's cache layout
    k_t: torch.Tensor  # [B,H,D,L] uint8, transposed for the QK kernel
    v_q: torch.Tensor  # [B,H,L,D] uint8
    k_s: torch.Tensor  # [B,H,L,1] fp16
    k_z: torch.Tensor
    v_s: torch.Tensor
    v_z: torch.Tensor
    k16: torch.Tensor  # [B,H,L,D] fp16, unquantized
    v16: torch.Tensor
    out_qk: torch.Tensor  # [B,H,Q,L] fp16
    out_pv: torch.Tensor  # [B,H,Q,D] fp16


def input_bytes(s: Shape) -> int:
    """Device memory of one `make_inputs` set (cache three times, fp16 copies, I/O)."""
    cache = s.b * H * s.seq * D
    return 3 * cache + 4 * cache + 8 * s.b * H * s.seq + 2 * s.b * H * s.q * (2 * s.seq + 2 * D)


def make_inputs(s: Shape, device: str, seed: int, with_fp16: bool = True) -> Inputs:
    g = torch.Generator(device=device).manual_seed(seed)
    b, q, n = s.b, s.q, s.seq

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float16)

    def u8(*shape: int) -> torch.Tensor:
        return torch.randint(0, 256, shape, generator=g, device=device, dtype=torch.uint8)

    def sz() -> tuple[torch.Tensor, torch.Tensor]:
        sc = torch.rand(b, H, n, 1, generator=g, device=device) * 0.03 + 0.002
        ze = torch.rand(b, H, n, 1, generator=g, device=device) * 255
        return sc.half(), ze.half()

    k_q = u8(b, H, n, D)
    k_s, k_z = sz()
    v_s, v_z = sz()
    # Timing only needs probability-like values; a real softmax (check() below) would need
    # an fp32 copy of the whole [B, H, Q, L] tensor.
    probs = torch.rand(b, H, q, n, generator=g, device=device, dtype=torch.float16).mul_(2.0 / n)
    empty = torch.empty(0, device=device, dtype=torch.float16)
    return Inputs(
        query=rnd(b, H, q, D),
        probs=probs,
        k_q=k_q,
        k_t=k_q.transpose(-1, -2).contiguous(),
        v_q=u8(b, H, n, D),
        k_s=k_s,
        k_z=k_z,
        v_s=v_s,
        v_z=v_z,
        k16=rnd(b, H, n, D) if with_fp16 else empty,
        v16=rnd(b, H, n, D) if with_fp16 else empty,
        out_qk=torch.empty(b, H, q, n, device=device, dtype=torch.float16),
        out_pv=torch.empty(b, H, q, D, device=device, dtype=torch.float16),
    )


# Error allowed per unit of sum |term|: fp32-level paths (CUDA-core and tensor-core
# kernels), and the GEMM path, which rounds each dequantized value to fp16 once and
# multiplies with cuBLAS (the fallback rounds each value twice: the bound of two roundings).
EXACT = 2e-5
ROUNDED = 2.0**-10


def error_ratio(
    out: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor, mag_rel: float = EXACT
) -> float:
    """Worst |out - ref| / tolerance; the tolerance is one fp16 rounding of the result plus
    `mag_rel` of the sum of |terms|. inf if anything is NaN."""
    if torch.isnan(out).any():
        return math.inf
    tol = ref.abs() * 2.0**-10 + mag * mag_rel + 1e-6
    return ((out.double() - ref).abs() / tol).max().item()


def cuda_path(tuning: dict[str, int], op: str, q: int) -> str:
    """The kernel the extension's CUDA dispatch picks for a query block of q rows."""
    if q >= tuning[f"gemm_min_q_{op}"]:
        return "gemm"
    return "tensor-cores" if q >= tuning[f"tensor_core_min_q_{op}"] else "cuda-cores"


def tolerance_for(path: str) -> float:
    return ROUNDED if path == "gemm" else EXACT


def check(ext: ModuleType, s: Shape, device: str) -> tuple[float, float]:
    """Worst error / tolerance over both ops on fresh inputs, for the extension (must be
    <= 1) and, for comparison, for the fallback the model uses without it."""
    x = make_inputs(s, device, seed=1234 + s.seq + s.q, with_fp16=False)
    x.probs.copy_(torch.softmax(x.probs.float() * 50, dim=-1))
    x.out_qk.fill_(float("nan"))
    x.out_pv.fill_(float("nan"))
    getattr(ext, QK)(x.query, x.k_t, x.out_qk, x.k_s, x.k_z)
    getattr(ext, PV)(x.probs, x.v_q, x.out_pv, x.v_s, x.v_z)
    fb_qk = torch.matmul(x.query, (x.k_s * (x.k_q - x.k_z)).transpose(-1, -2))
    fb_pv = torch.matmul(x.probs, x.v_s * (x.v_q - x.v_z))
    tuning = ext.cuda_tuning() if device == "cuda" else None
    worst, worst_fb = 0.0, 0.0
    for op, out, fb, vec, dq in (
        (
            "qk",
            x.out_qk,
            fb_qk,
            x.query,
            ((x.k_t.double() - x.k_z.double().mT) * x.k_s.double().mT),
        ),
        ("pv", x.out_pv, fb_pv, x.probs, ((x.v_q.double() - x.v_z.double()) * x.v_s.double())),
    ):
        ref = vec.double() @ dq
        mag = vec.double().abs() @ dq.abs()
        rel = tolerance_for(cuda_path(tuning, op, s.q)) if tuning else EXACT
        worst = max(worst, error_ratio(out, ref, mag, rel))
        worst_fb = max(worst_fb, error_ratio(fb, ref, mag, rel))
    return worst, worst_fb


# ---- timing -----------------------------------------------------------------------------


def time_gpu(fns: list[Callable[[], object]], reps: int, budget_s: float = 1.0) -> float:
    """Median seconds of one call; call i uses input copy i % len(fns)."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fns[0]()
    torch.cuda.synchronize()
    one = time.perf_counter() - t0
    n = max(10, min(reps, int(budget_s / max(one, 1e-6))))
    pairs = []
    for i in range(n):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fns[i % len(fns)]()
        b.record()
        pairs.append((a, b))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in pairs) / 1e3


# CPU clock: wall time by default; `--cpu-timer thread` runs torch on one thread and reads
# that thread's CPU time, which stays meaningful on a machine shared with other jobs.
CPU_CLOCK: Callable[[], float] = time.perf_counter


def time_cpu(fns: list[Callable[[], object]], reps: int, budget_s: float) -> float:
    t0 = CPU_CLOCK()
    fns[0]()  # warm-up, and an estimate of one call
    one = CPU_CLOCK() - t0
    n = max(3, min(reps, int(budget_s / max(one, 1e-6))))
    times = []
    for i in range(n):
        t0 = CPU_CLOCK()
        fns[i % len(fns)]()
        times.append(CPU_CLOCK() - t0)
    return statistics.median(times)


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a large copy, counting bytes read and written."""
    n = 1 << 30 if device == "cuda" else 1 << 28
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    if device == "cuda":
        t = time_gpu([lambda: dst.copy_(src)], 20)
    else:
        t = time_cpu([lambda: dst.copy_(src)], 10, 2.0)
    return 2 * n / t


# ---- the run ----------------------------------------------------------------------------


def fmt_time(t: float) -> str:
    return f"{t * 1e6:.1f} µs" if t < 1e-3 else f"{t * 1e3:.2f} ms"


def methods(ext: ModuleType, x: Inputs, op: str) -> dict[str, Callable[[], object]]:
    qk, pv = getattr(ext, QK), getattr(ext, PV)
    if op == "qk":
        return {
            "ext": lambda: qk(x.query, x.k_t, x.out_qk, x.k_s, x.k_z),
            "ext+T": lambda: qk(
                x.query, x.k_q.transpose(-1, -2).contiguous(), x.out_qk, x.k_s, x.k_z
            ),
            "deq+mm": lambda: torch.matmul(
                x.query, (x.k_s * (x.k_q - x.k_z)).transpose(-1, -2), out=x.out_qk
            ),
            "fp16 mm": lambda: torch.matmul(x.query, x.k16.transpose(-1, -2), out=x.out_qk),
        }
    return {
        "ext": lambda: pv(x.probs, x.v_q, x.out_pv, x.v_s, x.v_z),
        "deq+mm": lambda: torch.matmul(x.probs, x.v_s * (x.v_q - x.v_z), out=x.out_pv),
        "fp16 mm": lambda: torch.matmul(x.probs, x.v16, out=x.out_pv),
    }


def resolve_device(requested: str) -> str:
    device = requested
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no GPU")
    return device


def n_copies(s: Shape, device: str, l2: int) -> int:
    """Input sets to rotate through so that L2 does not flatter, within device memory."""
    if device == "cpu":
        return 1
    one = s.quant_bytes("qk") + s.fp16_bytes("qk") * 2
    want = max(2, min(8, math.ceil(3 * l2 / one)))
    free, _ = torch.cuda.mem_get_info()
    fit = int(0.45 * free) // max(1, input_bytes(s))
    return max(1, min(want, fit))


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    shapes = shape_set(args.quick)
    ext = build(device, args.build_dir)
    if device == "cpu" and args.cpu_timer == "thread":
        global CPU_CLOCK
        CPU_CLOCK = time.thread_time
        torch.set_num_threads(1)
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        name = f"{props.name}, {props.multi_processor_count} SMs"
        l2 = int(getattr(props, "L2_cache_size", 50 << 20))
    else:
        clock = "thread CPU time" if args.cpu_timer == "thread" else "wall time"
        name = f"CPU, {torch.get_num_threads()} torch threads, {clock}"
        l2 = 64 << 20
    bw = copy_bandwidth(device)
    print(f"# device: {name}; torch {torch.__version__}; copy bandwidth {bw / 1e9:.0f} GB/s")
    if device == "cuda":
        print(f"# CUDA dispatch settings: {ext.cuda_tuning()}")
    print("| op | phase | B | Q | L | method | time | GB/s | % copy bw | speed-up vs deq+mm |")
    print("|---|---|---:|---:|---:|---|---:|---:|---:|---:|")
    failed = False
    rows: list[dict[str, object]] = []
    checks: list[dict[str, object]] = []
    for s in shapes:
        small = Shape(s.phase, 1, s.q, s.seq + 3)  # fresh inputs, misaligned L too
        for c in (small, Shape(s.phase, 1, s.q, s.seq)):
            worst, worst_fb = check(ext, c, device)
            checks.append({"b": c.b, "q": c.q, "seq": c.seq, "ext": worst, "fallback": worst_fb})
            if not worst <= 1.0:
                print(f"# CHECK FAILED B={c.b} Q={c.q} L={c.seq}: error/tolerance {worst:.3g}")
                failed = True
        xs = [make_inputs(s, device, seed=i) for i in range(n_copies(s, device, l2))]
        for op in ("qk", "pv"):
            per: dict[str, float] = {}
            for meth in methods(ext, xs[0], op):
                fns = [methods(ext, x, op)[meth] for x in xs]
                if device == "cuda":
                    per[meth] = time_gpu(fns, args.reps)
                else:
                    per[meth] = time_cpu(fns, args.reps, args.cpu_budget)
            for meth, t in per.items():
                nbytes = s.fp16_bytes(op) if meth == "fp16 mm" else s.quant_bytes(op)
                gbs = nbytes / t / 1e9
                rows.append(
                    {
                        "op": op,
                        "phase": s.phase,
                        "b": s.b,
                        "q": s.q,
                        "seq": s.seq,
                        "method": meth,
                        "seconds": t,
                        "gb_per_s": gbs,
                        "copy_bw_fraction": gbs * 1e9 / bw,
                        "speedup_vs_fallback": per["deq+mm"] / t,
                    }
                )
                print(
                    f"| {op} | {s.phase} | {s.b} | {s.q} | {s.seq} | {meth} | {fmt_time(t)} "
                    f"| {gbs:.1f} | {100 * gbs * 1e9 / bw:.0f}% | {per['deq+mm'] / t:.2f}× |",
                    flush=True,
                )
        del xs
        if device == "cuda":
            torch.cuda.empty_cache()
    worst_ext = max(float(c["ext"]) for c in checks)  # type: ignore[arg-type]
    worst_fb = max(float(c["fallback"]) for c in checks)  # type: ignore[arg-type]
    print(
        f"# accuracy (worst error / tolerance, float64 reference): extension {worst_ext:.3g}, "
        f"fallback (dequantize + matmul) {worst_fb:.3g}"
    )
    verdicts = targets(rows) if device == "cuda" else []
    for v in verdicts:
        print(f"# target {v['name']}: {'met' if v['met'] else 'NOT MET'} ({v['detail']})")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "device": name,
                    "torch": torch.__version__,
                    "copy_bandwidth": bw,
                    "rows": rows,
                    "checks": checks,
                    "targets": verdicts,
                    "tuning": ext.cuda_tuning() if device == "cuda" else None,
                },
                indent=1,
            )
        )
    if failed:
        print("# correctness check FAILED (see above)")
        return 1
    print("# correctness: every shape matched the float64 reference within tolerance")
    return 0


def targets(rows: list[dict[str, object]]) -> list[dict[str, object]]:
    """The performance targets, judged from the measured rows (CUDA only)."""
    out: list[dict[str, object]] = []
    for op in ("qk", "pv"):
        ext = [r for r in rows if r["op"] == op and r["method"] == "ext"]
        dec = [r for r in ext if r["phase"] == "decode" and r["b"] == 32 and r["seq"] >= 2048]  # type: ignore[operator]
        if dec:
            sp = min(float(r["speedup_vs_fallback"]) for r in dec)  # type: ignore[arg-type]
            bwf = min(float(r["copy_bw_fraction"]) for r in dec)  # type: ignore[arg-type]
            out.append(
                {
                    "name": f"{op} decode B=32 L>=2048 speed-up >= 4x",
                    "met": sp >= 4.0,
                    "detail": f"worst {sp:.2f}x",
                    "value": sp,
                }
            )
            out.append(
                {
                    "name": f"{op} decode B=32 L>=2048 >= 60% of copy bandwidth",
                    "met": bwf >= 0.6,
                    "detail": f"worst {100 * bwf:.0f}%",
                    "value": bwf,
                }
            )
        pre = [r for r in ext if r["phase"] == "prefill"]
        if pre:
            worst = min(pre, key=lambda r: float(r["speedup_vs_fallback"]))  # type: ignore[arg-type]
            sp = float(worst["speedup_vs_fallback"])  # type: ignore[arg-type]
            out.append(
                {
                    "name": f"{op} prefill >= 1.0x the fallback on every shape",
                    "met": sp >= 1.0,
                    "value": sp,
                    "detail": f"worst {sp:.2f}x at B={worst['b']} Q={worst['q']} L={worst['seq']}",
                }
            )
    return out


SWEEP_Q = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
SWEEP_BL = ((1, 1024), (1, 4096), (32, 1024), (32, 4096))
NEVER = 1 << 40
TUNING_KEYS = (
    "tensor_core_min_q_qk",
    "tensor_core_min_q_pv",
    "pv_split_fp16",
    "gemm_min_q_qk",
    "gemm_min_q_pv",
)
# cuda_tuning settings (tensor-core min Q for QK, PV, PV hi/lo, GEMM min Q for QK, PV)
FORCE = {
    "cuda-cores": (NEVER, NEVER, -1, NEVER, NEVER),
    "tensor-cores": (1, 1, -1, NEVER, NEVER),
    "gemm": (NEVER, NEVER, -1, 1, 1),
}


def crossover(pairs: dict[int, list[tuple[float, float]]]) -> Optional[int]:
    """Smallest Q from which the new kernel is faster than the old one in geometric mean
    over the measured (B, L), at that Q and every longer one. pairs: Q -> [(old, new)]."""
    qs = sorted(pairs)

    def wins(q: int) -> bool:
        logs = [math.log(new / old) for old, new in pairs[q]]
        return sum(logs) <= 0

    return next((q for q in qs if all(wins(r) for r in qs if r >= q)), None)


def sweep(args: argparse.Namespace) -> int:
    """Times the CUDA-core, tensor-core and GEMM paths of each op over query lengths and
    prints where each takes over from the previous one."""
    if resolve_device(args.device) != "cuda":
        sys.exit("--sweep needs a GPU: it compares the CUDA kernels")
    ext = build("cuda", args.build_dir)
    saved = ext.cuda_tuning()
    l2 = int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20))
    print(f"# device: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    print("| op | B | L | Q | CUDA cores | tensor cores | GEMM | deq+mm | best vs deq+mm |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows: list[dict[str, object]] = []
    pairs: dict[str, dict[str, dict[int, list[tuple[float, float]]]]] = {
        op: {"tc": {}, "gemm": {}} for op in ("qk", "pv")
    }
    try:
        for b, seq in SWEEP_BL:
            for q in SWEEP_Q:
                s = Shape("sweep", b, q, seq)
                xs = [
                    make_inputs(s, "cuda", seed=i, with_fp16=False)
                    for i in range(n_copies(s, "cuda", l2))
                ]
                for op in ("qk", "pv"):
                    t: dict[str, float] = {}
                    for label, setting in FORCE.items():
                        ext.cuda_tuning(*setting)
                        fns = [methods(ext, x, op)["ext"] for x in xs]
                        t[label] = time_gpu(fns, args.reps, budget_s=0.15)
                    fns = [methods(ext, x, op)["deq+mm"] for x in xs]
                    t["fallback"] = time_gpu(fns, args.reps, budget_s=0.15)
                    pairs[op]["tc"].setdefault(q, []).append((t["cuda-cores"], t["tensor-cores"]))
                    pairs[op]["gemm"].setdefault(q, []).append((t["tensor-cores"], t["gemm"]))
                    rows.append({"op": op, "b": b, "seq": seq, "q": q, **t})
                    best = min(t["cuda-cores"], t["tensor-cores"], t["gemm"])
                    print(
                        f"| {op} | {b} | {seq} | {q} | {fmt_time(t['cuda-cores'])} "
                        f"| {fmt_time(t['tensor-cores'])} | {fmt_time(t['gemm'])} "
                        f"| {fmt_time(t['fallback'])} | {t['fallback'] / best:.2f}× |",
                        flush=True,
                    )
                del xs
                torch.cuda.empty_cache()
    finally:
        ext.cuda_tuning(*(saved[k] for k in TUNING_KEYS))
    result: dict[str, object] = {"rows": rows, "settings": saved}
    for op in ("qk", "pv"):
        for kind, label in (
            ("tc", "tensor cores over CUDA cores"),
            ("gemm", "GEMM over tensor cores"),
        ):
            q0 = crossover(pairs[op][kind])
            result[f"{kind}_min_q_{op}"] = q0
            print(f"# {op}: {label} from Q = {q0} on (measured Q: {list(SWEEP_Q)})")
    print(f"# settings during the default run: {saved}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


def floors(args: argparse.Namespace) -> int:
    bw = args.bw_tbs * 1e12
    fl = args.fp32_tflops * 1e12
    print(
        f"bandwidth floor at {args.bw_tbs} TB/s; fp32 (non-tensor-core) floor at "
        f"{args.fp32_tflops} TFLOP/s; H={H}, D={D}"
    )
    print("| phase | B | Q | L | QK bytes | QK floor | PV bytes | PV floor | fp32 floor |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for s in shape_set(args.quick):
        qb, pb = s.quant_bytes("qk"), s.quant_bytes("pv")
        print(
            f"| {s.phase} | {s.b} | {s.q} | {s.seq} | {qb:,} | {fmt_time(qb / bw)} "
            f"| {pb:,} | {fmt_time(pb / bw)} | {fmt_time(s.flops() / fl)} |"
        )
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--quick", action="store_true", help="a few shapes instead of the full set")
    p.add_argument("--reps", type=int, default=100, help="timed calls per measurement (max)")
    p.add_argument(
        "--cpu-budget", type=float, default=3.0, help="seconds per CPU measurement (about)"
    )
    p.add_argument(
        "--cpu-timer",
        choices=("wall", "thread"),
        default="wall",
        help="CPU: wall time (all threads), or one thread's CPU time (for a busy machine)",
    )
    p.add_argument("--build-dir", default=None, help="where to build the extension")
    p.add_argument("--floors", action="store_true", help="print byte counts and floors only")
    p.add_argument("--sweep", action="store_true", help="CUDA: crossover of the two kernels")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--bw-tbs", type=float, default=3.35, help="bandwidth for --floors, TB/s")
    p.add_argument(
        "--fp32-tflops", type=float, default=67.0, help="fp32 FMA rate for --floors, TFLOP/s"
    )
    args = p.parse_args(argv)
    if args.floors:
        return floors(args)
    return sweep(args) if args.sweep else run(args)


if __name__ == "__main__":
    raise SystemExit(main())
