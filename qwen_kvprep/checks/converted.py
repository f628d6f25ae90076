"""The check of a folder `qwen-kvprep convert` wrote (it holds provenance.json): whether it
still matches the checkpoint it was made from, and is still what convert wrote."""

from __future__ import annotations

import shlex

from qwen_kvprep.checks.registry import CONVERTED, check, converted_of
from qwen_kvprep.checks.verdicts import fail, info, ok, warn
from qwen_kvprep.findings import FindingsLike
from qwen_kvprep.probe.converted import HASH_LIMIT, QUICK, FileState
from qwen_kvprep.probe.facts import Facts
from qwen_kvprep.provenance import PROVENANCE, Provenance

# a change to one of these changes the model; the others (configs, tokenizer) may be edits
_WEIGHTS = (".safetensors", ".bin")


def _names(states: list[FileState]) -> str:
    shown = ", ".join(s.name for s in states[:3])
    return shown + (f" and {len(states) - 3} more" if len(states) > 3 else "")


def _kv_words(rec: Provenance) -> str:
    """"; fp8 KV cache scales calibrated on ..." where convert --kv-cache wrote them."""
    kv = rec.extra.get("kv_cache")
    cal = kv.get("calibration") if isinstance(kv, dict) else None
    if not isinstance(kv, dict) or not isinstance(cal, dict):
        return ""
    sha = cal.get("sha256")
    return (f"; fp8 KV cache scales calibrated on {cal.get('tokens')} tokens of "
            f"{cal.get('text')} (sha256 {str(sha)[:12]}), in {kv.get('scales_file')}")


@check(
    "convert.provenance",
    "A folder convert wrote still matches its source checkpoint",
    needs=(CONVERTED,),
)
def provenance(facts: Facts) -> FindingsLike:
    cv = converted_of(facts)
    out = shlex.quote(str(cv.path))
    if cv.foreign is not None:
        return info(
            f"{cv.path / PROVENANCE} is not a record qwen-kvprep convert wrote ({cv.foreign}): "
            "it is ignored, and the folder is judged as any other",
            paths=[cv.path],
        )
    if cv.provenance is None:
        return fail(
            f"{cv.error}",
            "convert the source checkpoint again into a new folder: "
            "`qwen-kvprep convert DIR NEW_OUT`",
            paths=[cv.path],
        )
    rec = cv.provenance
    src = shlex.quote(rec.source_path)
    again = f"qwen-kvprep convert {src} NEW_OUT  (then serve NEW_OUT instead of {out})"
    bad_out = [s for s in cv.outputs if s.state != "same"]
    if bad_out:
        return fail(
            f"{_names(bad_out)} in {cv.path} "
            + ("is" if len(bad_out) == 1 else "are")
            + f" no longer what convert wrote ({', '.join(sorted({s.state for s in bad_out}))}):"
            " the folder may not be the proven conversion any more",
            again, paths=[cv.path], files={s.name: s.state for s in bad_out},
        )
    words = f"written by qwen-kvprep convert {rec.tool_version} from {rec.source_path}"
    exact = rec.exact_words + _kv_words(rec)
    if not cv.source_exists:
        return warn(
            f"{words}; the source is no longer there, so whether it still matches cannot be "
            f"told (OUT's own files are as convert wrote them; {exact})",
            paths=[cv.path],
        )
    changed = [s for s in cv.sources if s.state != "same"]
    weights = [s for s in changed if s.name.endswith(_WEIGHTS)]
    if weights:
        return fail(
            f"{words}, but the source's weights changed since ({_names(weights)}): OUT is no "
            "longer that checkpoint's conversion",
            again, paths=[cv.path, rec.source_path], files={s.name: s.state for s in changed},
        )
    if changed:
        return warn(
            f"{words}; the source's weights are unchanged, but {_names(changed)} changed "
            f"since ({exact})",
            f"if the change matters to OUT (a new tokenizer or generation config), {again}",
            paths=[cv.path, rec.source_path], files={s.name: s.state for s in changed},
        )
    extra = f"; files convert did not write: {', '.join(cv.unrecorded)}" if cv.unrecorded else ""
    return ok(
        f"{words}: it still matches the source ({len(cv.sources)} files) and is as convert "
        f"wrote it ({len(cv.outputs)} files), {judged_by([*cv.sources, *cv.outputs], out)}; "
        f"{exact}{extra}",
        paths=[cv.path],
    )


def judged_by(states: list[FileState], out: str) -> str:
    """How the files were judged, in words: a file over HASH_LIMIT whose size and time
    match the record is not read, so a change that kept both is not seen; the smoke
    hashes every file before it starts."""
    quick = sum(1 for s in states if s.how == QUICK)
    if not quick:
        return f"each judged by its sha256 ({len(states)} files)"
    return (
        f"judged by sha256 ({len(states) - quick} files) and by size and modification time "
        f"only ({quick} files over {HASH_LIMIT >> 20} MiB, not read: a change that kept both "
        f"is not seen here; `qwen-kvprep smoke {out}` hashes every file before it starts)"
    )
