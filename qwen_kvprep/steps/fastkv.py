"""Step of `fix`: the model's code. Writes qwen_kvprep_compat.py beside modeling_qwen.py
and adds the lines that import it (compat.py), so that Qwen's code runs on the installed
transformers and on every other supported release; then the Int8 cache's fast path:
plants qwen_kvprep_kv.py beside the loader and appends the block that imports it
(fastkv.py), for the revisions of modeling_qwen.py it was written for; any other revision
keeps the model's own attention, with a finding that says why. With `--no-fast-path` the
fast path's block is taken out again. Everything goes through the journal.

Our lines are told from the user's by their marker lines alone: a file whose markers were
edited (a start marker without its end...) is refused before fix writes anything
(`check_markers`), since taking the block out would take the user's lines with it."""

from __future__ import annotations

import shlex
from pathlib import Path

from qwen_kvprep import compat, fastkv, hubcli
from qwen_kvprep.common import COMPAT_FILE, FAST_FILE, MODELING_FILE
from qwen_kvprep.errors import CheckpointError
from qwen_kvprep.findings import info, ok, warn
from qwen_kvprep.steps.context import FixContext
from qwen_kvprep.untrusted import read_regular

MODEL_CODE_LIMIT = 4 << 20  # modeling_qwen.py is about 60 KB


def check_markers(directory: Path) -> None:
    """Refuse (CheckpointError naming the file and the line) a modeling_qwen.py that is not
    UTF-8 (transformers reads the model code as UTF-8 and fails on it, after fix would
    have changed config.json and the loader) or whose qwen-kvprep marker lines were edited;
    one that cannot be read is the step's to report."""
    path = Path(directory) / MODELING_FILE
    try:
        raw = read_regular(path, MODEL_CODE_LIMIT)
    except OSError:
        return
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise not_utf8(path, raw, exc) from None
    problem = compat.marker_problem(text)
    if problem is not None:
        raise _refusal(path, problem)


def not_utf8(path: Path, raw: bytes, exc: UnicodeDecodeError) -> CheckpointError:
    line = raw.count(b"\n", 0, exc.start) + 1
    return CheckpointError.failing(
        "fastkv.model_code",
        f"{path} is not UTF-8 (byte 0x{raw[exc.start]:02x} at line {line}): transformers "
        "cannot load the model's code, so fix changes nothing",
        f"restore {MODELING_FILE} as the model's repository has it (it is UTF-8), then run "
        "fix again",
        [path],
    )


def _refusal(path: Path, problem: str) -> CheckpointError:
    return CheckpointError.failing(
        "fastkv.model_code",
        f"{path}, {problem}: fix would not know which lines are yours, so it changes nothing",
        "put the lines between the `# >>> qwen-kvprep` and `# <<< qwen-kvprep` markers back as "
        "fix wrote them, or delete them with both markers (keeping your own lines), then run "
        "fix again",
        [path],
    )


def _compat(ctx: FixContext, text: str) -> str:
    """modeling_qwen.py with the compatibility lines (and no fast-path block), once the
    module is written; the text without them when the file defines none of Qwen's models."""
    base = compat.without_ours(text)
    path = ctx.directory / MODELING_FILE
    reason = compat.recognise(base)
    if reason is not None:
        ctx.add(
            warn(
                "compat.model_code",
                f"{MODELING_FILE} is left without qwen-kvprep's compatibility module: {reason}",
                paths=[path],
            )
        )
        ctx.extra["compat"] = False
        return base
    written = ctx.journal.write(COMPAT_FILE, compat.compat_bytes())
    result = compat.patched(base)
    ctx.extra["compat"] = True
    if written or result != fastkv.unpatched(text):
        verb = "would add" if ctx.options.dry_run else "added"
        ctx.add(
            info(
                "compat.model_code",
                f"{verb} {COMPAT_FILE}, imported by {MODELING_FILE}: at each load it gives "
                "Qwen's code what the running transformers lacks (before 4.54 nothing but "
                "chat_stream's streaming where transformers_stream_generator cannot be "
                "imported), so the folder serves under every supported release",
                paths=[path, ctx.directory / COMPAT_FILE],
            )
        )
    else:
        ctx.add(ok("compat.model_code", f"{COMPAT_FILE} is in place", paths=[path]))
    return result


def run(ctx: FixContext) -> None:
    path = ctx.directory / MODELING_FILE
    try:
        raw = read_regular(path, MODEL_CODE_LIMIT)
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        message = f"cannot read {path}: {exc}; the fast path is not applied"
        ctx.add(warn("fastkv.model_code", message, paths=[path]))
        ctx.extra["fast_path"] = False
        ctx.extra["compat"] = False
        return
    if text.startswith("\ufeff"):
        # transformers' check of a model file's imports (4.53 and later) parses its text
        # with ast, where a UTF-8 BOM is a SyntaxError: fix writes it without (revert
        # restores it)
        text = text[1:]
        verb = "would remove" if ctx.options.dry_run else "removed"
        ctx.add(info(
            "compat.bom",
            f"{verb} the UTF-8 BOM at the start of {MODELING_FILE}: transformers' check of "
            "the model's imports (4.53 and later) fails on it with `SyntaxError: invalid "
            "non-printable character U+FEFF`",
            paths=[path],
        ))
    problem = compat.marker_problem(text)
    if problem is not None:  # checked before the first write; changed since
        raise _refusal(path, problem)
    base = _compat(ctx, text)
    if not ctx.options.fast_path:
        ctx.journal.write(MODELING_FILE, base.encode("utf-8"))
        if fastkv.is_patched(text):
            verb = "would take" if ctx.options.dry_run else "took"
            message = f"{verb} the fast path out of {MODELING_FILE} (--no-fast-path)"
            ctx.add(info("fastkv.model_code", message, paths=[path]))
        ctx.extra["fast_path"] = False
        return
    reason = fastkv.recognise(text)
    if reason is not None:
        ctx.add(
            warn(
                "fastkv.model_code",
                f"{MODELING_FILE} is left as it is: {reason}; the Int8 cache runs the model's "
                "own code (slower: it copies the whole cache at every step)",
                fix="download the final revision of the model's code "
                f"({hubcli.download()} REPO {MODELING_FILE} --local-dir "
                f"{shlex.quote(str(ctx.directory))}, REPO being the model's Qwen repo, e.g. "
                "Qwen/Qwen-7B-Chat), then run fix again; or keep this code: the Int8 "
                "cache then runs it as it is, without the fast path",
                paths=[path],
            )
        )
        ctx.journal.write(MODELING_FILE, base.encode("utf-8"))
        ctx.extra["fast_path"] = False
        return
    planted = ctx.journal.write(FAST_FILE, fastkv.module_bytes(ctx.options.per_token_prefill))
    changed = ctx.journal.write(MODELING_FILE, fastkv.patched(base).encode("utf-8"))
    ctx.extra["fast_path"] = True
    if planted or changed:
        verb = "would install" if ctx.options.dry_run else "installed"
        ctx.add(
            info(
                "fastkv.model_code",
                f"{verb} the Int8 cache's fast path: {FAST_FILE}, imported by a block at the "
                f"end of {MODELING_FILE} (the original is kept for revert; --no-fast-path "
                "turns it off)",
                paths=[path, ctx.directory / FAST_FILE],
            )
        )
    else:
        ctx.add(ok("fastkv.model_code", "the Int8 cache's fast path is installed", paths=[path]))
