"""Our CUDA kernels against a float64 reference, on every shape class the model produces.

Each case runs both ops (QK: vecquant8matmul_batched_faster_old, PV:
vecquant8matmul_batched_column_compression_faster_old) on fresh random fp16/uint8 inputs
with the output pre-filled with NaN, through every CUDA path (CUDA-core kernel,
tensor-core kernel, dequantize + cuBLAS, each forced by the extension's `cuda_tuning`;
and the default dispatch), and compares with `vec @ (scale * (code - zero))` in float64.
Tolerance: one fp16 rounding of the result plus 2e-5 of the sum of |terms| (fp32-level
accumulation) for the two kernels; for the GEMM path, which rounds each dequantized value
to fp16, 2^-10 of the sum of |terms| (two such roundings: what the model's own fallback
does). The fallback (dequantize to fp16, then torch.matmul) is measured against the
default path's tolerance for comparison.

Outputs are checked whole for NaN (an element no block wrote); the float64 comparison
covers every (b, h) when there are at most 16, else 8 of them, the first and last always
among them (the tails of the tensor).

Two more groups check the additions our extension names in `features()`:

- capacity views: both ops on mat/scales/zeros that are the first L tokens of buffers with
  room for C tokens (`kbuf[..., :L]`, `vbuf[:, :, :L]`, `sbuf[:, :, :L]`), through every
  path, must equal bit for bit the same call on `.contiguous()` copies;
- quantize_append: codes, scales and zeros written into such buffers must equal exactly the
  model's quantization run by torch on the same device and dtype (bf16 and fp16; fp32 too
  on the CPU), S = 1 and 37, per chunk and per token, both layouts, x a slice of a fused
  projection, pos > 0; the rest of the buffers untouched.

    python bench/gpu/correctness.py [--json FILE] [--small] [--build-dir DIR]

`--small` runs a few small cases (for compute-sanitizer). Exit status 1 when a case fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Optional

import torch


def _bench_kernels() -> ModuleType:
    """bench/kernels.py, the shared builder, by its path: `import kernels` may find the
    repository's kernels/ folder (a namespace package), which transformers 5 imports when
    it looks for huggingface's `kernels` package from the repository's root."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "kernels.py"
    spec = importlib.util.spec_from_file_location("qwen_kvprep_bench_kernels", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bench_kernels = _bench_kernels()

QK = bench_kernels.QK
PV = bench_kernels.PV
D = 128


@dataclass(frozen=True)
class Case:
    name: str
    b: int
    h: int
    q: int
    seq: int
    offset: int = 0  # byte offset of the caches inside a bigger buffer (odd addresses)


CASES = [
    Case("decode, one cached token", 1, 16, 1, 1),
    Case("decode", 4, 32, 1, 511),
    Case("decode, odd L", 8, 40, 1, 2049),
    Case("decode, B*H = 64*40", 64, 40, 1, 4097),
    Case("decode, 32k tokens", 2, 64, 1, 32771),
    Case("decode, B*H = 64*40 at 32k", 64, 40, 1, 32768),
    Case("decode, odd base address", 2, 32, 1, 1000, offset=1),
    Case("short query block", 4, 32, 5, 1000),
    Case("query block 15", 2, 40, 15, 777),
    Case("query block 16", 2, 40, 16, 777),
    Case("query tile tail", 1, 64, 65, 2051),
    Case("prefill 128", 8, 32, 128, 128),
    Case("prefill 512, odd L", 2, 40, 512, 1031),
    Case("prefill 2048", 1, 32, 2048, 2048),
    Case("chunked prefill with a past", 1, 16, 2048, 4096),
    Case("prefill at 32k tokens", 1, 64, 1000, 32771),
    Case("prefill, odd base address", 1, 32, 256, 1000, offset=1),
]

SMALL = [
    Case("small decode", 2, 3, 1, 37),
    Case("small decode, odd base", 1, 2, 1, 1001, offset=1),
    Case("small block", 2, 2, 5, 263),
    Case("small prefill", 2, 2, 130, 263),
    Case("small prefill, odd base", 1, 2, 70, 99, offset=1),
]


def _cache(shape: tuple[int, ...], offset: int, g: torch.Generator, device: str) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    buf = torch.empty(n + offset, dtype=torch.uint8, device=device)
    view = buf[offset:].view(shape)
    view.copy_(torch.randint(0, 256, shape, generator=g, device=device, dtype=torch.uint8))
    return view


def _sample(bh: int, seed: int) -> list[int]:
    if bh <= 16:
        return list(range(bh))
    g = torch.Generator().manual_seed(seed)
    picks = torch.randperm(bh - 2, generator=g)[:6].add(1).tolist()
    return sorted({0, bh - 1, *picks})


def _ratio(out: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor, rel: float) -> float:
    return bench_kernels.error_ratio(out, ref, mag, rel)


# CPU torch 2.1 has neither an fp16 matmul nor an fp16 softmax; on the CPU both are
# computed in fp32 and rounded to fp16, which is what a GPU's fp16 GEMM does too (fp32
# accumulation, an fp16 result).
def _fp16_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.matmul of two fp16 tensors: the model's own fallback."""
    if a.is_cuda:
        return a @ b
    return (a.float() @ b.float()).half()


def _fp16_softmax(x: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        return torch.softmax(x, dim=-1)
    return torch.softmax(x.float(), dim=-1).half()


def paths_for(device: str) -> list[tuple[str, Optional[tuple[int, ...]]]]:
    """(label, cuda_tuning settings to force it) for every path that may serve a case."""
    if device != "cuda":
        return [("cpu", None)]
    return [("default", None), *bench_kernels.FORCE.items()]


def check_case(ext: ModuleType, case: Case, device: str, seed: int = 0) -> dict[str, object]:
    """Runs one case through every path; returns the worst error/tolerance per op and path."""
    g = torch.Generator(device=device).manual_seed(seed + case.seq * 31 + case.q)
    b, h, q, n = case.b, case.h, case.q, case.seq
    query = torch.randn(b, h, q, D, generator=g, device=device).half()
    probs = _fp16_softmax(
        torch.randn(b, h, q, n, generator=g, device=device, dtype=torch.float16) * 4
    )
    k_t = _cache((b, h, D, n), case.offset, g, device)
    v_q = _cache((b, h, n, D), case.offset, g, device)

    def sz() -> tuple[torch.Tensor, torch.Tensor]:
        sc = (torch.rand(b, h, n, 1, generator=g, device=device) * 0.03 + 0.002).half()
        ze = (torch.rand(b, h, n, 1, generator=g, device=device) * 255).half()
        return sc, ze

    k_s, k_z = sz()
    v_s, v_z = sz()
    picks = _sample(b * h, seed + n)
    result: dict[str, object] = {**asdict(case), "sampled_heads": len(picks), "paths": {}}
    refs = {}
    for op in ("qk", "pv"):
        vec = (query if op == "qk" else probs).view(b * h, q, -1)
        refs[op] = []
        for i in picks:
            bi, hi = divmod(i, h)
            if op == "qk":
                dq = (k_t[bi, hi].double() - k_z[bi, hi].double().T) * k_s[bi, hi].double().T
            else:
                dq = (v_q[bi, hi].double() - v_z[bi, hi].double()) * v_s[bi, hi].double()
            v64 = vec[i].double()
            refs[op].append((v64 @ dq, v64.abs() @ dq.abs()))
    saved = ext.cuda_tuning() if device == "cuda" else None

    def rel(label: str, op: str) -> float:
        if saved is None:
            return bench_kernels.EXACT
        path = bench_kernels.cuda_path(saved, op, q) if label == "default" else label
        return bench_kernels.tolerance_for(path)

    worst_fb = {"qk": 0.0, "pv": 0.0}
    for j, i in enumerate(picks):
        bi, hi = divmod(i, h)
        fb_qk = _fp16_matmul(query[bi, hi], (k_s[bi, hi] * (k_t[bi, hi].T - k_z[bi, hi])).T)
        fb_pv = _fp16_matmul(probs[bi, hi], v_s[bi, hi] * (v_q[bi, hi] - v_z[bi, hi]))
        worst_fb["qk"] = max(worst_fb["qk"], _ratio(fb_qk, *refs["qk"][j], rel("default", "qk")))
        worst_fb["pv"] = max(worst_fb["pv"], _ratio(fb_pv, *refs["pv"][j], rel("default", "pv")))
    result["fallback"] = worst_fb
    ok = True
    try:
        for label, setting in paths_for(device):
            if setting is not None:
                ext.cuda_tuning(*setting)
            per: dict[str, float] = {}
            for op in ("qk", "pv"):
                out = torch.full(
                    (b, h, q, n if op == "qk" else D),
                    float("nan"),
                    dtype=torch.float16,
                    device=device,
                )
                if op == "qk":
                    getattr(ext, QK)(query, k_t, out, k_s, k_z)
                else:
                    getattr(ext, PV)(probs, v_q, out, v_s, v_z)
                if torch.isnan(out).any().item():
                    per[op] = float("inf")
                else:
                    flat = out.view(b * h, q, -1)
                    per[op] = max(
                        _ratio(flat[i], *refs[op][j], rel(label, op)) for j, i in enumerate(picks)
                    )
                ok = ok and per[op] <= 1.0
                del out
            result["paths"][label] = per  # type: ignore[index]
    finally:
        if saved is not None:
            ext.cuda_tuning(*(saved[k] for k in bench_kernels.TUNING_KEYS))
    result["ok"] = ok
    return result


# ---- capacity views and quantize_append (features() of our extension) ------------------


@dataclass(frozen=True)
class ViewCase:
    name: str
    b: int
    h: int
    q: int
    seq: int
    cap: int


VIEW_CASES = [
    ViewCase("decode, L = C", 2, 8, 1, 256, 256),
    ViewCase("decode, C % 16 == 0", 4, 32, 1, 1000, 1024),
    ViewCase("decode, C not a multiple of 16", 2, 8, 1, 777, 1001),
    ViewCase("decode, one cached token", 2, 8, 1, 1, 64),
    ViewCase("short block, odd L", 2, 8, 5, 333, 512),
    ViewCase("prefill, odd L", 1, 8, 130, 263, 300),
]

SMALL_VIEW_CASES = [
    ViewCase("small decode view", 2, 3, 1, 37, 64),
    ViewCase("small decode view, odd C", 1, 2, 1, 9, 21),
    ViewCase("small prefill view", 1, 2, 40, 99, 128),
]


def view_paths(device: str) -> list[tuple[str, Optional[tuple[int, ...]]]]:
    paths = paths_for(device)
    if device == "cuda":  # the tensor-core P·V that rounds the cache to fp16 once
        paths.append(
            ("tensor-cores, single rounding", (1, 1, 0, bench_kernels.NEVER, bench_kernels.NEVER))
        )
    return paths


def _capacity_view(full: torch.Tensor, seq: int, axis: int) -> torch.Tensor:
    """The first `seq` tokens (along `axis`) of a contiguous buffer; the rest is garbage."""
    return full.narrow(axis, 0, seq)


def check_view_case(ext: ModuleType, case: ViewCase, device: str) -> dict[str, object]:
    """Both ops on capacity views against the same ops on contiguous copies, every path."""
    g = torch.Generator(device=device).manual_seed(case.seq * 13 + case.cap)
    b, h, q, n, c = case.b, case.h, case.q, case.seq, case.cap
    kbuf = torch.randint(0, 256, (b, h, D, c), generator=g, device=device, dtype=torch.uint8)
    vbuf = torch.randint(0, 256, (b, h, c, D), generator=g, device=device, dtype=torch.uint8)

    def sz() -> tuple[torch.Tensor, torch.Tensor]:
        sc = (torch.rand(b, h, c, 1, generator=g, device=device) * 0.03 + 0.002).half()
        ze = (torch.rand(b, h, c, 1, generator=g, device=device) * 255).half()
        sc[:, :, n:] = float("nan")  # garbage past L: a read there shows
        ze[:, :, n:] = float("nan")
        return sc, ze

    k_s, k_z = sz()
    v_s, v_z = sz()
    k_t = _capacity_view(kbuf, n, 3)
    v_q = _capacity_view(vbuf, n, 2)
    k_s, k_z, v_s, v_z = (_capacity_view(t, n, 2) for t in (k_s, k_z, v_s, v_z))
    query = torch.randn(b, h, q, D, generator=g, device=device).half()
    probs = _fp16_softmax(
        torch.randn(b, h, q, n, generator=g, device=device, dtype=torch.float16) * 4
    )
    saved = ext.cuda_tuning() if device == "cuda" else None
    result: dict[str, object] = {**asdict(case), "paths": {}}
    ok = True
    try:
        for label, setting in view_paths(device):
            if setting is not None:
                ext.cuda_tuning(*setting)
            per: dict[str, bool] = {}
            for op in ("qk", "pv"):
                shape = (b, h, q, n if op == "qk" else D)
                got = torch.full(shape, float("nan"), dtype=torch.float16, device=device)
                want = got.clone()
                if op == "qk":
                    getattr(ext, QK)(query, k_t, got, k_s, k_z)
                    getattr(ext, QK)(
                        query, k_t.contiguous(), want, k_s.contiguous(), k_z.contiguous()
                    )
                else:
                    getattr(ext, PV)(probs, v_q, got, v_s, v_z)
                    getattr(ext, PV)(
                        probs, v_q.contiguous(), want, v_s.contiguous(), v_z.contiguous()
                    )
                same = bool(torch.equal(got, want)) and not bool(torch.isnan(got).any().item())
                per[op] = same
                ok = ok and same
            result["paths"][label] = per  # type: ignore[index]
    finally:
        if saved is not None:
            ext.cuda_tuning(*(saved[k] for k in bench_kernels.TUNING_KEYS))
    result["ok"] = ok
    return result


def quantize_reference(
    x: torch.Tensor, per_token: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The model's quantization, run by torch in x's dtype on x's device: codes [B,H,S,D],
    fp16 scale and zero [B,H,S,1]."""
    f = x.permute(0, 2, 1, 3)
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


def quantize_cases(device: str, small: bool) -> list[dict[str, object]]:
    dtypes = [torch.bfloat16, torch.float16] + ([torch.float32] if device == "cpu" else [])
    b, h, d = (2, 4, 128) if small else (4, 32, 128)
    out = []
    for dtype in dtypes:
        for s in (1, 37):
            for per_token in (False, True):
                for key in (False, True):
                    out.append(
                        {
                            "dtype": str(dtype).replace("torch.", ""),
                            "b": b,
                            "h": h,
                            "d": d,
                            "s": s,
                            "per_token": per_token,
                            "key_layout": key,
                        }
                    )
    return out


def check_quantize_case(ext: ModuleType, case: dict[str, object], device: str) -> dict[str, object]:
    dtype = getattr(torch, str(case["dtype"]))
    b, h, d, s = (int(case[k]) for k in ("b", "h", "d", "s"))  # type: ignore[call-overload]
    per_token, key = bool(case["per_token"]), bool(case["key_layout"])
    pos, cap = 5, 5 + s + 11
    g = torch.Generator(device=device).manual_seed(s * 7 + d + int(per_token) + 2 * int(key))
    # x as the model has it: the key (or value) third of a fused projection, [B, S, H, D].
    qkv = torch.randn(b, s, 3 * h * d, generator=g, device=device) * 3 + 0.5
    qkv *= torch.rand(1, 1, 3 * h * d, generator=g, device=device) + 0.1
    x = qkv.to(dtype)[:, :, h * d : 2 * h * d].view(b, s, h, d)
    shape = (b, h, d, cap) if key else (b, h, cap, d)
    codes = torch.randint(0, 256, shape, generator=g, device=device, dtype=torch.uint8)
    scales = torch.randn(b, h, cap, 1, generator=g, device=device).half()
    zeros = torch.randn(b, h, cap, 1, generator=g, device=device).half()
    before = (codes.clone(), scales.clone(), zeros.clone())
    ext.quantize_append(x, codes, scales, zeros, pos, key, per_token)
    q, sc, ze = quantize_reference(x, per_token)
    got = codes[..., pos : pos + s].transpose(-1, -2) if key else codes[:, :, pos : pos + s]
    differ = int((got != q).sum().item())
    same_sz = bool(torch.equal(scales[:, :, pos : pos + s], sc)) and bool(
        torch.equal(zeros[:, :, pos : pos + s], ze)
    )
    untouched = True
    for new, old in zip((codes, scales, zeros), before):
        axis = 3 if (key and new is codes) else 2
        for lo, hi in ((0, pos), (pos + s, cap)):
            untouched = untouched and bool(
                torch.equal(new.narrow(axis, lo, hi - lo), old.narrow(axis, lo, hi - lo))
            )
    return {
        **case,
        "pos": pos,
        "cap": cap,
        "codes_differing": differ,
        "scales_zeros_equal": same_sz,
        "rest_untouched": untouched,
        "ok": differ == 0 and same_sz and untouched,
    }


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--small", action="store_true", help="a few small cases (compute-sanitizer)")
    p.add_argument("--build-dir", default=None)
    p.add_argument("--json", default=None, help="write the results to this file")
    args = p.parse_args(argv)
    device = bench_kernels.resolve_device(args.device)
    ext = bench_kernels.build(device, args.build_dir)
    cases = SMALL if args.small or device == "cpu" else CASES
    results = []
    print("| case | B | H | Q | L | path | QK err/tol | PV err/tol | fallback QK | fallback PV |")
    print("|---|---:|---:|---:|---:|---|---:|---:|---:|---:|")
    for case in cases:
        t0 = time.perf_counter()
        r = check_case(ext, case, device)
        r["seconds"] = time.perf_counter() - t0
        results.append(r)
        fb = r["fallback"]
        for label, per in r["paths"].items():  # type: ignore[attr-defined]
            print(
                f"| {case.name} | {case.b} | {case.h} | {case.q} | {case.seq} | {label} "
                f"| {per['qk']:.3g} | {per['pv']:.3g} | {fb['qk']:.3g} | {fb['pv']:.3g} |",  # type: ignore[index]
                flush=True,
            )
        if device == "cuda":
            torch.cuda.empty_cache()
    failed = [str(r["name"]) for r in results if not r["ok"]]
    features = set(ext.features()) if hasattr(ext, "features") else set()
    views: list[dict[str, object]] = []
    quant: list[dict[str, object]] = []
    if "capacity-views" in features:
        print()
        print(
            "| view case | B | H | Q | L | C | path "
            "| QK view == contiguous | PV view == contiguous |"
        )
        print("|---|---:|---:|---:|---:|---:|---|---|---|")
        small = args.small or device == "cpu"
        for vc in SMALL_VIEW_CASES if small else VIEW_CASES:
            r = check_view_case(ext, vc, device)
            views.append(r)
            for label, per in r["paths"].items():  # type: ignore[attr-defined]
                print(
                    f"| {vc.name} | {vc.b} | {vc.h} | {vc.q} | {vc.seq} | {vc.cap} | {label} "
                    f"| {per['qk']} | {per['pv']} |",
                    flush=True,
                )
            if not r["ok"]:
                failed.append(f"view: {vc.name}")
    else:
        print("# this extension has no capacity views (features() lacks 'capacity-views')")
    if "quantize-append" in features:
        print()
        print(
            "| quantize_append | B | H | D | S | per token | key layout | codes differing "
            "| scales/zeros equal | rest untouched |"
        )
        print("|---|---:|---:|---:|---:|---|---|---:|---|---|")
        for qc in quantize_cases(device, args.small or device == "cpu"):
            r = check_quantize_case(ext, qc, device)
            quant.append(r)
            print(
                f"| {r['dtype']} | {r['b']} | {r['h']} | {r['d']} | {r['s']} | "
                f"{r['per_token']} | {r['key_layout']} | {r['codes_differing']} | "
                f"{r['scales_zeros_equal']} | {r['rest_untouched']} |",
                flush=True,
            )
            if not r["ok"]:
                failed.append(
                    f"quantize_append {r['dtype']} S={r['s']} "
                    f"per_token={r['per_token']} key_layout={r['key_layout']}"
                )
    else:
        print("# this extension has no quantize_append (features() lacks 'quantize-append')")
    if args.json:
        doc = {"device": device, "cases": results, "views": views, "quantize_append": quant}
        Path(args.json).write_text(json.dumps(doc, indent=1))
    if failed:
        print(f"# FAILED: {', '.join(failed)}")
        return 1
    print(
        f"# all {len(results)} cases within tolerance on every path; "
        f"{len(views)} capacity-view cases equal to contiguous copies; "
        f"{len(quant)} quantize_append cases exact"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
