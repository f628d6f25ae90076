"""convert's proof that OUT is the same model as DIR ("proven by default").

In a child process (qwen_kvprep.childproc: own session, bounded in time, killed with its
parent, events on a pipe of their own), the original is loaded through its own remote code
and OUT natively as Qwen2ForCausalLM, and both read the same prompts; verify_child.py
measures, this module judges:

- the loaded weights, tensor by tensor (c_attn's thirds against q/k/v_proj, ...): equal
  bit for bit, or the tensor is named;
- the logits of a padded batch and of every greedy step both took from the same tokens:
  within float rounding (TOLERANCE below, per dtype);
- the greedy tokens: the same, or parting only where the original's top two logits are
  closer than that rounding (a tie the dtype cannot decide);
- the tokenizer and chat-template proofs of qwen_kvprep.convert.tokproof;
- with a context factor: how far OUT's logits move from Qwen's code at 1x, 2x and 4x
  seq_length (context.py), reported, never judged.

DIR is never written. On transformers 4.54 and later Qwen's code loads only with
qwen-kvprep's compatibility module (compat.py), so the original is loaded from a
temporary folder of links to DIR's files in which modeling_qwen.py is a patched copy and
the module sits beside it, with a modules cache of its own (HF_MODULES_CACHE); both go
when the proof ends, whatever the child did, or, when this process was killed, with the
next proof's start.
"""

from __future__ import annotations

import importlib.metadata
import math
import os
import sys
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, cast

from qwen_kvprep import compat
from qwen_kvprep.childproc import (
    ChildOutcome,
    ShownEvent,
    child_env,
    owned_tempdir,
    run_events_child,
)
from qwen_kvprep.common import COMPAT_FILE, MODELING_FILE, STATE_DIRNAME
from qwen_kvprep.convert import context as ctx
from qwen_kvprep.convert.verify_protocol import (
    DEFAULT_NEW_TOKENS,
    PHASE_WORDS,
    PROMPTS,
    LogitDiff,
    Proof,
    VerifyChildResult,
)
from qwen_kvprep.engines.installs import broken_companion, explain_companion
from qwen_kvprep.errors import CheckpointError, UsageError
from qwen_kvprep.findings import Finding, Severity, fail, info, ok, skip, warn
from qwen_kvprep.untrusted import read_regular

# the first transformers release with Qwen2ForCausalLM: OUT loads natively from there on
QWEN2_SINCE = (4, 37)


def predates_qwen2() -> Optional[str]:
    """The installed transformers' release where it cannot load OUT (older than 4.37)."""
    from packaging.version import InvalidVersion, Version

    try:
        release = importlib.metadata.version("transformers")
        return release if Version(release).release[:2] < QWEN2_SINCE else None
    except (importlib.metadata.PackageNotFoundError, InvalidVersion):
        return None

PhaseCallback = Callable[[str], None]

DEFAULT_TIMEOUT_S = 1800.0
# modeling_qwen.py is some 60 kB; anything near this is not Qwen's file
_MODELING_LIMIT = 4 * 2**20

# Largest relative logit difference (|Δ| over the largest |logit|) that is float rounding.
# The two models compute the same sums in a different order (one fused c_attn matmul
# against three, SDPA against Qwen's own attention), so the last bits differ and grow
# through the layers, about sqrt(layers) times one matmul's rounding:
# - float32 (eps 1.2e-7): 1e-5 is a hundred eps, far above that and far below a real
#   difference (one changed weight moves logits by 1e-3 and more);
# - bfloat16 (eps 7.8e-3) and float16 (eps 9.8e-4): one rounding of the logits
#   themselves is 2^-8 of their size in bf16, and the hidden states are rounded after
#   every layer: 1/16 of the largest logit. A transposed or swapped tensor moves them by
#   their own size.
TOLERANCE = {"float32": 1e-5, "bfloat16": 0.0625, "float16": 0.0625}
# GPTQ: both sides run the backend's Int4 kernels on fp16; its dequantization order may
# differ between the fused and the split projections.
GPTQ_TOLERANCE = 0.0625


@dataclass
class VerifyResult:
    """The proof's verdict: `ok` when no check failed; `lines` for convert to print."""

    ok: bool
    checks: list[Finding] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    measured: Optional[VerifyChildResult] = None
    # what convert's refusal says first: the cause, in a few words ("" when ok)
    headline: str = ""
    # (message, fix) when the proof could not run for a reason of this environment (a
    # package that does not import), not of the model
    blocked: Optional[tuple[str, str]] = None

    def to_json(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "headline": self.headline,
            "checks": [f.to_json() for f in self.checks],
            "lines": list(self.lines),
            "measured": dict(self.measured) if self.measured is not None else None,
        }


# -- the view of DIR -------------------------------------------------------------------------


def prepare_original(src: Path, dest: Path) -> None:
    """`dest` (new) as DIR's files by link, with modeling_qwen.py carrying only our
    compatibility lines (the Int8 fast path's are taken out: the proof runs without the
    quantized cache) and the module beside it."""
    src = Path(os.path.abspath(src))
    dest.mkdir()
    for name in sorted(os.listdir(src)):
        if name in (STATE_DIRNAME, COMPAT_FILE, MODELING_FILE):
            continue
        os.symlink(src / name, dest / name)
    modeling = src / MODELING_FILE
    if not modeling.is_file():
        raise UsageError(
            f"{src} has no {MODELING_FILE}: the proof loads the original through its own code",
            fix="convert a Qwen (v1) checkpoint folder, or add --no-verify to skip the proof",
        )
    text = read_regular(modeling, limit=_MODELING_LIMIT).decode("utf-8")
    (dest / MODELING_FILE).write_text(compat.patched(compat.without_ours(text)), encoding="utf-8")
    (dest / COMPAT_FILE).write_bytes(compat.compat_bytes())


def child_command(
    original: Path, out: Path, fd: int, *, device: str, layers: Optional[int],
    new_tokens: int, context: bool, tokenizer: bool,
) -> list[str]:
    cmd = [
        sys.executable, "-m", "qwen_kvprep.convert.verify_child",
        "--original", str(original), "--out", str(out), "--fd", str(fd),
        "--device", device, "--new-tokens", str(new_tokens),
    ]
    if layers is not None:
        cmd += ["--layers", str(layers)]
    if context:
        cmd.append("--context")
    if not tokenizer:
        cmd.append("--no-tokenizer")
    return cmd


def verify(
    src: Path,
    out: Path,
    *,
    timeout: float,
    context_factor: Optional[float],
    device: str = "auto",
    layers: Optional[int] = None,
    new_tokens: int = DEFAULT_NEW_TOKENS,
    tokenizer: bool = True,
    measure_context: Optional[bool] = None,
    on_phase: Optional[PhaseCallback] = None,
    rerun: str = "rerun convert with a larger --verify-timeout, or skip the proof with --no-verify",
) -> VerifyResult:
    """Prove OUT equal to DIR in a child process bounded by `timeout` seconds.

    `context_factor`: convert was asked to extend the context (OUT's config declares rope
    scaling): also measure how far the logits move past seq_length. `layers`: run at most
    this many layers (fewer are run anyway where both copies do not fit).
    `measure_context`: measure past seq_length even without a factor (what serving the
    exact OUT past its declared length gives); default: when `context_factor` is set. Never
    raises for what the child does, nor for a DIR whose code cannot be read (a failed
    result, `verify.original`)."""
    src, out = Path(os.path.abspath(src)), Path(os.path.abspath(out))
    old = predates_qwen2()
    if old is not None:
        f = fail(
            "verify.child",
            f"transformers {old} cannot load OUT natively (Qwen2ForCausalLM arrived in "
            "transformers 4.37), so the proof cannot run here",
            fix="pip install -U \"transformers>=4.37\" and run convert again, or skip the proof "
            "with --no-verify (the tensors are still compared bit for bit)",
        )
        return VerifyResult(False, [f], [f"proof: FAILED: {f.message}"], headline=f.message)
    measure = context_factor is not None if measure_context is None else measure_context

    def on_event(event: ShownEvent) -> None:
        if on_phase is None:
            return
        phase = str(event.get("phase"))
        if event.get("event") == "phase":
            on_phase(PHASE_WORDS.get(phase, phase))
        elif event.get("event") == "progress":
            on_phase(f"block {event.get('done')}/{event.get('total')}")

    # no dot in any name: transformers imports the code as a module named after the folder;
    # what a killed run left under this prefix goes first (owned_tempdir)
    with owned_tempdir("qwen_kvprep_verify_") as tmp:
        original = Path(tmp) / "original"
        try:
            prepare_original(src, original)
        except UnicodeDecodeError as exc:
            return _not_utf8(src / MODELING_FILE, exc)
        except (OSError, ValueError, UsageError) as exc:
            why = exc.message if isinstance(exc, UsageError) else f"{type(exc).__name__}: {exc}"
            own = exc.fix if isinstance(exc, UsageError) else None
            f = fail("verify.original", f"the original's code could not be prepared: {why}",
                     fix=own or "see the message; --no-verify converts without the proof "
                     "(the tensors are still compared bit for bit)")
            return VerifyResult(False, [f], [f"proof: FAILED: {f.message}"],
                                headline=f"the proof could not start: {why}")
        env = child_env({"HF_MODULES_CACHE": str(Path(tmp) / "modules")})
        outcome = run_events_child(
            lambda fd: child_command(
                original, out, fd, device=device, layers=layers, new_tokens=new_tokens,
                context=measure, tokenizer=tokenizer,
            ),
            timeout,
            on_event,
            env=env,
            prefix="qwen-kvprep-verify-",
        )
    return judge(cast("ChildOutcome[VerifyChildResult]", outcome), timeout=timeout, rerun=rerun)


def _not_utf8_words(path: Path, exc: UnicodeDecodeError) -> tuple[str, str]:
    bad = exc.object[exc.start:exc.end].hex(" ") if isinstance(exc.object, bytes) else "?"
    what = (f"{path} is not UTF-8 text (bytes {bad} at offset {exc.start:,}): Python, and "
            "so transformers, cannot import the original's code")
    fix = (f"restore the model's own {MODELING_FILE} (download it again from the model's "
           "repository), or convert without the proof: --no-verify (the tensors are still "
           "compared bit for bit)")
    return what, fix


def check_code(src: Path) -> None:
    """Refuse (CheckpointError), before convert writes anything, a modeling_qwen.py the
    proof could not import: one that is not UTF-8 text."""
    path = Path(src) / MODELING_FILE
    try:
        read_regular(path, limit=_MODELING_LIMIT).decode("utf-8")
    except UnicodeDecodeError as exc:
        what, fix = _not_utf8_words(path, exc)
        raise CheckpointError.failing("verify.original", what, fix, [path]) from None
    except OSError:
        return  # the proof says what is wrong with it, in its own words


def _not_utf8(path: Path, exc: UnicodeDecodeError) -> VerifyResult:
    what, fix = _not_utf8_words(path, exc)
    f = fail("verify.original", what, fix=fix, paths=[path])
    return VerifyResult(False, [f], [f"proof: FAILED: {what}"],
                        headline=f"{MODELING_FILE} is not UTF-8 text, so the proof could not "
                        "load the original")


# -- judging ---------------------------------------------------------------------------------

# the width the proof's lines are wrapped to (a terminal's, with room for the indent)
WIDTH = 100


def wrapped(line: str, width: int = WIDTH) -> list[str]:
    """`line` in lines of at most `width` characters, continued four columns further in."""
    indent = line[: len(line) - len(line.lstrip(" "))]
    return textwrap.wrap(
        line, width, initial_indent="", subsequent_indent=indent + "    ",
        break_long_words=True, break_on_hyphens=False, drop_whitespace=True,
    ) or [line]


def _g(x: float) -> str:
    return f"{x:.2g}"


def tolerance(dtype: str, gptq: bool) -> float:
    return GPTQ_TOLERANCE if gptq else TOLERANCE.get(dtype, TOLERANCE["bfloat16"])


def _logit_finding(what: str, diff: LogitDiff, tol: float, dtype: str) -> Finding:
    bad_a, bad_b = diff.get("nonfinite_original", 0), diff.get("nonfinite_converted", 0)
    if bad_a or bad_b or not math.isfinite(diff["max_abs"]) or not math.isfinite(diff["scale"]):
        # NaN compares as no difference: such logits prove nothing, whichever side has them
        who = (
            f"the original's own logits are NaN or infinite at {bad_a} of {diff['positions']} "
            "positions" if bad_a else
            f"OUT's logits are NaN or infinite at {bad_b} of {diff['positions']} positions "
            "where the original's are finite" if bad_b else
            "the logits' difference is NaN"
        )
        return fail(
            "verify.logits", f"{what}: {who}: nothing was compared there",
            fix="look for NaN in the weights (the weights line above names them) or for an "
            "overflow of the dtype; --no-verify converts without the proof",
            details=dict(diff),
        )
    words = (
        f"{what}: max |Δlogit| {_g(diff['max_abs'])} over {diff['positions']} positions, "
        f"{_g(diff['max_rel'])} of the largest logit ({dtype} allows {_g(tol)})"
    )
    details = dict(diff)
    if diff["max_rel"] <= tol:
        return ok("verify.logits", words, details=details)
    return fail(
        "verify.logits",
        words + ": OUT does not compute what the original computes",
        fix="convert again into a new folder; if it fails again, report it with this output",
        details=details,
    )


def _proof_finding(id: str, what: str, proof: Proof) -> Finding:
    status = proof["status"]
    message = proof["message"]
    words = message if message.startswith(f"{what}:") else f"{what}: {message}"
    details = {"proof": proof["details"], "proof_lines": list(proof.get("lines", []))}
    if status == "ok":
        return ok(id, words, details=details)
    if status == "unavailable":
        return skip(id, f"{what} not run: {proof['message']}")
    return fail(id, words, details=details)


def judge(
    outcome: ChildOutcome[VerifyChildResult], *, timeout: float, rerun: str
) -> VerifyResult:
    """The findings and lines for what the child said (pure: testable without a model)."""
    if outcome.timed_out:
        phase = PHASE_WORDS.get(outcome.phase, outcome.phase)
        msg = f"the proof did not finish within {timeout:g} s (it was {phase})"
        f = fail("verify.timeout", msg, fix=rerun, details={"phase": outcome.phase})
        return VerifyResult(False, [f], [f"proof: FAILED: {msg}; {rerun}"],
                            headline=f"the proof did not finish in {timeout:g} s")
    result = outcome.result
    if result is None:
        if outcome.error is not None:
            err = outcome.error
            msg = (f"the proof stopped while {PHASE_WORDS.get(err['phase'], err['phase'])}: "
                   f"{err['type']}: {err['message']}")
        else:
            msg = (f"the proof's process ended (exit status {outcome.returncode}) while "
                   f"{PHASE_WORDS.get(outcome.phase, outcome.phase)}, without a result")
        tail = outcome.log_tail[-5:]
        err_text = "\n".join([err["message"], err["traceback"]] if outcome.error else [])
        companion = broken_companion(err_text or "\n".join(outcome.log_tail))
        if companion is not None:  # the environment, not the model: say so, and the fix
            words, fix = explain_companion(companion, err_text.split("\n")[0] or msg)
            f = fail("verify.install", f"the proof could not run: {words}", fix=fix)
            return VerifyResult(False, [f], [f"proof: could not run: {words}", f"  fix: {fix}"],
                                blocked=(f.message, fix))
        f = fail("verify.child", msg, details={"log_tail": tail})
        return VerifyResult(False, [f], [f"proof: FAILED: {msg}", *(f"  | {t}" for t in tail)],
                            headline=msg)
    return _judge_result(result)


def _judge_result(r: VerifyChildResult) -> VerifyResult:
    checks: list[Finding] = []
    dtype = r["dtype_original"]
    tol = tolerance(dtype, r["gptq"])
    fitted = r["fit"]
    head = (
        f"proof: the original through its own code and OUT as Qwen2ForCausalLM, "
        f"{len(r['prompt_tokens'])} prompts of {min(r['prompt_tokens'])}-"
        f"{max(r['prompt_tokens'])} tokens, {dtype}, {r['device']}, transformers "
        f"{r['transformers']}"
    )
    if fitted["layers_run"] < fitted["layers_total"]:
        checks.append(warn(
            "verify.fit",
            f"the forward ran on the first {fitted['layers_run']} of "
            f"{fitted['layers_total']} layers in both models ({fitted['reason']}); layers "
            f"{fitted['layers_run']}-{fitted['layers_total'] - 1} were not run",
            fix="run the proof on a machine that holds two copies of the model for the rest",
            details=dict(fitted),
        ))
    if r["dtype_converted"] != dtype:
        checks.append(fail(
            "verify.dtype",
            f"OUT loads in {r['dtype_converted']}, the original in {dtype}",
            fix="check torch_dtype in OUT's config.json against the checkpoint's",
        ))
    w = r["weights"]
    if w["skipped"] is not None:
        checks.append(skip("verify.weights", f"loaded weights not compared: {w['skipped']}"))
    elif w["differ"]:
        shown = "; ".join(w["differ"][:5])
        more = f" (and {len(w['differ']) - 5} more)" if len(w["differ"]) > 5 else ""
        checks.append(fail(
            "verify.weights",
            f"{len(w['differ'])} of OUT's tensors are not the original's: {shown}{more}",
            fix="convert again into a new folder; OUT was changed or written wrongly",
            differ=w["differ"],
        ))
    else:
        checks.append(ok(
            "verify.weights",
            f"weights: all {w['compared']} loaded tensors equal the original's bit for bit",
        ))
    if w.get("nan"):
        nan = w.get("nan", [])
        checks.append(warn(
            "verify.nan",
            f"the original's weights hold NaN, and OUT the same bits: {'; '.join(nan[:3])}"
            + (f" (and {len(nan) - 3} more)" if len(nan) > 3 else "")
            + ": a token that reads such a row gets NaN logits in both",
            fix="if those rows are the padding past the tokenizer's ids, no text reaches them",
            nan=nan,
        ))
    if "blocks" in r:
        checks += block_findings(r)
    else:
        checks.append(_logit_finding("logits (padded batch)", r["logits"], tol, dtype))
    if "greedy_skipped" in r:
        checks.append(skip("verify.greedy", f"greedy steps not run: {r['greedy_skipped']}"))
    else:
        checks.append(_logit_finding("logits (greedy steps)", r["steps"], tol, dtype))
        checks.append(_greedy_finding(r, tol))
    checks.append(_proof_finding("verify.tokenizer", "tokenizer", r["tokenizer"]))
    checks.append(_proof_finding("verify.template", "chat template", r["template"]))
    if r["scaling_set_aside"] is not None:
        sc = r["scaling_set_aside"]
        checks.append(info(
            "verify.scaling",
            f"OUT declares rope_scaling {sc.get('rope_type', sc.get('type'))} factor "
            f"{sc.get('factor')}: the comparison runs OUT without it (its weights and "
            "architecture); what the scaling changes is measured below",
        ))
    lines = [head]
    context_lines: list[str] = []
    if "context" in r:
        context_lines = ctx.describe(r["context"])
        checks.append(info("verify.context", context_lines[0], details=dict(r["context"])))
    passed = not any(f.severity is Severity.FAIL for f in checks)
    for f in checks:
        if f.id == "verify.context":
            continue
        mark = {Severity.FAIL: "FAILED: ", Severity.WARN: "note: ", Severity.SKIP: "skipped: "}
        lines.append(f"  {mark.get(f.severity, '')}{f.message}")
        proof = f.details.get("proof_lines")
        lines += [f"    {x.strip()}" for x in proof if isinstance(x, str)] if isinstance(
            proof, list) else []
    lines += context_lines
    lines.append("proof: " + ("OK" if passed else "FAILED"))
    return VerifyResult(passed, checks, [w for x in lines for w in wrapped(x)], r,
                        headline="" if passed else _headline(checks))


def _headline(checks: list[Finding]) -> str:
    """The cause of a failed proof, first: NaN logits are not a difference of the models."""
    failed = [f for f in checks if f.severity is Severity.FAIL]
    for f in failed:
        if f.id == "verify.logits" and "NaN" in f.message:
            return f.message.split(": nothing was compared", 1)[0]
    first = failed[0].message if failed else "a check failed"
    return f"the converted model does not behave as the original ({first})"


def block_findings(r: VerifyChildResult) -> list[Finding]:
    """The block-by-block proof: the hidden states after every block, then the logits,
    within the rounding of the dtype both computed in."""
    compute = r.get("compute_dtype", r["dtype_original"])
    tol = tolerance(compute, r["gptq"])
    blocks = r.get("blocks", [])
    parted = [i for i, d in enumerate(blocks) if d["max_rel"] > tol]
    worst = max((d["max_rel"] for d in blocks), default=0.0)
    if parted:
        first = parted[0]
        found = fail(
            "verify.blocks",
            f"blocks: the hidden states part after block {first} of {len(blocks)} "
            f"({_g(blocks[first]['max_rel'])} of the largest, {compute} allows {_g(tol)}): "
            "OUT does not compute what the original computes from there",
            fix="convert again into a new folder; if it fails again, report it with this output",
            details={"blocks": blocks},
        )
    else:
        found = ok(
            "verify.blocks",
            f"blocks: the hidden states after each of the {len(blocks)} blocks agree "
            f"(largest difference {_g(worst)} of the largest value, {compute} allows "
            f"{_g(tol)}), every block run one at a time in {compute}",
            details={"blocks": blocks},
        )
    logits = _logit_finding("logits (each prompt alone)", r["logits"], tol, compute)
    return [found, logits]


def _greedy_finding(r: VerifyChildResult, tol: float) -> Finding:
    runs = r["greedy"]
    new = len(runs[0]["original"]) if runs else 0
    parted = [g for g in runs if g["first_divergence"] is not None]
    details: Mapping[str, object] = {"runs": runs}
    if not parted:
        return ok(
            "verify.greedy",
            f"greedy: the same {new} tokens from both for each of the {len(runs)} prompts",
            details=details,
        )
    # a near tie: the original's own top two within rounding of each other
    ties = [g for g in parted if g["margin"] is not None
            and g["margin"] <= tol * r["steps"]["scale"]]
    words = "; ".join(
        f"prompt {g['prompt'] + 1} ({PROMPTS[g['prompt']][:24]!r}…) parts at token "
        f"{g['first_divergence']} (the original's top two {_g(g['margin'] or 0.0)} apart)"
        for g in parted
    )
    if len(ties) == len(parted):
        return ok("verify.greedy", f"greedy: same tokens up to near ties: {words}",
                  details=details)
    return fail("verify.greedy", f"greedy: the tokens differ: {words}",
                fix="convert again into a new folder; if it fails again, report it",
                details=details)
