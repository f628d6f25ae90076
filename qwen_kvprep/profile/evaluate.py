"""Judge a profile: findings out of the measured rows. Pure functions of the rows and the
children's outcomes, testable without a model.

- A run that crashed, hung or errored is a failing finding quoting the child's last
  output lines; a run that ran out of memory is not a failure, it is the measurement.
- Int8 runs that did not run the compiled kernel in every layer are a warning: their
  speed (and, on the real model code, their memory) is the pure-torch fallback's.
- The cache bytes of every finished run must equal batch x cached tokens x bytes per
  token exactly; a difference means the cache is not in the format plan assumes.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import Optional

from qwen_kvprep.findings import Finding, fail, info, ok, skip, warn
from qwen_kvprep.profile.predict import PerToken, expected_kv_bytes, unit_of
from qwen_kvprep.profile.protocol import MODES
from qwen_kvprep.profile.runner import (
    Measurements,
    ProfileRow,
    QualityRecord,
    failure_text,
)
from qwen_kvprep.profile.source import ModelSource
from qwen_kvprep.smoke.evaluate import known_cause


def _quote(lines: Sequence[str], n: int = 8) -> str:
    return "\n".join("        | " + line for line in list(lines)[-n:])


def human_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    return f"{value:.3g} TiB"


def run_failures(m: Measurements, source: ModelSource, timeout: float) -> list[Finding]:
    out: list[Finding] = []
    # (spec, outcome) of every child that gave no answer without running out of memory
    failed = [(rec.spec, rec.outcome) for rec in m.runs
              if rec.outcome is not None and rec.outcome.result is None
              and not rec.row.get("oom")]
    if m.quality is not None and m.quality.outcome.result is None:
        failed.append((m.quality.spec, m.quality.outcome))
    for spec, outcome in failed:
        what = "quality run" if spec.task == "quality" else (
            f"{spec.mode} run at batch {spec.batch}")
        message = f"the {what} failed: {failure_text(outcome, timeout)}"
        if outcome.log_tail:
            message += "\n      last lines of its output:\n" + _quote(outcome.log_tail)
        err = outcome.error
        error_text = str((err.get("message") if err else None) or "")
        fix = known_cause(error_text + "\n" + "\n".join(outcome.log_tail),
                          shlex.quote(str(source.directory)))
        if fix is None and outcome.timed_out:
            fix = "give it more time with --timeout S, or profile fewer batches with --batch"
        out.append(fail(
            "profile.run", message,
            fix=fix or f"run `qwen-kvprep smoke {shlex.quote(str(source.directory))}` to see "
            "whether the model loads and generates at all",
            paths=[source.directory],
            mode=spec.mode, batch=spec.batch, phase=outcome.phase,
            timed_out=outcome.timed_out, returncode=outcome.returncode,
            log_tail=outcome.log_tail,
            traceback=err.get("traceback") if err else None,
        ))
    return out


def oom_finding(rows: list[ProfileRow]) -> Optional[Finding]:
    parts = []
    for mode in MODES:
        hit = [r["batch"] for r in rows if r["mode"] == mode and r["oom"]]
        if hit:
            parts.append(f"{mode} from batch {min(hit)}")
    if not parts:
        return None
    return info("profile.oom", "out of memory (not an error: the limit measured): "
                + "; ".join(parts))


def kernel_finding(
    rows: list[ProfileRow], layers: Optional[int], source: ModelSource
) -> Finding:
    ran: list[int] = []  # the kernel layers of every Int8 run that finished
    for r in rows:
        used = r.get("kernel_layers")
        if r["mode"] == "int8" and used is not None and not r["oom"] and not r["error"]:
            ran.append(used)
    if not ran:
        return skip("profile.kernel", "no Int8 run finished, so kernel use is unknown")
    short = [used for used in ran if layers is None or used < layers]
    if not short:
        return ok("profile.kernel",
                  f"every Int8 run used the compiled kernel in all {layers} layers")
    worst = min(short)
    if source.random_weights:
        fix = ("build the extension for this torch: `qwen-kvprep build` (then run profile "
               "again)")
    else:
        fix = f"qwen-kvprep fix {shlex.quote(str(source.directory))}"
    return warn(
        "profile.kernel",
        f"Int8 runs used the compiled kernel in only {worst} of {layers} layers: the rest "
        "fell back to the model's pure-torch path, so the Int8 speed measured is the "
        "fallback's, not the kernel's",
        fix=fix,
        paths=[source.directory],
        kernel_layers=short,
    )


def kv_finding(rows: list[ProfileRow], per_token: PerToken) -> Finding:
    checked = [r for r in rows if r.get("kv_bytes") is not None]
    if not checked or per_token.get("int8") is None:
        return skip("profile.kv_bytes", "no finished run (or no model shape) to check")
    wrong = [r for r in checked if r["kv_bytes"] != expected_kv_bytes(r, per_token)]
    if wrong:
        r = wrong[0]
        return warn(
            "profile.kv_bytes",
            f"the {r['mode']} cache at batch {r['batch']} holds {r['kv_bytes']:,} bytes, not "
            f"batch x {r['cached_tokens']} tokens x {unit_of(r, per_token) or 0:,} bytes "
            f"= {expected_kv_bytes(r, per_token):,}: the cache is not in the format the "
            "prediction assumes",
            mismatches=[{"mode": w["mode"], "batch": w["batch"], "kv_bytes": w["kv_bytes"],
                         "expected": expected_kv_bytes(w, per_token)} for w in wrong],
        )
    # the units the rows' KV bytes were checked against: an Int8 run through the fast path
    # keeps fp16 scales, which an fp32 model's own code keeps in fp32
    units: dict[tuple[str, bool], int] = {}
    for r in checked:
        fast = r["mode"] == "int8" and bool(r.get("fast_layers"))
        units[(r["mode"], fast)] = unit_of(r, per_token) or 0
    unquantized_first = sorted(units.items(), key=lambda i: (i[0][0] != "unquantized", i[0]))
    parts = [
        f"{unit:,} bytes {'unquantized' if mode == 'unquantized' else 'Int8'}"
        + (" through the fast path" if fast else "")
        for (mode, fast), unit in unquantized_first
    ]
    u = [v for (m, _), v in units.items() if m == "unquantized"]
    q = [v for (m, _), v in units.items() if m == "int8"]
    ratio = f" ({q[0] / u[0]:.3f}x)" if len(u) == 1 and len(q) == 1 and u[0] else ""
    return ok(
        "profile.kv_bytes",
        f"every cache holds exactly batch x cached tokens x {', '.join(parts)}{ratio}",
    )


def quality_finding(rec: Optional[QualityRecord]) -> Optional[Finding]:
    if rec is None or not rec.quality:
        return None  # not asked for, or it failed (run_failures says why)
    q = rec.quality
    ppl_u, ppl_q = q.get("ppl_unquantized"), q.get("ppl_int8")
    ppl = (f"perplexity {ppl_u:.4g} unquantized, {ppl_q:.4g} Int8"
           if ppl_u is not None and ppl_q is not None else "perplexity out of range")
    return info(
        "profile.quality",
        f"teacher-forced over {q['tokens']} tokens ({q['text']}): top-1 agreement "
        f"{100 * q['top1_agreement']:.1f}%, {ppl}, |logit difference| mean "
        f"{q['mean_abs_logit_diff']:.3g}, max {q['max_abs_logit_diff']:.3g}",
    )


def evaluate(
    m: Measurements,
    source: ModelSource,
    per_token: PerToken,
    layers: Optional[int],
    timeout: float,
    plan_problem: Optional[str] = None,
) -> list[Finding]:
    rows = [r.row for r in m.runs]
    device = m.device
    findings = [info(
        "profile.device",
        f"{device.get('kind')}: {device.get('name')} ({human_bytes(device.get('total_bytes'))}), "
        f"torch {m.versions.get('torch')}, transformers {m.versions.get('transformers')}",
    )]
    if device.get("cudnn_attention"):
        # Measured with torch 2.11 on an H100: cuDNN's attention builds a new plan for every
        # new key length, i.e. every decode step of the unquantized cache (tens of ms each).
        findings.append(info(
            "profile.baseline",
            "the unquantized cache's attention (torch SDPA with a mask) may run on cuDNN here, "
            "which some torch releases re-plan for every new cached length; its decode speed "
            "can then be far below a server's that uses flash-attn or turns cuDNN attention "
            "off",
            fix="compare against that baseline: rerun with --no-cudnn-attention",
        ))
    if source.random_weights:
        code = ("the checkpoint's model code" if source.remote_code == "checkpoint"
                else "qwen-kvprep's own model code (the folder has none)")
        findings.append(info(
            "profile.source",
            f"random weights built from config.json on the device, {code}, "
            "qwen-kvprep's loader and kernel sources",
        ))
    findings += run_failures(m, source, timeout)
    oom = oom_finding(rows)
    if oom is not None:
        findings.append(oom)
    findings.append(kernel_finding(rows, layers, source))
    findings.append(kv_finding(rows, per_token))
    if plan_problem:
        findings.append(warn("profile.plan", f"no prediction: {plan_problem}"))
    quality = quality_finding(m.quality)
    if quality is not None:
        findings.append(quality)
    return findings
