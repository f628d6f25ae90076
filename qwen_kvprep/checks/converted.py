"""The check of a folder `qwen-kvprep convert` wrote (it holds provenance.json): whether it
still matches the checkpoint it was made from, and is still what convert wrote."""

from __future__ import annotations

import shlex

from qwen_kvprep.checks.registry import CONVERTED, check, converted_of
from qwen_kvprep.checks.verdicts import fail, ok, warn
from qwen_kvprep.findings import FindingsLike
from qwen_kvprep.probe.converted import FileState
from qwen_kvprep.probe.facts import Facts
from qwen_kvprep.provenance import Provenance

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
    how = sorted({s.how for s in (*cv.sources, *cv.outputs)})
    return ok(
        f"{words}: it still matches the source ({len(cv.sources)} files) and is as convert "
        f"wrote it ({len(cv.outputs)} files), judged by {' and '.join(how)}; {exact}{extra}",
        paths=[cv.path],
    )
