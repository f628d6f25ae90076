"""`convert DIR OUT`, the library entry: `convert(directory, out, options) -> ConvertResult`.

Order, every check before the first write:
1. OUT's rules (output.check_out); DIR validated as `fix` validates it (steps/validate.py:
   a Qwen v1 checkpoint, its config, index and shards sound); every tensor's header read and
   the mapping checked against the config (source.read_source); the options and the config
   for Qwen2 worked out; the free space on OUT's device checked against the output's size.
2. Under OUT's lock, in the staging folder (output.py): the tokenizer and generation config
   (convert.tokenizer / convert.chat: they check their inputs in seconds, so first), the
   weights (each source file read once, front to back, hashed on the way; each output
   shard written tensor by tensor, read back as it is written, compared byte for byte with
   what was meant to be there and hashed: convert/readback.py), the index,
   quantize_config.json for GPTQ, config.json.
3. The bit-for-bit check (compare.check_written: OUT's tensor names and headers are the
   plan's, and the read-back found no difference), then, unless asked not to, the
   verification child (convert.verify): the original through its remote code and the
   output natively, block by block. Either failing: nothing is published.
4. provenance.json, then the rename to OUT. The serving command lines (convert.serving)
   come with the result.
5. With `--kv-cache fp8`: steps 1-4 as without it (or OUT found complete), then calibrated
   fp8 KV scales added to OUT in place (convert.calibrated); the calibration text is read
   and counted before step 1.

DIR is only read: nothing here opens a file of DIR for writing.
"""

from __future__ import annotations

import importlib
import importlib.util
import platform
import textwrap
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional, Protocol

from qwen_kvprep import __version__
from qwen_kvprep.convert import already, calibrated, output, reads
from qwen_kvprep.convert.compare import TensorProof, check_written
from qwen_kvprep.convert.context import within_words
from qwen_kvprep.convert.qwen2config import (
    ContextPlan,
    context,
    declared_dtype,
    gptq_quantization,
    qwen2_config,
)
from qwen_kvprep.convert.source import SourcePlan, read_source
from qwen_kvprep.convert.weights import (
    ST_INDEX,
    by_offset,
    index_json,
    plan_shards,
    reading_order,
    write_weights,
)
from qwen_kvprep.errors import KvprepError, RefusedError, UsageError
from qwen_kvprep.findings import Finding, fail, info, warn
from qwen_kvprep.fsutil import atomic_write_bytes, atomic_write_text
from qwen_kvprep.gptqconfig import QUANTIZE_CONFIG
from qwen_kvprep.jsontypes import JSON, JSONObject
from qwen_kvprep.provenance import INPUTS, PROVENANCE, Provenance
from qwen_kvprep.provenance import read as read_provenance
from qwen_kvprep.steps import validate
from qwen_kvprep.untrusted import read_record

_NOT_THE_SAME = "the converted model does not behave as the original"
_SLACK = 32 << 20  # the tokenizer files (a few MB for Qwen's vocabulary), configs, the record


class VerifyLike(Protocol):
    ok: bool
    lines: list[str]

    def to_json(self) -> dict[str, object]: ...


@dataclass(frozen=True)
class ConvertOptions:
    max_shard_size: Optional[int] = None  # bytes; None: the source's own sharding
    context_factor: Optional[float] = None
    rope_scaling: Optional[str] = None
    verify: bool = True
    verify_timeout: float = 1800.0
    spelt: Optional[str] = None  # DIR as the user gave it
    command: str = ""  # the command line, for provenance
    kv_cache: Optional[str] = None  # "fp8": calibrated KV scales added (convert.calibrated)
    calibration: Optional[Path] = None  # the text they are measured on (default: built in)


@dataclass
class ConvertResult:
    out: Path
    files: list[tuple[str, int]]  # (name, size) of every file in OUT
    ctx: ContextPlan
    dtype: str
    gptq: bool
    comparison: TensorProof
    verify: Optional[VerifyLike] = None
    findings: list[Finding] = field(default_factory=list)
    serving: list[tuple[str, str]] = field(default_factory=list)
    unchanged: bool = False  # OUT already held this conversion: nothing was written
    kv_cache: Optional[JSONObject] = None  # provenance's kv_cache record (--kv-cache fp8)

    @property
    def exact_words(self) -> str:
        return exact_words(self.ctx, self.verify)

    def to_json(self) -> dict[str, object]:
        return {
            "out": str(self.out),
            "files": [{"name": n, "size": s} for n, s in self.files],
            "exact_up_to": self.ctx.exact_up_to,
            "exact": self.exact_words,
            "max_position_embeddings": self.ctx.max_positions,
            "serving_length": self.ctx.serving_length,
            "rope_scaling": self.ctx.rope_scaling,
            "context_factor": self.ctx.factor,
            "dtype": self.dtype,
            "gptq": self.gptq,
            "compare": self.comparison.to_json(),
            "verify": self.verify.to_json() if self.verify is not None else None,
            "serving": [{"engine": e, "command": c} for e, c in self.serving],
            "unchanged": self.unchanged,
            "kv_cache": self.kv_cache,
        }


def _optional(module: str) -> Optional[object]:
    """`qwen_kvprep.convert.<module>` where this build has it, else None (its own import
    errors propagate: a module that is there but broken is a bug, not an absence)."""
    name = f"qwen_kvprep.convert.{module}"
    if importlib.util.find_spec(name) is None:
        return None
    return importlib.import_module(name)


def _versions() -> JSONObject:
    from importlib import metadata

    out: JSONObject = {"python_version": platform.python_version()}
    for dist in ("torch", "transformers", "safetensors", "tokenizers"):
        try:
            out[f"{dist}_version"] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[f"{dist}_version"] = None
    return out


def _generation(directory: Path) -> Optional[dict[str, JSON]]:
    try:
        data = read_record(directory / "generation_config.json", 1 << 20, 16)
    except (OSError, ValueError):
        return None  # its own check (and convert.chat) say what is wrong with it
    return data if isinstance(data, dict) else None


def exact_words(ctx: ContextPlan, verified: Optional[VerifyLike]) -> str:
    """What is exact, and with a context factor what the proof measured within seq_length."""
    measured = within_words(getattr(verified, "measured", None))
    if ctx.factor is None or measured is None:
        return ctx.exact_words
    return f"{ctx.exact_words} ({measured})"


def _end_of_text(sp: SourcePlan) -> Optional[int]:
    """<|endoftext|>'s id, once qwen.tiktoken is known to fit the embedding (refused
    otherwise, before anything is written)."""
    chat = _optional("chat")
    if chat is None:
        return None
    eot: int = chat.end_of_text_id(sp.directory, sp.shape.vocab)  # type: ignore[attr-defined]
    return eot


def _side_files(sp: SourcePlan, staging: Path, findings: list[Finding], mode: int) -> None:
    """The tokenizer and generation config, from the modules that own them where this
    build has them, created with `mode`."""
    if not _written_by("tokenizer", "write_tokenizer", sp.directory, staging, mode):
        findings.append(warn(
            "convert.tokenizer",
            "no tokenizer was written: this qwen-kvprep has no convert.tokenizer, so OUT "
            "holds the weights and config only (engines need a tokenizer to serve it)",
        ))
    if not _written_by("chat", "write_generation_config", sp.directory, staging, mode):
        findings.append(warn(
            "convert.generation",
            "no generation_config.json was written: this qwen-kvprep has no convert.chat",
        ))


def _written_by(module: str, writer: str, source: Path, staging: Path, mode: int) -> bool:
    """`writer(source, staging, mode=mode)` of `qwen_kvprep.convert.<module>`; False where
    this build has no such module."""
    found = _optional(module)
    if found is None:
        return False
    getattr(found, writer)(source, staging, mode=mode)
    return True


def _verify(
    sp: SourcePlan, staging: Path, ctx: ContextPlan, options: ConvertOptions,
    findings: list[Finding], say: Callable[[str], None],
) -> Optional[VerifyLike]:
    if not options.verify:
        findings.append(info("convert.verify", "verification skipped (--no-verify)"))
        return None
    mod = _optional("verify")
    if mod is None:
        findings.append(warn(
            "convert.verify",
            "not verified by loading: this qwen-kvprep has no convert.verify (the tensors "
            "were compared bit for bit)",
        ))
        return None
    say("verifying: the original and OUT on the same prompts, in a child process")
    result: VerifyLike = mod.verify(  # type: ignore[attr-defined]
        sp.directory, staging, timeout=options.verify_timeout, context_factor=ctx.factor,
        on_phase=lambda words: say(f"proof: {words}"),
    )
    return result


def convert(
    directory: Path,
    out: Path,
    options: ConvertOptions = ConvertOptions(),
    log: Optional[Callable[[str], None]] = None,
) -> ConvertResult:
    """Write DIR as a Qwen2ForCausalLM checkpoint in OUT (KvprepError when refused)."""
    directory, out = directory.absolute(), out.absolute()
    if options.calibration is not None and options.kv_cache is None:
        raise UsageError("--calibration names the text for --kv-cache fp8: add --kv-cache fp8")
    if options.kv_cache is not None:
        return _with_kv_scales(directory, out, options, log)
    say = log or (lambda _msg: None)
    asked = already.Asked(
        options.max_shard_size, options.context_factor,
        options.rope_scaling if options.context_factor is not None else None, options.verify,
    )
    done, why = already.completed(directory, out, asked)
    if done is not None or why:
        output.tidy(out)  # what a kill right after the rename left beside OUT
    if done is not None:
        return _unchanged(out, done)
    try:
        output.check_out(directory, out)
    except UsageError as exc:
        if why:  # OUT is a conversion, but not this one: say which difference
            exc.message += f"; it holds a conversion, but not the one asked for: {why}"
        raise
    # hashed before anything reads them, and again at the end (provenance names these bytes)
    inputs = reads.snapshot(directory, INPUTS)
    dir_st = directory.stat()  # the same folder later is this device and inode
    facts, _advice = validate.check(directory)  # fix's advice (kernels...) is not convert's
    assert facts.checkpoint is not None
    sp = read_source(facts.checkpoint)
    ctx = context(sp.config, options.context_factor, options.rope_scaling)
    gptq = sp.gptq is not None
    dtype = declared_dtype(sp.config, sp.stored_dtype, gptq)
    quant = None
    if gptq:
        in_config = sp.config.get("quantization_config")
        quant = gptq_quantization(
            in_config if isinstance(in_config, dict) else None, sp.quantize_file
        )
    config = qwen2_config(
        sp.config, sp.shape, ctx, dtype, generation=_generation(directory), quantization=quant,
        end_of_text=_end_of_text(sp),
    )
    groups = by_offset(directory, sp.files, reading_order(sp.plan.pieces, sp.file_of, sp.files))
    shards = plan_shards(groups, sp.plan.sources, options.max_shard_size)
    output.check_space(out, sum(s.size for s in shards) + _SLACK)
    check_code = getattr(_optional("verify"), "check_code", None) if options.verify else None
    if check_code is not None:
        check_code(directory)  # a modeling_qwen.py the proof could not import: refused now
    findings: list[Finding] = []
    sources: dict[str, reads.Read] = {}  # each weight file as it was read
    # every file is created with its final mode, never more readable while staged
    modes = output.source_modes(directory, sp.files)
    index_mode, side_mode = 0o644 & modes[0], 0o644 & modes[1]

    def on_source(name: str, read: reads.Read) -> None:
        sources[name] = read

    say(f"converting {directory} into {out} ({len(shards)} shard(s), {dtype})")
    try:
        with output.staged(out) as staging:
            # first: they read and check their own inputs, in seconds, before hours of weights
            _side_files(sp, staging, findings, side_mode)
            written = write_weights(
                directory, sp.files, groups, shards, staging, on_source=on_source,
                progress=say, mode=modes[0],
            )  # each shard read back and compared as it was written
            if len(shards) > 1:
                atomic_write_bytes(staging / ST_INDEX, index_json(shards), index_mode)
            if gptq and sp.quantize_file is not None:
                atomic_write_text(staging / QUANTIZE_CONFIG, _dumps(dict(sp.quantize_file)),
                                  side_mode)
            atomic_write_text(staging / "config.json", _dumps(config), side_mode)
            say("checking every tensor written, bit for bit (each shard was read back as it "
                "was written)")
            comparison = check_written(staging, shards, written, progress=say)
            if not comparison.ok:
                raise RefusedError(
                    f"the written tensors differ from DIR's: {comparison.problems[0]}"
                    + (f" (and {len(comparison.problems) - 1} more)"
                       if len(comparison.problems) > 1 else ""),
                    fix="run convert again once nothing writes DIR; if it persists, report "
                    "it with `qwen-kvprep doctor --report`",
                    findings=[fail("convert.compare", p) for p in comparison.problems[:20]],
                )
            # DIR still holds what was read: else the proof compares OUT with other bytes,
            # and its verdict would blame the conversion for what happened to DIR
            reads.check_dir(directory, {**inputs, **sources}, INPUTS)
            verified = _verify(sp, staging, ctx, options, findings, say)
            reads.check_dir(directory, {**inputs, **sources}, INPUTS)
            if verified is not None and not verified.ok:
                message, fix = getattr(verified, "blocked", None) or (
                    getattr(verified, "headline", "") or _NOT_THE_SAME,
                    "see the checks above; `--no-verify` skips this step")
                raise RefusedError(
                    f"{message}: OUT was not written", fix=fix,
                    findings=list(getattr(verified, "checks", []))
                    or [fail("convert.verify", line) for line in verified.lines[:20]],
                )
            shards_read = {w.name: w.read for w in written}  # as read back, once fsynced
            outputs = {
                p.name: shards_read.get(p.name) or reads.hash_file(p)
                for p in sorted(staging.iterdir())
                if p.is_file() and p.name not in (output.MARKER, PROVENANCE)
            }
            record = Provenance(
                source_path=str(directory),
                source_identity=(dir_st.st_dev, dir_st.st_ino),
                source_files={n: r.record for n, r in {**inputs, **sources}.items()},
                absent=tuple(n for n in INPUTS if n not in inputs),
                outputs={n: r.record for n, r in outputs.items()},
                exact_up_to=ctx.exact_up_to, exact=exact_words(ctx, verified),
                weights=tuple(w.name for w in written),
                spelt=options.spelt, tool_version=__version__,
                extra=_extra(ctx, options, dtype),
            )
            atomic_write_text(staging / PROVENANCE, record.dumps(), side_mode)
            files = [(n, r.ident[2]) for n, r in outputs.items()]
            files.append((PROVENANCE, (staging / PROVENANCE).stat().st_size))
            reads.check_staged(staging, outputs)  # what is published is what is recorded
            output.publish(staging, out, modes)
    except KvprepError:
        raise
    except OSError as exc:
        raise output.no_space(exc, out) from exc
    caveat = ctx.caveat()
    if caveat is not None:
        findings.append(warn("convert.context", caveat))
    result = ConvertResult(out, sorted(files), ctx, dtype, gptq, comparison, verified, findings)
    serving = _optional("serving")
    if serving is not None:
        result.serving = list(serving.commands(  # type: ignore[attr-defined]
            out, gptq=gptq, max_len=ctx.serving_length
        ))
    return result


def _with_kv_scales(
    directory: Path, out: Path, options: ConvertOptions,
    log: Optional[Callable[[str], None]],
) -> ConvertResult:
    """The plain conversion (made, or found in OUT), then calibrated KV scales added to it
    in place (convert.calibrated)."""
    if options.kv_cache not in calibrated.DTYPES:
        raise UsageError(f"--kv-cache {options.kv_cache}: one of {', '.join(calibrated.DTYPES)}")
    calibrated.refuse_gptq(directory)
    cal = calibrated.prepare(directory, options.calibration)  # refused before any write
    restored = calibrated.restore(out)  # what a killed --kv-cache left half-written
    if restored:
        (log or (lambda _msg: None))(
            f"restored {', '.join(restored)} as provenance.json records them (a --kv-cache "
            "run was cut short)")
    result = convert(directory, out, replace(options, kv_cache=None, calibration=None), log)
    done = calibrated.add_scales(result.out, cal, log or (lambda _msg: None))
    result.kv_cache = done.record
    result.unchanged = result.unchanged and done.unchanged
    rec = read_provenance(result.out)
    result.files = sorted([(n, r.size) for n, r in rec.outputs.items()]
                          + [(PROVENANCE, (result.out / PROVENANCE).stat().st_size)])
    result.findings.append(info("convert.kv_cache", done.lines()[0]))
    serving = _optional("serving")
    if serving is not None:
        result.serving = list(serving.commands(  # type: ignore[attr-defined]
            result.out, gptq=result.gptq, max_len=result.ctx.serving_length
        ))
    return result


def _unchanged(out: Path, rec: Provenance) -> ConvertResult:
    """The result of a run that found OUT already holding its conversion (`already`)."""
    raw = rec.extra.get("context")
    ctx_rec = raw if isinstance(raw, dict) else {}
    factor, rope = ctx_rec.get("factor"), ctx_rec.get("rope_scaling")
    scale = (float(factor) if isinstance(factor, (int, float)) and not isinstance(factor, bool)
             else None)
    seq = rec.exact_up_to
    length = ctx_rec.get("serving_length")
    if seq is None:  # yarn, exact nowhere: seq_length is what the factor scaled
        seq = round(length / scale) if isinstance(length, int) and scale else 0
    ctx = ContextPlan(seq, scale, rope if isinstance(rope, str) else None)
    raw = rec.extra.get("options")
    dtype = raw.get("dtype") if isinstance(raw, dict) else None
    gptq = QUANTIZE_CONFIG in rec.outputs
    files = sorted([(n, r.size) for n, r in rec.outputs.items()]
                   + [(PROVENANCE, (out / PROVENANCE).stat().st_size)])
    result = ConvertResult(
        out, files, ctx, dtype if isinstance(dtype, str) else "", gptq, TensorProof(),
        findings=[info(
            "convert.unchanged",
            f"{out} already holds this conversion of {rec.source_path} (same folder, same "
            "options, DIR's and OUT's files as provenance.json records them): nothing was "
            "written",
        )],
        unchanged=True,
    )
    serving = _optional("serving")
    if serving is not None:
        result.serving = list(serving.commands(  # type: ignore[attr-defined]
            out, gptq=gptq, max_len=ctx.serving_length
        ))
    return result


def _extra(ctx: ContextPlan, options: ConvertOptions, dtype: str) -> JSONObject:
    out: JSONObject = dict(_versions())
    out["created"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    out["context"] = {
        "factor": ctx.factor, "rope_scaling": ctx.rope_scaling,
        "max_position_embeddings": ctx.max_positions, "serving_length": ctx.serving_length,
    }
    out["options"] = {
        "max_shard_size": options.max_shard_size, "verify": options.verify,
        "command": options.command, "dtype": dtype,
    }
    return out


def _dumps(data: JSONObject) -> str:
    import json

    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def summary(result: ConvertResult) -> Sequence[str]:
    """The text a person reads at the end: what was written, what is exact, how to serve."""
    total = sum(s for _n, s in result.files)
    lines = [
        f"{'kept' if result.unchanged else 'wrote'} {result.out} ({len(result.files)} files, "
        f"{total / 1e6:,.1f} MB): "
        f"Qwen2ForCausalLM, {result.dtype}" + (", GPTQ Int4" if result.gptq else ""),
    ]
    lines += [f"  {n}  {s:,} bytes" for n, s in result.files]
    if not result.unchanged:  # else proven by the run that wrote OUT (the finding says so)
        lines.append(
            f"proven: {result.comparison.tensors} tensors ({result.comparison.bytes:,} "
            "bytes) equal DIR's bit for bit"
        )
    if result.verify is not None:
        lines += list(result.verify.lines)
    lines.append(f"{result.exact_words} (max_position_embeddings {result.ctx.max_positions:,})")
    for f in result.findings:
        lines.append(f"{f.severity.value}: {f.message}")
    # a person reads these: wrapped (the serving lines below are copied whole)
    lines = [w for line in lines for w in textwrap.wrap(line, 100, subsequent_indent="    ")
             or [line]]
    if result.serving:
        lines.append("serve it with:")
        lines += [f"  {engine}: {command}" for engine, command in result.serving]
        note = getattr(_optional("serving"), "sampling_note", lambda _out: None)(result.out)
        lines += [f"  {note}"] if note else []
        kv: list[str] = getattr(_optional("serving"), "kv_notes", lambda _out: [])(result.out)
        lines += [f"  {n}" for n in kv]
    return lines


__all__ = ["ConvertOptions", "ConvertResult", "convert", "summary"]
