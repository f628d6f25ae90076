"""Checks of the checkpoint directory itself: files, their content, weights, tokenizer.

Every failing finding names the bad file(s) and the command that re-fetches exactly
those files. `fix` runs every `checkpoint.*` check first and refuses on any `fail`.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import Optional, Union

from qwen_kvprep import hubcli
from qwen_kvprep.checks.identity import Kind, identify
from qwen_kvprep.checks.registry import CHECKPOINT, LISTED, QWEN_V1, check, checkpoint_of
from qwen_kvprep.checks.verdicts import fail, info, ok, skip, warn
from qwen_kvprep.common import (
    COMPAT_FILE,
    FAST_FILE,
    KERNEL_FILES,
    spelling_problem,
)
from qwen_kvprep.common import LOADER_FILE as LOADER
from qwen_kvprep.configjson import CONFIG
from qwen_kvprep.findings import Finding
from qwen_kvprep.probe.checkpoint import (
    BIN_INDEX,
    BIN_SINGLE,
    GENERATION_CONFIG,
    MODELING,
    REMOTE_CODE_FILES,
    ST_INDEX,
    ST_SINGLE,
    ST_TOO_LARGE,
    ST_TOO_SMALL,
    TIKTOKEN,
    TOKENIZER_FILES,
    CheckpointFacts,
    ContentProblem,
)
from qwen_kvprep.probe.env import version_tuple
from qwen_kvprep.probe.facts import Facts
from qwen_kvprep.provenance import PROVENANCE

# Used in fix commands when the checkpoint's repo is unknown; the fix says to replace it.
PLACEHOLDER_REPO = "Qwen/Qwen-7B-Chat"
_QWEN_V1_REPO_NAME = re.compile(r"^Qwen-(1_8B|7B|14B|72B)(-Chat)?(-Int4|-Int8)?$")

# What the user sees when a required file is missing (transformers 4.3x, local directory).
_MISSING_SYMPTOM = {
    CONFIG: "`OSError: ... does not appear to have a file named config.json`",
    "configuration_qwen.py": "`OSError: ... does not appear to have a file named "
    "configuration_qwen.py`",
    "modeling_qwen.py": "`OSError: ... does not appear to have a file named modeling_qwen.py`",
    "tokenization_qwen.py": "`OSError: ... does not appear to have a file named "
    "tokenization_qwen.py`",
    "qwen_generation_utils.py": "`FileNotFoundError: ... qwen_generation_utils.py` while "
    "transformers copies the remote code",
    TIKTOKEN: "the tokenizer failing to load its BPE ranks",
    "tokenizer_config.json": "`ValueError: Tokenizer class QWenTokenizer does not exist or is "
    "not currently imported.`",
}


# -- fix commands -----------------------------------------------------------------------------


def origin(cp: CheckpointFacts) -> tuple[str, Optional[str]]:
    """(repo id for fix commands, note to print with it when it is a guess or a placeholder)."""
    if cp.repo_id:
        return cp.repo_id, None
    if _QWEN_V1_REPO_NAME.match(cp.name):
        return f"Qwen/{cp.name}", "repo assumed from the directory name"
    return PLACEHOLDER_REPO, f"replace {PLACEHOLDER_REPO} with the repo this checkpoint came from"


def redownload(cp: CheckpointFacts, files: Optional[Sequence[str]] = None) -> str:
    """The `hf download` (`huggingface-cli download` before huggingface_hub 0.34) command
    that re-fetches exactly `files` (None: the whole repo).

    --force-download because huggingface_hub otherwise trusts a file that is already there
    (a truncated shard in a hub snapshot, or one whose local-dir metadata looks current).
    """
    repo, note = origin(cp)
    names = "".join(f" {shlex.quote(f)}" for f in files or ())
    force = " --force-download" if files else ""
    if cp.repo_id and cp.revision and cp.hub_cache_dir is not None:
        cmd = (
            f"{hubcli.download()} {repo}{names} --revision {shlex.quote(cp.revision)} "
            f"--cache-dir {shlex.quote(str(cp.hub_cache_dir))}{force}"
        )
    else:
        cmd = f"{hubcli.download()} {repo}{names} --local-dir {shlex.quote(str(cp.path))}{force}"
    return f"{cmd}  ({note})" if note else cmd


def python_redownload(cp: CheckpointFacts, files: Sequence[str]) -> str:
    """The same re-fetch as huggingface_hub calls, for environments without the `hf` CLI."""
    repo, _ = origin(cp)
    if cp.repo_id and cp.revision and cp.hub_cache_dir is not None:
        where = f"revision={cp.revision!r}, cache_dir={str(cp.hub_cache_dir)!r}"
    else:
        where = f"local_dir={str(cp.path)!r}"
    return "; ".join(
        f"huggingface_hub.hf_hub_download({repo!r}, {f!r}, {where}, force_download=True)"
        for f in files
    )


def lfs_pull(cp: CheckpointFacts, files: Sequence[str]) -> str:
    """The command that replaces Git LFS pointers by the real files: `git lfs pull` in the
    work tree the folder is in (paths relative to its top, as --include takes them), else
    the same in the clone the folder was copied from."""
    if cp.git_root is not None:
        rel = [Path(os.path.relpath(cp.path.absolute() / f, cp.git_root)).as_posix()
               for f in files]
        include = shlex.quote(",".join(rel))
        return (f"git -C {shlex.quote(str(cp.git_root))} lfs pull --include={include} "
                "(needs git-lfs: `git lfs install` once)")
    include = shlex.quote(",".join(files))
    return (f"in the git clone this folder was copied from, `git lfs pull --include={include}` "
            "(needs git-lfs: `git lfs install` once), then copy the files again")


def refetch(cp: CheckpointFacts, files: Sequence[str], lfs: bool = False) -> str:
    """Fix text for bad files: `git lfs pull` for LFS pointers in a git work tree; the
    download for anything else; for pointers outside a work tree, both."""
    if not lfs:
        return redownload(cp, files)
    if cp.git_root is not None:
        return lfs_pull(cp, files)
    return f"{lfs_pull(cp, files)}; or re-download them: {redownload(cp, files)}"


def _plural(names: Sequence[str], one: str, many: str) -> str:
    return f"{', '.join(names)} {one if len(names) == 1 else many}"


CheckResult = Union[Finding, list[Finding]]


# -- checks -------------------------------------------------------------------------------------


# -- what the folder is ----------------------------------------------------------------------

# For a model qwen-kvprep does not prepare: what shrinks its KV cache instead.
KV_ELSEWHERE = (
    "the serving engine's own KV-cache quantization (vLLM: `--kv-cache-dtype fp8`), or "
    "transformers' QuantizedCache (`model.generate(..., cache_implementation=\"quantized\", "
    "cache_config={\"backend\": \"quanto\", \"nbits\": 4})`)"
)
_QWEN_V1_MODELS = (
    f"{PLACEHOLDER_REPO}, Qwen/Qwen-1_8B-Chat, Qwen/Qwen-14B-Chat, Qwen/Qwen-72B-Chat or their "
    "-Int4 variants"
)


def _snapshot_words(cp: CheckpointFacts) -> str:
    return (
        f"; a Hub cache snapshot of {cp.repo_id} at {cp.revision}: fix replaces each file it "
        "changes by a regular file and never writes through the links into the blobs the "
        "cache's revisions share" if cp.repo_id else ""
    )


@check("checkpoint.identity", "The folder is a Qwen (v1) checkpoint", needs=(CHECKPOINT,))
def identity(facts: Facts) -> CheckResult:
    cp = checkpoint_of(facts)
    found = identify(cp)
    here = shlex.quote(str(cp.path))
    kind = found.kind
    if kind is Kind.UNREADABLE:
        return skip("the folder cannot be listed (see checkpoint.files)")
    if kind is Kind.QWEN_V1:
        return ok(
            f"a Qwen (v1) checkpoint{_snapshot_words(cp)}", paths=[cp.path], kind=kind.value
        )
    if kind is Kind.QWEN_V1_GPTQ:
        return ok(
            f"a Qwen (v1) Int4 GPTQ checkpoint{_snapshot_words(cp)}",
            paths=[cp.path], kind=kind.value,
        )
    if kind is Kind.HUB_REPO:
        return _hub_repo(cp)
    if kind is Kind.EMPTY:
        return fail(
            f"{cp.path} is empty: there is no checkpoint here yet",
            f"download the whole model into it: {hubcli.download()} {PLACEHOLDER_REPO} "
            f"--local-dir {here}  (or another Qwen (v1) model: {_QWEN_V1_MODELS}), "
            f"then `qwen-kvprep fix {here}`",
            paths=[cp.path], kind=kind.value,
        )
    if kind is Kind.CONFIG_UNREADABLE:
        return info(
            f"{CONFIG} does not parse (see config.parse) and the folder holds none of Qwen's "
            "files, so what model it is cannot be told until it does",
            paths=[cp.path / CONFIG], kind=kind.value,
        )
    if kind is Kind.UNKNOWN:
        return fail(
            f"{cp.path} holds no {CONFIG} and none of Qwen's files "
            f"({MODELING}, {TIKTOKEN}): it is not a model checkpoint folder",
            "give the folder that holds the checkpoint's config.json, or download a Qwen (v1) "
            f"model into an empty folder: {hubcli.download()} {PLACEHOLDER_REPO} --local-dir DIR",
            paths=[cp.path], kind=kind.value,
        )
    shown = f'model_type "{found.model_type}"' if found.model_type else "no model_type"
    if found.converted:
        return info(
            "a Qwen2 checkpoint that `qwen-kvprep convert` wrote from a Qwen (v1) one: it runs "
            "on transformers' own Qwen2 code and the serving engines, with no remote code and "
            "nothing for fix to do (convert.provenance says whether it still matches its "
            "source)",
            paths=[cp.path], kind="converted", model_type=found.model_type,
        )
    if kind is Kind.QWEN2:
        foreign = (f" (its {PROVENANCE} is another tool's, not a record qwen-kvprep convert "
                   "wrote: it is ignored)") if PROVENANCE in cp.files else ""
        return fail(
            f"{CONFIG} has {shown}: a Qwen1.5/Qwen2/Qwen2.5 checkpoint{foreign}, which runs on "
            "transformers' own Qwen2 code. That code has no Int8 KV cache (no "
            "use_cache_quantization, no kernel), and qwen-kvprep prepares only Qwen (v1) "
            "checkpoints (model_type \"qwen\"): nothing here applies to this folder",
            f"leave the folder as it is; for a smaller KV cache use {KV_ELSEWHERE}",
            paths=[cp.path / CONFIG], kind=kind.value, model_type=found.model_type,
        )
    return fail(
        f"{CONFIG} has {shown}: not a Qwen (v1) checkpoint, the only kind qwen-kvprep "
        "prepares (model_type \"qwen\", with Qwen's remote code and its Int8 KV cache)",
        f"leave the folder as it is; for a smaller KV cache use {KV_ELSEWHERE}. For a Qwen "
        f"(v1) model give its folder, or its repo id: {_QWEN_V1_MODELS}",
        paths=[cp.path / CONFIG], kind=kind.value, model_type=found.model_type,
    )


def _hub_repo(cp: CheckpointFacts) -> Finding:
    """A huggingface_hub cache repo folder: the checkpoint is one of its snapshots."""
    repo = cp.cache_repo or PLACEHOLDER_REPO
    snaps = [cp.path / "snapshots" / s for s in cp.cache_snapshots]
    message = (
        f"{cp.path} is the Hugging Face cache folder of {repo} (blobs/, refs/, snapshots/), "
        "not a checkpoint: each snapshot in it is one"
    )
    refs = dict(cp.cache_refs)
    if not snaps:
        return fail(
            message + ", and it holds none",
            f"download it: {hubcli.download()} {repo}, then `qwen-kvprep fix {repo}`",
            paths=[cp.path], kind=Kind.HUB_REPO.value, repo_id=repo,
        )
    named = ", ".join(f"{ref} -> {commit[:12]}" for ref, commit in sorted(refs.items()))
    if len(snaps) == 1:
        fix = f"qwen-kvprep fix {shlex.quote(str(snaps[0]))}"
    else:
        fix = (
            f"give one snapshot folder: {', '.join(shlex.quote(str(s)) for s in snaps)}; or the "
            f"repo id with its revision: `qwen-kvprep fix {repo} --revision REV`"
        )
    return fail(
        message + (f" (refs: {named}, and no main among them)" if "main" not in refs else ""),
        fix, paths=[cp.path], kind=Kind.HUB_REPO.value, repo_id=repo,
        snapshots=[str(s) for s in snaps],
    )


@check("checkpoint.files", "Required files are present", needs=(CHECKPOINT, QWEN_V1))
def files(facts: Facts) -> CheckResult:
    cp = checkpoint_of(facts)
    if cp.listing_error is not None:
        return fail(
            f"{cp.path} cannot be listed: {cp.listing_error}",
            "check the path and that this user may read it", paths=[cp.path],
        )
    out: list[Finding] = []
    present = set(cp.files)
    special = dict(cp.special)
    required = [CONFIG, *(f for f in REMOTE_CODE_FILES if f != LOADER), *TOKENIZER_FILES]
    if special:
        # a FIFO, socket or device under a file's name: never opened (a FIFO blocks a read)
        read = {*required, LOADER, *KERNEL_FILES, *cp.weight_files}
        for name, what in sorted(special.items()):
            make = fail if name in read else warn
            out.append(make(
                f"{name} is {what}, not a regular file: qwen-kvprep does not open it, and "
                "loading the model would fail or wait on it forever",
                f"replace it with the real file: `rm {shlex.quote(str(cp.path / name))}`, then "
                + redownload(cp, [name]),
                paths=[cp.path / name], what=what,
            ))
    missing = [
        f for f in required if f not in present and f not in cp.dangling and f not in special
    ]
    if missing:
        out.append(fail(
            f"{_plural(missing, 'is', 'are')} missing, so loading fails with "
            f"{_MISSING_SYMPTOM[missing[0]]}",
            redownload(cp, missing), paths=[cp.path / f for f in missing],
            python=python_redownload(cp, missing),
        ))
    if cp.dangling:
        out.append(fail(
            f"{_plural(list(cp.dangling), 'is a symlink', 'are symlinks')} to a blob that is "
            "gone (an interrupted or pruned hub download), so loading fails with "
            "`FileNotFoundError`",
            redownload(cp, list(cp.dangling)), paths=[cp.path / f for f in cp.dangling],
        ))
    if LOADER not in present and LOADER not in cp.dangling and LOADER not in special:
        # The relative import in modeling_qwen.py makes transformers copy it even when the
        # KV flags are off; `fix` installs qwen-kvprep's loader under this name anyway.
        out.append(warn(
            f"{LOADER} is missing, so loading fails with `FileNotFoundError: ... {LOADER}` "
            "until `qwen-kvprep fix` installs its loader there",
            cp.fix_command, paths=[cp.path / LOADER],
        ))
    out.extend(_weights_findings(cp))
    if GENERATION_CONFIG not in present and GENERATION_CONFIG not in cp.dangling:
        out.append(warn(
            f"{GENERATION_CONFIG} is missing, so model.chat() has no chat_format or stop "
            "tokens and fails or rambles",
            redownload(cp, [GENERATION_CONFIG]), paths=[cp.path / GENERATION_CONFIG],
        ))
    if not any(f.severity.value in ("fail", "warn") for f in out):
        out.insert(0, ok(f"all required files are present (weights: {_layout_words(cp)})"))
    return out


def _layout_words(cp: CheckpointFacts) -> str:
    n = len(cp.weight_files)
    return {
        "safetensors-sharded": f"{n} safetensors shard{'s' if n != 1 else ''}",
        "safetensors-single": "one model.safetensors",
        "pytorch-bin": f"{n} pytorch_model .bin file{'s' if n != 1 else ''}",
    }.get(cp.weights_layout, "none")


def _weights_findings(cp: CheckpointFacts) -> list[Finding]:
    layout = cp.weights_layout
    present = set(cp.files)
    if layout == "none":
        return [fail(
            f"no weights ({ST_SINGLE}, {ST_INDEX} with its shards, or {BIN_SINGLE}), so "
            "loading fails with `OSError: Error no file named pytorch_model.bin, "
            "model.safetensors, tf_model.h5, ...`",
            redownload(cp), paths=[cp.path],
        )]
    if layout == "safetensors-sharded" and cp.index is None:
        return [fail(
            f"{len(cp.weight_files)} safetensors shard(s) but no {ST_INDEX}, so transformers "
            "cannot find them (`OSError: Error no file named pytorch_model.bin, ...`)",
            redownload(cp, [ST_INDEX]), paths=[cp.path / ST_INDEX],
        )]
    if layout == "pytorch-bin" and BIN_SINGLE in present and cp.index is None:
        return [info(
            f"weights are a single {BIN_SINGLE}: the August-2023 layout of the first "
            "Qwen-7B-Chat release, whose remote code has no Int8 KV cache",
            f"for the KV cache, download the current revision: {redownload(cp)}",
            paths=[cp.path / BIN_SINGLE],
        )]
    if layout == "pytorch-bin" and BIN_INDEX in present:
        return [info(
            f"weights are pickled .bin shards listed in {BIN_INDEX} (re-saved with "
            "safe_serialization=False); they load, but are not validated here",
            paths=[cp.path / BIN_INDEX],
        )]
    return []


@check(
    "checkpoint.remote_code",
    "The remote code supports the Int8 KV cache",
    needs=(CHECKPOINT, LISTED, QWEN_V1),
)
def remote_code(facts: Facts) -> CheckResult:
    cp = checkpoint_of(facts)
    if cp.modeling_text_supports_kv is None:
        return skip(f"{MODELING} is missing or damaged (see checkpoint.files / .content)")
    py = [f for f in REMOTE_CODE_FILES if f != LOADER]
    whole = cp.weights_layout == "pytorch-bin" and BIN_SINGLE in cp.files
    # The August-2023 weights and config come with their own schema: update everything.
    update = redownload(cp) if whole else redownload(cp, py)
    if cp.modeling_not_utf8 is not None:
        return fail(
            f"{MODELING} is not UTF-8 ({cp.modeling_not_utf8}): transformers reads the model's "
            "code as UTF-8 and cannot load it (and fix refuses it, changing nothing)",
            f"restore {MODELING} as the model's repository has it (it is UTF-8): "
            f"{redownload(cp, [MODELING])}",
            paths=[cp.path / MODELING],
        )
    if not cp.modeling_text_supports_kv:
        return fail(
            f"{MODELING} predates the Int8 KV cache (it never mentions use_cache_quantization), "
            "so the flags in config.json are silently ignored and the cache stays full size",
            f"update the remote code: {update}", paths=[cp.path / MODELING],
        )
    if not cp.modeling_mentions_kernel:
        return warn(
            f"{MODELING} quantizes the KV cache but never loads the cache_autogptq_cuda_256 "
            "kernel, so attention always runs the slow pure-torch dequantize path",
            f"update the remote code: {update}", paths=[cp.path / MODELING],
        )
    return ok(f"{MODELING} supports the Int8 KV cache and its kernel")


def _imported_module_problem(
    cp: CheckpointFacts, name: str, what: str, sha256: Optional[str], current: bool,
    if_missing: str,
) -> Optional[Finding]:
    """A module of ours that modeling_qwen.py imports: missing (a failure, with what the
    model then does) or not the one this qwen-kvprep writes (a warning); None when it is."""
    path, fix = cp.path, cp.fix_command
    if sha256 is None:
        return fail(
            f"{MODELING} imports qwen-kvprep's {what} but {name} is missing: {if_missing}",
            f"run `{fix}` (or `qwen-kvprep revert {shlex.quote(str(path))}` to take the "
            "import out)",
            paths=[path / name],
        )
    if not current:
        return warn(
            f"{name} is not the one this qwen-kvprep writes (another version, or changed "
            "by hand)",
            f"run `{fix}` to write the current one", paths=[path / name],
        )
    return None


# The first release Qwen's code as shipped does not run on (generate gets a Cache object).
NEEDS_COMPAT_FROM = (4, 54)


@check(
    "checkpoint.compat",
    "Qwen's code runs on this transformers (qwen_kvprep_compat.py where it is needed)",
    needs=(CHECKPOINT, LISTED, QWEN_V1),
)
def compat_module(facts: Facts) -> CheckResult:
    cp = checkpoint_of(facts)
    if cp.modeling_text_supports_kv is None:
        return skip(f"{MODELING} is missing or damaged (see checkpoint.files / .content)")
    fix = cp.fix_command
    release = facts.env.transformers_version if facts.env is not None else None
    if cp.compat_imported:
        problem = _imported_module_problem(
            cp, COMPAT_FILE, "compatibility module", cp.compat_module_sha256,
            cp.compat_module_current, "transformers refuses to load the model",
        )
        if problem is not None:
            return problem
        return ok(
            f"{MODELING} imports qwen-kvprep's compatibility module: Qwen's code runs on "
            f"transformers {release or 'of any supported release'} with the checkpoint's own "
            "numbers"
        )
    version = version_tuple(release)
    if version is not None and version[:2] >= NEEDS_COMPAT_FROM:
        return fail(
            f"Qwen's {MODELING} as shipped does not run on transformers {release} (from 4.54 "
            "generate fails, from 4.57 the load fails, and from 5.0 the model loads other "
            "weights than the checkpoint's); the folder lacks qwen-kvprep's compatibility "
            "module",
            f"run `{fix}`",
            paths=[cp.path / MODELING],
        )
    spared = [
        m for m in cp.missing_requirements
        if m not in cp.fixed_missing and m not in cp.fixed_requirements
    ]
    if spared:
        names = ", ".join(spared)
        return fail(
            f"transformers refuses to load Qwen's {MODELING} as shipped: it imports {names} "
            f"(in chat_stream), which cannot be imported here; the folder lacks qwen-kvprep's "
            f"compatibility module, with which the model loads without it (chat_stream then "
            "streams through transformers' own streamer)",
            f"run `{fix}`",
            paths=[cp.path / MODELING],
            missing=spared,
        )
    if release is None:
        return info(
            f"Qwen's code as shipped runs on transformers 4.32 to 4.53 only; `{fix}` adds "
            "the compatibility module later releases need",
            paths=[cp.path / MODELING],
        )
    return info(
        f"Qwen's code runs as shipped on transformers {release}; `{fix}` adds the "
        "compatibility module that 4.54 and later need",
        paths=[cp.path / MODELING],
    )


@check(
    "checkpoint.fast_path",
    "The Int8 cache runs qwen-kvprep's fast path (no per-step copy of the cache)",
    needs=(CHECKPOINT, LISTED, QWEN_V1),
)
def fast_path(facts: Facts) -> CheckResult:
    cp = checkpoint_of(facts)
    if cp.modeling_text_supports_kv is None:
        return skip(f"{MODELING} is missing or damaged (see checkpoint.files / .content)")
    fix = cp.fix_command
    if cp.fast_path_imported:
        problem = _imported_module_problem(
            cp, FAST_FILE, "fast path", cp.fast_module_sha256, cp.fast_module_current,
            "the model warns and runs its own, slower code",
        )
        if problem is not None:
            return problem
        if cp.fast_path_problem is not None:
            # changed after fix installed it, or installed by a qwen-kvprep that did not
            # compare the code: the fast path runs in place of code it does not reproduce
            return warn(
                f"{MODELING} imports qwen-kvprep's fast path, which stands in for attention "
                "code it does not reproduce (the Int8 cache may give other tokens than this "
                f"code would): {cp.fast_path_problem}",
                f"run `{fix}`: it takes the fast path out of code it does not reproduce",
                paths=[cp.path / MODELING],
            )
        return ok(
            f"{MODELING} imports qwen-kvprep's fast path: with qwen-kvprep's kernels the "
            "quantized cache grows in place, with one fused quantize-and-append per step"
        )
    if cp.fast_path_problem is not None:
        return info(
            f"the Int8 cache runs the model's own code, which copies the whole cache at every "
            f"step: fix leaves this {MODELING} alone ({cp.fast_path_problem})",
            paths=[cp.path / MODELING],
        )
    return info(
        f"the Int8 cache runs the model's own code, which copies the whole cache at every "
        f"step; `{fix}` installs the fast path (or leaves it out with --no-fast-path)",
        paths=[cp.path / MODELING],
    )


# (plural wording, likely cause or None) per kind of content problem.
_CONTENT_WORDS: dict[str, tuple[str, Optional[str]]] = {
    "lfs-pointer": ("Git LFS pointers", "the repo was probably cloned without git-lfs"),
    "html": ("HTML pages", None),  # the detail already says "a login or error page"
    "empty": ("empty", "an interrupted copy or download"),
    "invalid-json": ("not valid JSON", None),
    "too-large": ("too large", None),
    "unreadable": ("unreadable", None),
}

# What loading then fails with, by file type; "*" covers the kinds not listed.
_CONTENT_SYMPTOM: dict[str, dict[str, str]] = {
    ".safetensors": {
        "empty": ST_TOO_SMALL,
        "*": ST_TOO_LARGE,
    },
    ".bin": {
        "lfs-pointer": "`UnpicklingError: invalid load key, 'v'.`",
        "html": "`UnpicklingError: invalid load key, '<'.`",
        "*": "an error from torch.load",
    },
    ".py": {
        "empty": "`AttributeError` or `ImportError`, as the module defines nothing",
        "*": "`SyntaxError: invalid syntax` when transformers imports it",
    },
    ".json": {"*": "`JSONDecodeError`"},
    ".tiktoken": {"*": "an error while the tokenizer reads its BPE ranks"},
    ".cpp": {"*": "compiler errors when the kernel is built"},
    ".cu": {"*": "compiler errors when the kernel is built"},
}


def _symptom(kind: str, suffix: str) -> str:
    if kind == "unreadable":
        return "`PermissionError` or `OSError`"
    table = _CONTENT_SYMPTOM.get(suffix, {})
    return table.get(kind) or table.get("*") or "an error on the first read of it"


@check(
    "checkpoint.content",
    "No file is an LFS pointer, an HTML page or empty",
    needs=(CHECKPOINT, LISTED, QWEN_V1),
)
def content(facts: Facts) -> CheckResult:
    cp = checkpoint_of(facts)
    if not cp.content_problems:
        return ok("no file is a Git LFS pointer, an HTML page or empty")
    # One finding per kind and file type: 8 LFS-pointer shards are one problem, with one fix.
    groups: dict[tuple[str, str], list[ContentProblem]] = {}
    for p in cp.content_problems:
        groups.setdefault((p.kind, PurePosixPath(p.name).suffix), []).append(p)
    out: list[Finding] = []
    for (kind, suffix), problems in groups.items():
        names = [p.name for p in problems]
        many, cause = _CONTENT_WORDS.get(kind, (kind, None))
        # One file: its own detail ("is a Git LFS pointer of 134 bytes (the real file ...)").
        what = problems[0].detail if len(problems) == 1 else f"are {many}"
        because = f": {cause}, so" if cause else ", so"
        outcome = f"{because} loading fails with {_symptom(kind, suffix)}"
        if kind == "too-large":  # a reader might take it whole; qwen-kvprep judges none
            outcome = ": qwen-kvprep does not read a file that large, so it cannot vouch for it"
        if kind == "unreadable":
            # a permission problem, not a bad download: re-downloading would not help
            quoted = " ".join(shlex.quote(str(cp.path / n)) for n in names)
            fix = (
                f"make {'it' if len(names) == 1 else 'them'} readable for this user "
                f"(`ls -l {quoted}` shows the owner; `chmod a+r {quoted}`), or run as the owner"
            )
        else:
            fix = refetch(cp, names, lfs=kind == "lfs-pointer")
        out.append(fail(
            f"{', '.join(names)} {what}{outcome}",
            fix,
            paths=[cp.path / n for n in names], kind=kind,
            files={p.name: p.detail for p in problems},
        ))
    return out


@check(
    "checkpoint.shards",
    "Every safetensors shard is complete (headers only)",
    needs=(CHECKPOINT, LISTED, QWEN_V1),
)
def shards(facts: Facts) -> CheckResult:
    cp = checkpoint_of(facts)
    if not cp.shards:
        return skip("no safetensors shard to validate")
    bad = [s for s in cp.shards if s.error is not None]
    if not bad:
        tensors = sum(len(s.tensor_names) for s in cp.shards)
        size = sum(s.size or 0 for s in cp.shards)
        return ok(
            f"{len(cp.shards)} safetensors file(s) are complete: {tensors} tensors, "
            f"{size:,} bytes (judged from their headers)",
        )
    return [
        fail(
            f"{s.name} {s.error}", redownload(cp, [s.name]), paths=[cp.path / s.name],
            size=s.size, header_len=s.header_len, truncated=s.truncated,
            python=python_redownload(cp, [s.name]),
        )
        for s in bad
    ]


@check(
    "checkpoint.index",
    "The weight index is safe and matches the shards",
    needs=(CHECKPOINT, LISTED, QWEN_V1),
)
def index(facts: Facts) -> CheckResult:
    cp = checkpoint_of(facts)
    idx = cp.index
    if idx is None:
        return skip("no weight index (single-file or no weights)")
    if cp.problem(idx.name) is not None:
        return skip(f"{idx.name} is damaged (see checkpoint.content)")
    path = cp.path / idx.name
    if idx.error is not None:
        return fail(
            f"{idx.name} {idx.error}, so transformers cannot map tensors to shards",
            redownload(cp, [idx.name]), paths=[path],
        )
    out: list[Finding] = []
    if idx.refused:
        names = [n for n, _ in idx.refused]
        out.append(fail(
            f"{idx.name} names {len(names)} file(s) outside the checkpoint "
            f"({'; '.join(f'{n!r} {why}' for n, why in idx.refused[:3])}), which qwen-kvprep "
            "refuses and never opens",
            "the index is corrupt or hostile; do not load this checkpoint until it is "
            f"re-downloaded: {redownload(cp, [idx.name])}",
            paths=[path], refused=dict(idx.refused),
        ))
    if idx.missing:
        out.append(fail(
            f"{_plural(list(idx.missing), 'is', 'are')} listed in {idx.name} but missing, so "
            f"loading fails with `OSError: ... does not appear to have a file named "
            f"{idx.missing[0]}`",
            redownload(cp, list(idx.missing)), paths=[cp.path / f for f in idx.missing],
            python=python_redownload(cp, list(idx.missing)),
        ))
    compared = False
    if idx.name == ST_INDEX:
        more, compared = _index_vs_shards(cp)
        out.extend(more)
    if not out:
        also = " and consistent with their headers" if compared else ""
        out.append(ok(
            f"{idx.name} maps {len(idx.weight_map)} tensors to {len(idx.files)} file(s), "
            f"all present{also}",
        ))
    return out


def _index_vs_shards(cp: CheckpointFacts) -> tuple[list[Finding], bool]:
    """Compare the index with the shard headers, only when every shard header is sound.

    Returns the findings and whether the comparison was made."""
    idx = cp.index
    assert idx is not None
    shards = {s.name: s for s in cp.shards}
    if idx.missing or any(
        f not in shards or shards[f].error is not None for f in idx.files
    ):
        return [], False  # reported by the missing/shard/content findings; totals would mislead
    out: list[Finding] = []
    misplaced = sorted(t for t, f in idx.weight_map.items() if t not in shards[f].tensor_names)
    if misplaced:
        out.append(fail(
            f"{idx.name} places {len(misplaced)} tensor(s) (e.g. {misplaced[0]}) in shards that do "
            "not hold them, so loading fails with missing weights: index and shards come from "
            "different revisions",
            redownload(cp, [idx.name, *idx.files]), paths=[cp.path / idx.name],
            misplaced=misplaced[:20],
        ))
    total = sum(shards[f].tensor_bytes for f in idx.files)
    if idx.total_size is not None and idx.total_size != total:
        out.append(warn(
            f"{idx.name} says total_size {idx.total_size:,} but the shard headers add up to "
            f"{total:,} bytes of tensors, so index and shards may come from different revisions",
            redownload(cp, [idx.name]), paths=[cp.path / idx.name],
            total_size=idx.total_size, shard_bytes=total,
        ))
    return out, True


@check("checkpoint.tokenizer", "qwen.tiktoken parses", needs=(CHECKPOINT, LISTED, QWEN_V1))
def tokenizer(facts: Facts) -> CheckResult:
    cp = checkpoint_of(facts)
    if TIKTOKEN not in cp.files or cp.problem(TIKTOKEN) is not None:
        return skip(f"{TIKTOKEN} is missing or damaged (see checkpoint.files / .content)")
    if cp.tiktoken_error is not None:
        where = f" line {cp.tiktoken_bad_line}" if cp.tiktoken_bad_line else ""
        return fail(
            f"{TIKTOKEN}{where} {cp.tiktoken_error}, so the tokenizer fails to load (`ValueError`"
            " while reading its BPE ranks)",
            redownload(cp, [TIKTOKEN]), paths=[cp.path / TIKTOKEN], line=cp.tiktoken_bad_line,
        )
    return ok(f"{TIKTOKEN} parses: {cp.tiktoken_ranks:,} BPE ranks")


@check(
    "checkpoint.dirname",
    "The directory name can be a Python module name",
    needs=(CHECKPOINT, LISTED, QWEN_V1),
)
def dirname(facts: Facts) -> CheckResult:
    cp = checkpoint_of(facts)
    problem = spelling_problem(cp.spelt, getattr(facts.env, "transformers_version", None)) if (
        cp.spelt
    ) else None
    if problem is not None:
        own = os.path.normpath(cp.path.absolute())
        return fail(
            f"{cp.spelt!r}: {problem}. A server loading the model by this spelling fails "
            "the same way",
            f"load it by its own path, {shlex.quote(own)} (or {shlex.quote(own + '/')}), "
            "and give qwen-kvprep that path too",
            paths=[cp.path],
            spelt=cp.spelt,
        )
    if not cp.dotted_name:
        return ok(f"the directory name {cp.name!r} has no dot")
    head = cp.name.split(".", 1)[0]
    alias = cp.path.absolute().parent / cp.name.replace(".", "_")
    return fail(
        f"the directory name {cp.name!r} contains a dot, so transformers cannot import its "
        f"remote code (`ModuleNotFoundError: No module named 'transformers_modules.{head}'`)",
        f"rename it or symlink it to a name without dots and load from that path: "
        f"`ln -s {shlex.quote(str(cp.path.absolute()))} {shlex.quote(str(alias))}` (use the "
        "dot-free path with every qwen-kvprep command too)",
        paths=[cp.path],
    )


# Import name -> pip distribution, where they differ.
_PIP_NAME = {"transformers_stream_generator": "transformers-stream-generator", "yaml": "pyyaml"}


@check(
    "checkpoint.requirements",
    "The remote code's imports are installed",
    needs=(CHECKPOINT, LISTED, QWEN_V1),
)
def requirements(facts: Facts) -> CheckResult:
    # Judged on the code as fix leaves it: what only the code as shipped needs (chat_stream's
    # transformers_stream_generator) is checkpoint.compat's, whose fix is `fix` itself.
    cp = checkpoint_of(facts)
    missing = list(cp.fixed_missing)
    if not missing:
        spared = [m for m in cp.requirements if m not in cp.fixed_requirements]
        absent = [m for m in spared if m in cp.missing_requirements]
        also = (
            f" ({', '.join(absent)}, which only the code as shipped imports, cannot be "
            "imported here: the folder does without it once fixed)" if absent else ""
        )
        return ok(
            f"all {len(cp.fixed_requirements)} modules the remote code needs are "
            f"importable{also}"
        )
    return fail(
        "transformers refuses to load the remote code (`ImportError: This modeling file "
        "requires the following packages that were not found in your environment: "
        f"{', '.join(missing)}`)",
        "pip install " + " ".join(shlex.quote(_PIP_NAME.get(m, m)) for m in missing),
        missing=missing,
    )
