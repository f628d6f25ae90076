"""The one renderer: findings and results as human text, the versioned `--json` document
and the Markdown block of `doctor --report`; errors as messages; fix's planned writes as
diffs; the story `demo` tells. The library returns data; only this module formats it.

Everything qwen-kvprep prints goes through `emit` (or `report_error`), which removes
secrets as a last net, whichever check or step put them into a message.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Optional

from qwen_kvprep import __version__
from qwen_kvprep.checks import AREAS
from qwen_kvprep.errors import KvprepError
from qwen_kvprep.findings import Finding, Severity
from qwen_kvprep.quickstart import Planting, Request, json_document, say
from qwen_kvprep.redact import scrub, scrub_findings, scrub_mapping, sensitive_names

if TYPE_CHECKING:
    from pathlib import Path

    from qwen_kvprep.checks import Check
    from qwen_kvprep.demo import DemoResult
    from qwen_kvprep.journal.writer import PlannedWrite
    from qwen_kvprep.probe.facts import Facts
    from qwen_kvprep.smoke.evaluate import SmokeSummary
    from qwen_kvprep.steps.fix import FixResult
    from qwen_kvprep.steps.prestart import Prepared
    from qwen_kvprep.steps.revert import RevertResult

SCHEMA_VERSION = 1

_SYMBOL = {
    Severity.OK: "ok  ",
    Severity.INFO: "info",
    Severity.WARN: "WARN",
    Severity.FAIL: "FAIL",
    Severity.SKIP: "skip",
}
_COLOUR = {
    Severity.OK: "32",
    Severity.INFO: "36",
    Severity.WARN: "33",
    Severity.FAIL: "31;1",
    Severity.SKIP: "2",
}
_AREA_TITLE = {
    "env": "Environment",
    "checkpoint": "Checkpoint",
    "convert": "Converted by qwen-kvprep convert (provenance.json)",
    "config": "config.json",
    "kernels": "Kernel sources",
    "build": "Build",
    "prebuilt": "Prebuilt kernels",
    "compat": "Model code on this transformers (modeling_qwen.py)",
    "fastkv": "Fast path (modeling_qwen.py)",
    "modules": "Modules cache",
    "state": "Recorded state (.qwen-kvprep)",
    "smoke": "Smoke test",
}


def emit(text: str, stream: Optional[IO[str]] = None) -> None:
    """Print a report or message, secrets removed."""
    print(scrub(text), file=stream or sys.stdout)


def use_colour(stream: IO[str]) -> bool:
    if os.environ.get("NO_COLOR") is not None:
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


# -- findings ----------------------------------------------------------------------------


def _paint(text: str, code: str, colour: bool) -> str:
    return f"\x1b[{code}m{text}\x1b[0m" if colour else text


def _area_order(findings: Iterable[Finding]) -> list[Finding]:
    """By area (env first), stable within an area."""
    order = {a: i for i, a in enumerate(AREAS)}
    return sorted(findings, key=lambda f: order.get(f.area, len(order)))


def _grouped(findings: Iterable[Finding]) -> list[tuple[str, list[Finding]]]:
    groups: dict[str, list[Finding]] = {}
    for f in _area_order(findings):
        groups.setdefault(f.area, []).append(f)
    return list(groups.items())


def render_human(findings: Sequence[Finding], colour: bool = False, verbose: bool = False) -> str:
    """One line a finding, grouped by area; details and fixes for what is not ok."""
    lines: list[str] = []
    for area, items in _grouped(findings):
        lines.append(_paint(_AREA_TITLE.get(area, area), "1", colour))
        for f in items:
            tag = _paint(_SYMBOL[f.severity], _COLOUR[f.severity], colour)
            lines.append(f"  {tag}  {f.id:<28} {f.message}")
            if f.severity in (Severity.WARN, Severity.FAIL) or verbose:
                for p in f.paths:
                    lines.append(f"        path: {p}")
                if f.fix:
                    lines.append(f"        fix:  {f.fix}")
    lines.append(summary_line(findings))
    return "\n".join(lines)


def render_quiet(findings: Sequence[Finding], result: bool = False) -> str:
    """-q/--quiet: only what needs attention (warnings and failures, each with its fix) and,
    with `result`, the last finding (what the command made, and where) as its result."""
    lines: list[str] = []
    for f in _area_order(findings):
        if f.severity in (Severity.WARN, Severity.FAIL):
            lines.append(f"{f.severity.value}: {f.id}: {f.message}")
            if f.fix:
                lines.append(f"  fix: {f.fix}")
    if result and findings:
        last = findings[-1]
        lines.append(f"Result: {last.message}" + (f" ({last.paths[0]})" if last.paths else ""))
    return "\n".join(lines)


def summary_line(findings: Sequence[Finding]) -> str:
    counts = {s: 0 for s in Severity}
    for f in findings:
        counts[f.severity] += 1
    parts = [f"{counts[s]} {s.value}" for s in Severity if counts[s]]
    return "summary: " + (", ".join(parts) if parts else "nothing checked")


def document(findings: Sequence[Finding], **extra: object) -> dict[str, object]:
    """The `--json` document: schema and tool versions, ok, findings, then what the command
    adds."""
    doc: dict[str, object] = {
        "schema_version": SCHEMA_VERSION,
        "tool_version": __version__,
        "ok": not any(f.severity is Severity.FAIL for f in findings),
        "findings": [f.to_json() for f in findings],
    }
    doc.update(extra)
    return doc


def render_json(findings: Sequence[Finding], **extra: object) -> str:
    return json.dumps(document(findings, **extra), indent=2, default=str)


def print_findings(findings: Sequence[Finding], as_json: bool, **extra: object) -> None:
    """Findings as the `--json` document (with `extra`) or as text."""
    findings = scrub_findings(findings)
    if as_json:
        emit(render_json(findings, **scrub_mapping(extra)))
    else:
        emit(render_human(findings, colour=use_colour(sys.stdout)))


def report_error(exc: KvprepError, as_json: bool) -> int:
    """An expected failure as a message (and its findings); returns its exit code."""
    findings = scrub_findings(exc.findings)
    message, fix = scrub(exc.message), scrub(exc.fix) if exc.fix else None
    if as_json:
        doc = document(findings, error={"message": message, "fix": fix})
        doc["ok"] = False
        emit(json.dumps(doc, indent=2, default=str))
    else:
        if findings:
            emit(render_human(findings, colour=use_colour(sys.stderr)), sys.stderr)
        emit(f"error: {message}", sys.stderr)
        if fix:
            emit(f"  fix: {fix}", sys.stderr)
    return exc.exit_code


def render_check_list(checks: Iterable[Check]) -> str:
    return "\n".join(f"{chk.id:<32} {chk.title}" for chk in checks)


# -- doctor --report ---------------------------------------------------------------------


def render_markdown(
    findings: Sequence[Finding], facts_table: Optional[Mapping[str, str]] = None
) -> str:
    """A block to paste into a bug report."""
    out = ["### qwen-kvprep report", "", f"qwen-kvprep {__version__}", ""]
    if facts_table:
        out += ["| item | value |", "|---|---|"]
        out += [f"| {k} | {v} |" for k, v in facts_table.items()]
        out.append("")
    out += ["| check | severity | message |", "|---|---|---|"]
    for f in findings:
        msg = f.message.replace("|", "\\|").replace("\n", " ")
        out.append(f"| `{f.id}` | {f.severity.value} | {msg} |")
    return "\n".join(out) + "\n"


def _cell(value: object) -> str:
    text = "-" if value is None or value == "" else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def facts_table(facts: Facts) -> dict[str, str]:
    """Versions, GPUs, toolchain, caches and config flags, one row each."""
    rows: dict[str, str] = {}
    env = facts.env
    if env is not None:
        # here: probe/env.py (subprocess, sysconfig) would cost every CLI start ~15 ms
        from qwen_kvprep.probe.env import summary

        rows.update({k: _cell(v) for k, v in summary(env).items()})
        rows["platform"] = _cell(f"{env.platform} {env.machine}")
        for name, value in sorted(env.env_vars.items()):
            rows[f"${name}"] = _cell(value)
    names = sensitive_names()
    if names:
        # Say that they are set (it can matter: HF_TOKEN for gated repos), never their values.
        rows["secrets set (values hidden)"] = _cell(", ".join(names))
    caches = facts.caches
    if caches is not None:
        if caches.build_cache is not None:
            rows["build cache"] = _cell(f"{caches.build_cache.path} ({caches.build_cache.source})")
        rows["builds in cache"] = _cell(len(caches.builds))
        if caches.modules_root is not None:
            rows["modules cache"] = _cell(
                f"{caches.modules_root.path} ({caches.modules_root.source})"
            )
        mf = caches.module_folder
        if mf is not None:
            rows["module folder"] = _cell(f"{mf.path} ({'exists' if mf.exists else 'absent'})")
    cp = facts.checkpoint
    if cp is not None:
        rows["checkpoint"] = _cell(getattr(cp, "path", None))
        cfg = getattr(cp, "config", None)
        if isinstance(cfg, dict):
            for key in (
                "use_cache_quantization",
                "use_cache_kernel",
                "use_flash_attn",
                "bf16",
                "fp16",
                "fp32",
            ):
                rows[f"config {key}"] = _cell(cfg.get(key, "(unset)"))
        rows["GPTQ"] = _cell(getattr(cp, "gptq", None))
    return rows


def report_markdown(facts: Facts, findings: Sequence[Finding]) -> str:
    """The `doctor --report` block (findings in the human output's order), scrubbed of
    secrets as a whole."""
    text = render_markdown(scrub_findings(_area_order(findings)), facts_table(facts))
    return scrub(text)


# -- fix ---------------------------------------------------------------------------------

_WHOLE_FILE = 4096  # a larger write is summarised: whole sources would drown the config diff


_DIFF_LINES = 60


def render_planned(planned: Sequence[PlannedWrite]) -> str:
    """`fix --dry-run`: unified diffs for text files; a one-line note for binary or large
    ones."""
    import difflib

    out: list[str] = []
    for p in planned:
        try:
            old = (p.old or b"").decode("utf-8")
            new = p.new.decode("utf-8")
        except UnicodeDecodeError:
            out.append(f"would write {p.path} ({len(p.new)} bytes, binary)")
            continue
        if p.old is None and len(p.new) > _WHOLE_FILE:
            out.append(f"would create {p.path} ({len(p.new)} bytes)")
            continue
        diff = list(
            difflib.unified_diff(
                old.splitlines(keepends=True),
                new.splitlines(keepends=True),
                fromfile=f"{p.path} (current)" if p.old is not None else "/dev/null",
                tofile=f"{p.path} (fixed)",
            )
        )
        # a big file is shown by its diff when that is short (a block added to the model code)
        if len(p.new) > _WHOLE_FILE and (
            len(diff) > _DIFF_LINES or sum(map(len, diff)) > _WHOLE_FILE
        ):
            out.append(f"would replace {p.path} ({len(p.old or b'')} -> {len(p.new)} bytes)")
            continue
        out.append("".join(diff).rstrip("\n"))
    return "\n".join(out)


def fix_fields(
    directory: Path, dry_run: bool, extra: Mapping[str, object], planned: Sequence[PlannedWrite]
) -> dict[str, object]:
    """What `fix --json` adds to the document: `extra` is what fix's steps reported."""
    fields: dict[str, object] = {"directory": str(directory), "dry_run": dry_run, **extra}
    if dry_run:
        fields["would_write"] = [{"path": str(p.path), "bytes": len(p.new)} for p in planned]
    return fields


def print_fix(
    directory: Path,
    spelt: str,
    dry_run: bool,
    result: FixResult,
    as_json: bool,
    rerun: Optional[str] = None,
    quiet: bool = False,
) -> None:
    """fix's output: the planned writes (--dry-run), the findings, the verdict and what to
    run next, as text or as the --json document. `spelt`: the folder to serve, as written;
    `rerun`: the command that applies a dry run; `quiet`: of the findings only those that
    need attention."""
    if dry_run and not as_json:
        emit(render_planned(result.planned) or "nothing would change")
    verdict = fix_verdict(spelt, result.findings, result.extra, dry_run, rerun)
    fields = fix_fields(directory, dry_run, result.extra, result.planned)
    fields.update(verdict=verdict.verdict, next=verdict.next)
    if quiet and not as_json:
        problems = render_quiet(result.findings)  # emit removes secrets
        emit(f"{problems}\n{verdict.render()}" if problems else verdict.render())
        return
    print_findings(result.findings, as_json, **fields)
    if not as_json:
        emit(verdict.render())


# -- prestart ------------------------------------------------------------------------------


def prestart_json(request: Request, planting: Planting, reason: str, done: Prepared) -> str:
    """prestart's --json line when it prepared DIR (or fell back), printed before exec."""
    error = None
    if done.failure is not None:
        failure = done.failure
        error = {
            "message": failure.message if isinstance(failure, KvprepError) else repr(failure),
            "fix": failure.fix if isinstance(failure, KvprepError) else None,
        }
    findings = [f.to_json() for f in scrub_findings(done.findings)]
    prepared = None if done.native is not None else reason  # nothing was prepared
    return json_document(request, planting, prepared, findings, error)


def report_prestart(request: Request, done: Prepared) -> None:
    """What prestart's slow path did, on stderr (stdout belongs to CMD)."""
    if done.native is not None:
        say(request, done.native)  # one line: why nothing was prepared
        return
    if done.failure is not None:
        if request.as_json:
            pass  # the document on stdout carries the failure
        elif isinstance(done.failure, KvprepError):
            report_error(done.failure, as_json=False)
        else:
            sys.stderr.write(
                f"qwen-kvprep prestart: unexpected error: {scrub(repr(done.failure))}\n"
            )
        if done.view_error is not None:
            sys.stderr.write(
                f"qwen-kvprep prestart: cannot make {request.target} a view: "
                f"{scrub(str(done.view_error))}\n"
            )
        # not through say(): --quiet silences success, never this
        sys.stderr.write("qwen-kvprep prestart: WARNING: --allow-fallback: starting the "
                         "command without a working Int8 KV cache kernel\n")
        return
    if done.findings and not request.quiet and not request.as_json:
        emit(render_human(done.findings), sys.stderr)
    if done.recheck is not None:
        say(request, f"note: prepared, but the next start will check again ({done.recheck})")


@dataclass(frozen=True)
class FixVerdict:
    """How `fix` ended, in one word for --json and one sentence, and what to run next."""

    verdict: str  # "ready" | "unproven" | "not_ready" | "dry_run"
    text: str
    next: str

    def render(self) -> str:
        return f"Result: {self.text}\nNext: {self.next}"


def fix_verdict(
    spelt: str,
    findings: Sequence[Finding],
    extra: Mapping[str, object],
    dry_run: bool,
    rerun: Optional[str] = None,
) -> FixVerdict:
    """`spelt`: the folder to serve (DIR, or OUT with --output), as the user wrote it;
    `rerun`: the command that applies a dry run (the same options, less --dry-run)."""
    import shlex

    where = shlex.quote(spelt)
    prestart = f"qwen-kvprep prestart {where} -- <your server command>"
    if dry_run:
        return FixVerdict("dry_run", "dry run, nothing was written",
                          rerun or f"qwen-kvprep fix {where}")
    failures = [f for f in findings if f.severity is Severity.FAIL]
    if failures:
        return FixVerdict(
            "not_ready",
            f"NOT ready: {len(failures)} failure(s) above ({', '.join(f.id for f in failures)})",
            failures[0].fix or f"qwen-kvprep doctor {where}",
        )
    smoke = extra.get("smoke")
    if not isinstance(smoke, Mapping) or smoke.get("ok") is not True:
        return FixVerdict(
            "unproven",
            "prepared but not proven: the smoke test did not run (--no-smoke)",
            f"qwen-kvprep smoke {where}, then {prestart}",
        )
    if extra.get("smoke_from_state"):
        text = "ready: nothing changed since the smoke passed (nothing written, nothing loaded)"
    else:
        text = f"ready: the Int8 KV cache works (smoke passed on {smoke.get('device')})"
    return FixVerdict("ready", text, prestart)


# -- revert ------------------------------------------------------------------------------


def render_revert(directory: Path, result: RevertResult) -> str:
    """What revert restored (with --dry-run: would restore), what it left alone and why."""
    would = result.dry_run
    lines: list[str] = []
    if result.temps:
        lines.append(f"removed leftover temporary files: {', '.join(sorted(result.temps))}")
    if result.stale:
        lines.append(
            "removed the records of folders no longer prepared: "
            + ", ".join(sorted(result.stale))
        )
    if result.finished:
        lines.append(
            "finished a revert that was cut short (the files were already restored): removed "
            + ", ".join(result.finished)
        )
        return "\n".join(lines)
    if not result.done and not result.notes:
        lines.append(f"nothing to revert: qwen-kvprep has not changed {directory}")
        return "\n".join(lines)
    if result.done:
        verb = "would restore" if would else "restored"
        lines.append(f"{verb} {len(result.done)} file(s) in {directory}:")
        lines += [f"  {item}" for item in result.done]
    else:
        lines.append(f"nothing to restore in {directory}")
    if result.notes:
        lines.append("would leave alone:" if would else "left alone:")
        lines += [f"  {note}" for note in result.notes]
    if would:
        lines.append(f"dry run: nothing was changed; `qwen-kvprep revert {directory}` does it")
    # builds are per ABI, not per checkpoint: other checkpoints may load the same one
    if result.build_cache is not None:
        kept = "would be kept" if would else "is kept"
        lines.append(f"the build cache fix used, {result.build_cache}, {kept} (builds are "
                     "shared between checkpoints)")
    return "\n".join(lines)


def revert_json(directory: Path, result: RevertResult) -> dict[str, object]:
    """The `revert` member of `revert --json`."""
    return {
        "directory": str(directory),
        "dry_run": result.dry_run,
        "restored": list(result.done),
        "left_alone": list(result.notes),
        "temporary_files_removed": sorted(result.temps),
        "build_cache": None if result.build_cache is None else str(result.build_cache),
    }


# -- demo --------------------------------------------------------------------------------


def _of(findings: list[Finding], *prefixes: str) -> list[Finding]:
    return [f for f in findings if f.id.startswith(prefixes)]


def _mark(f: Finding) -> str:
    return {Severity.WARN: " (warning)", Severity.FAIL: " (FAILED)"}.get(f.severity, "")


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.0f} kB"


def _num(x: float) -> str:
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.1f}"


def _smoke_lines(smoke: SmokeSummary) -> list[str]:
    if not smoke:
        return []
    if smoke.get("error"):
        return [f"the smoke test failed: {smoke['error']}"]
    lines = []
    load = smoke.get("load_seconds")
    dev = smoke.get("device_name") or smoke.get("device")
    if load is not None:
        lines.append(
            f"loaded the model as a server would (from_pretrained, trust_remote_code) on {dev} "
            f"in {load:.1f} s"
        )
    n, k = smoke.get("layers", 0), smoke.get("kernel_layers", 0)
    lines.append(
        f"the compiled kernel ran in {k}/{n} layers ({smoke.get('kernel_calls', 0)} calls)"
        + ("" if k == n and n else ": the model FELL BACK to the slow torch path")
    )
    g = smoke.get("gptq")
    if g:
        backend = ", ".join(sorted(g["classes"])) or "no GPTQ module"
        lines.append(
            f"the Int4 weights: {g['called']} of {g['modules']} GPTQ linear layers ran "
            f"({g['calls']} calls; {backend})"
        )
    kv = smoke.get("kv_bytes_per_token")
    quantized, unquantized = (kv["quantized"], kv["unquantized"]) if kv else (None, None)
    if kv and quantized is not None and unquantized:
        line = (
            f"KV cache per token: {_num(quantized)} bytes instead of "
            f"{_num(unquantized)} ({kv['ratio']:.3f}x)"
        )
        d, s, e = kv.get("head_dim"), kv.get("scale_bytes"), kv.get("element_bytes")
        if d and s and e:
            line += (
                f": each head stores {d} one-byte codes + a {s}-byte scale + a {s}-byte zero "
                f"point = {d + 2 * s} bytes for K and again for V, instead of {d * e}"
            )
        lines.append(line)
    ag = smoke.get("agreement") or {}
    if ag.get("tokens"):
        same, total = ag.get("identical_tokens"), ag.get("tokens")
        rel = ag.get("first_step_rel_logit_diff") or 0.0
        if ag.get("first_divergence") is None:
            lines.append(
                f"quantized and unquantized generations agree on {same}/{total} tokens; "
                f"the first step's logits differ by at most {rel:.1%} of their range"
            )
        else:
            lines.append(
                f"quantized and unquantized generations agree on the first "
                f"{ag['first_divergence']}/{total} tokens; first-step logits within {rel:.1%}"
            )
    tps = smoke.get("tokens_per_s")
    peak = smoke.get("peak_memory")
    if tps and tps["quantized"] and tps["unquantized"]:
        what = "GPU peak" if peak and peak["kind"] == "cuda_max_allocated" else "peak RSS"
        mib = (peak["bytes"] if peak else 0) / 2**20
        lines.append(
            f"speed: {tps['quantized']:.0f} tokens/s quantized, {tps['unquantized']:.0f} "
            f"unquantized; {what} {mib:.0f} MiB (a tiny model: this "
            "says nothing about real speed)"
        )
    return lines


# (heading, finding id prefixes, ids left out): the steps of fix as the demo tells them
_DEMO_STEPS: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("checked it like a real checkpoint", ("checkpoint.",), ("checkpoint.state",)),
    ("chose the kernel sources", ("kernels.",), ()),
    ("patched config.json", ("config.",), ()),
    ("got the kernel extension", ("build.mode", "build.build"), ()),
    ("installed the loader and the modules cache", ("build.loader", "modules."), ()),
    ("recorded the state", ("checkpoint.state",), ()),
)


def render_demo(result: DemoResult) -> str:
    """What the demo did, numbered, in words a newcomer follows."""
    f = result.findings
    m = result.model
    out = ["qwen-kvprep demo: the Int8 KV-cache path on a tiny random model (no download)", ""]
    step = 0

    def add(head: str, items: list[str]) -> None:
        nonlocal step
        step += 1
        out.append(f"{step}. {head}")
        out.extend(f"   - {line}" for line in items)

    if m:
        add(
            f"generated a tiny Qwen (v1) compatible model in {result.checkpoint} "
            f"({result.seconds.get('generate', 0):.1f} s)",
            [
                f"{m['layers']} layers, {m['heads']} heads of dim {m['head_dim']}, {m['dtype']}, "
                f"{_size(m['weights_bytes'])} of weights"
                + (" (GPTQ Int4, as Qwen's -Int4 repos)" if m.get("gptq") else "")
                + ", qwen-kvprep's own remote code"
            ],
        )
    bg = result.background_build
    for head, prefixes, exclude in _DEMO_STEPS:
        items = [x.message + _mark(x) for x in _of(f, *prefixes) if x.id not in exclude]
        if prefixes[0] == "build.mode" and bg.get("compiled"):
            items.insert(0, f"compiled it in the background while the model was generated "
                         f"({bg['seconds']:.0f} s; cached for every later fix on this machine)")
        elif prefixes[0] == "build.mode" and bg.get("reused"):
            items.insert(0, "reused the build an earlier run left in the build cache (no "
                         "compile)")
        if not items and prefixes == ("checkpoint.",) and m:
            items = ["every checkpoint check passed"]  # validate reports only problems
        if items:
            add(head, items)
    smoke = result.smoke
    if smoke:
        add("smoke test, in a child process", _smoke_lines(smoke))
    problems = [x for x in f if x.severity in (Severity.WARN, Severity.FAIL)]
    if problems:
        out += ["", "Problems:"]
        for x in problems:
            out.append(f"  {x.severity.value.upper():4}  {x.id}: {x.message}")
            if x.fix:
                out.append(f"        fix: {x.fix}")
    out.append("")
    total = result.seconds.get("total", 0.0)
    if result.ok:
        out.append(f"Result: the Int8 KV cache works on this machine ({total:.0f} s in all).")
        out.append(
            "Next: qwen-kvprep fix /path/to/Qwen-7B-Chat  (the same steps on a real checkpoint)"
        )
    else:
        msg = result.error.message if result.error else "see the problems above"
        out.append(f"Result: FAILED ({total:.0f} s): {msg}")
        out.append("Next: qwen-kvprep doctor  (explains what is wrong in this environment)")
    cache = result.extra.get("cache_dir")
    if cache:
        out.append(f"Build cache: {cache}")
    where = f"kept in {result.base}" if result.kept else f"removed ({result.base})"
    out.append(f"Demo files: {where}")
    return "\n".join(out)
