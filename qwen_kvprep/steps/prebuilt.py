"""Prebuilt kernels: `build --export DIR` publishes this machine's build as a variant folder,
`fix --prebuilt SOURCE` installs the variant this machine needs without compiling anything,
`build --lock SOURCE` pins a source's revision and digests, `build --fetch SOURCE` brings
every variant into the huggingface_hub cache for an image that runs offline.

SOURCE is a folder (an export), a Hub repo id `ORG/NAME` or `ORG/NAME@REVISION`, or a lock
file written by `build --lock` (which then decides the source, its revision and the digests
every variant must have). Hub access goes through huggingface_hub's snapshot_download, so
HF_ENDPOINT, HF_TOKEN, the Hub cache and HF_HUB_OFFLINE behave as everywhere else; only the
metadata files and the one chosen variant are downloaded.

Nothing here runs a compiler, nvcc or ninja: this machine's needs come from torch itself.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional, TypedDict

from qwen_kvprep import catalogue
from qwen_kvprep.buildcache import CacheLayout, read_sources, resolve_cache_dir, vendored_sources
from qwen_kvprep.buildcache.arch import visible_gpu_archs
from qwen_kvprep.buildcache.builder import (
    _cap,
    abi_inputs,
    build_key,
    find_build,
    not_loadable,
    stderr_notify,
)
from qwen_kvprep.buildcache.loader import source_hashes
from qwen_kvprep.buildcache.manifest import PREBUILT
from qwen_kvprep.buildcache.variant import (
    BUILD_DIRNAME,
    METADATA,
    Chosen,
    Variant,
    bad_files,
    describe,
    export,
    install,
    installed_key,
    list_variants,
    variant_name,
    verified_sources,
)
from qwen_kvprep.common import KERNEL_FILES
from qwen_kvprep.errors import KvprepError, SourceError, UsageError, os_failure
from qwen_kvprep.findings import Finding, fail, info, ok, warn
from qwen_kvprep.fsutil import atomic_write_text, check_output_file
from qwen_kvprep.probe.toolchain import torch_info
from qwen_kvprep.quickstart import ENV_PREBUILT
from qwen_kvprep.redact import install_log_filter
from qwen_kvprep.state.writer import load_state
from qwen_kvprep.steps.download import _cause_summary, _progress_bars, hub_errors
from qwen_kvprep.untrusted import describe_json_error, read_record

if TYPE_CHECKING:
    from qwen_kvprep.buildcache.builder import BuildResult
    from qwen_kvprep.buildcache.manifest import BuildInputs
    from qwen_kvprep.jsontypes import JSON, JSONObject
    from qwen_kvprep.probe.toolchain import TorchInfo
    from qwen_kvprep.steps.context import FixContext

LOCK_FILE = "kvprep.lock.json"
LOCK_VERSION = 1
_REPO = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<rev>[^\s@]+))?$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


class LockedVariant(TypedDict):
    key: str
    metadata_sha256: str  # pins every file's digest (the metadata lists them)
    files: dict[str, str]


class LockData(TypedDict):
    lock_version: int
    source: str  # a folder (absolute) or ORG/NAME
    revision: Optional[str]  # the Hub commit; None for a folder
    variants: dict[str, LockedVariant]


@dataclass(frozen=True)
class Source:
    spec: str  # as given (what the state records for prestart)
    folder: Optional[Path] = None
    repo_id: Optional[str] = None
    revision: Optional[str] = None
    lock: Optional[LockData] = None

    def where(self, commit: Optional[str] = None) -> str:
        if self.folder is not None:
            return str(self.folder)
        rev = commit or self.revision or "main"
        return f"{self.repo_id}@{rev[:12] if commit else rev}"


# -- SOURCE ------------------------------------------------------------------------------
def _lock_problem(data: JSON) -> Optional[str]:
    if not isinstance(data, dict) or data.get("lock_version") != LOCK_VERSION:
        return f"it is not a version {LOCK_VERSION} qwen-kvprep lock"
    source, revision = data.get("source"), data.get("revision")
    if not isinstance(source, str) or not isinstance(revision, (str, type(None))):
        return "its source or revision is malformed"
    if revision is not None and not _COMMIT.match(revision):
        return f"its revision {revision!r} is not a commit (40 hex digits)"
    if revision is None and not os.path.isabs(source):
        return "it pins no commit of its Hub repo (revision is null)"
    variants = data.get("variants")
    if not isinstance(variants, dict) or not variants:
        return "it pins no variant"
    for name, entry in variants.items():
        if not (
            isinstance(entry, dict)
            and all(isinstance(entry.get(k), str) and _HEX64.match(str(entry[k]))
                    for k in ("key", "metadata_sha256"))
            and isinstance(entry.get("files"), dict)
        ):
            return f"its entry for {name!r} is malformed"
    return None


def read_lock(path: Path) -> LockData:
    try:
        data: JSON = read_record(path)
    except (OSError, ValueError) as exc:
        raise UsageError(
            f"the lock file {path} {describe_json_error(exc)}", fix=_WRITE_LOCK
        ) from None
    why = _lock_problem(data)
    if why is not None:
        raise UsageError(f"{path} cannot be used as a lock file: {why}", fix=_WRITE_LOCK)
    lock: LockData = data  # type: ignore[assignment]  # checked just above
    return lock


def parse_source(spec: str) -> Source:
    """A folder, a lock file or a Hub repo id (an existing path wins, as in transformers)."""
    path = Path(os.path.expanduser(spec))
    if not path.is_file():
        return _folder_or_repo(spec)
    lock = read_lock(path)
    # not parse_source: a lock's source that is a file (itself, another lock) is refused,
    # not followed
    inner = _folder_or_repo(lock["source"], lock_file=path)
    return Source(str(path.absolute()), inner.folder, inner.repo_id, lock["revision"], lock)


def _folder_or_repo(spec: str, lock_file: Optional[Path] = None) -> Source:
    path = Path(os.path.expanduser(spec))
    if path.is_dir():
        return Source(str(path.absolute()), folder=path.absolute())
    m = _REPO.match(spec)
    rev = m["rev"] if m is not None else None
    if m is not None and not os.path.lexists(path) and not (rev and _bad_revision(rev)):
        return Source(spec, repo_id=m["repo"], revision=rev)
    if lock_file is not None:
        raise UsageError(
            f"{lock_file} cannot be used as a lock file: its source {spec!r} is neither a "
            "folder nor a Hub repo id",
            fix=_WRITE_LOCK,
        )
    if m is not None and rev and _bad_revision(rev):
        raise UsageError(f"--prebuilt {spec!r}: {rev!r} is not a branch, tag or commit")
    raise UsageError(
        f"--prebuilt {spec!r} is neither a folder, a lock file nor a Hub repo id",
        fix="pass a folder written by `qwen-kvprep build --export DIR`, ORG/NAME[@REVISION], "
        f"or a lock file written by `qwen-kvprep build --lock SOURCE` ({LOCK_FILE})",
    )


def _bad_revision(rev: str) -> bool:
    """A revision huggingface_hub would resolve outside the repo's refs (`..`, `/x`)."""
    return rev.startswith("/") or ".." in rev.split("/")


_WRITE_LOCK = "write it anew: `qwen-kvprep build --lock SOURCE --lock-file FILE`"


# -- the Hub -----------------------------------------------------------------------------
def _hub_error(
    exc: BaseException, source: Source, what: str, cached_only: bool = False
) -> SourceError:
    from huggingface_hub import constants
    from huggingface_hub.utils import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )


    where = f"{what} of {source.where()}"
    endpoint = str(constants.ENDPOINT)
    fetch = f"qwen-kvprep build --fetch {shlex.quote(source.spec)}"
    # huggingface_hub 0.19 offline, without the repo cached, fails to open its ref file
    missing = isinstance(exc, (LocalEntryNotFoundError, FileNotFoundError))
    if missing and (constants.HF_HUB_OFFLINE or cached_only):
        why = "HF_HUB_OFFLINE is set and " if constants.HF_HUB_OFFLINE else ""
        message = f"{why}{where} is not in the huggingface_hub cache ({constants.HF_HUB_CACHE})"
        fix = f"fetch every variant once while online (at image build): `{fetch}`"
    elif isinstance(exc, LocalEntryNotFoundError):
        message = f"could not get {where} from {endpoint} ({_cause_summary(exc)}), no copy cached"
        fix = "check the network, HF_ENDPOINT and proxy settings, and retry"
    elif isinstance(exc, RepositoryNotFoundError):
        message = f"repo {source.repo_id} was not found at {endpoint} (or it is private and no "\
            "valid token was sent)"
        fix = "check the repo id; for a private repo log in (`hf auth login`) or set HF_TOKEN"
    elif isinstance(exc, RevisionNotFoundError):
        message = f"revision {source.revision!r} does not exist in {source.repo_id}"
        fix = "pass ORG/NAME@REVISION with a branch, tag or commit of the repo"
    elif isinstance(exc, HfHubHTTPError):
        message = f"{endpoint} refused {where}: {_cause_summary(exc)}"
        fix = "check HF_TOKEN if the server refused the credentials, or retry later"
    else:
        message = f"downloading {where} from {endpoint} failed: {_cause_summary(exc)}"
        fix = "retry; if it persists, check the network and HF_ENDPOINT"
    return SourceError.failing("prebuilt.fetch", message, fix, source=source.spec)


def _snapshot(
    source: Source,
    patterns: list[str],
    what: str,
    progress: Optional[bool],
    revision: str,
    cached_only: bool = False,
) -> Path:
    """snapshot_download of `patterns` (from the cache alone with HF_HUB_OFFLINE or
    `cached_only`)."""
    import sys

    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.utils import HFValidationError


    install_log_filter()
    assert source.repo_id is not None
    try:
        with _progress_bars(sys.stderr.isatty() if progress is None else progress):
            path = snapshot_download(
                source.repo_id,
                revision=revision,
                allow_patterns=patterns,
                local_files_only=cached_only or bool(constants.HF_HUB_OFFLINE),
            )
    except HFValidationError as exc:
        raise UsageError(f"{source.spec!r} is not a Hub repo id: {exc}") from None
    except hub_errors(KeyError) as exc:
        # KeyError: a server (an HF_ENDPOINT mirror) whose answer lacks a field this
        # huggingface_hub requires
        raise _hub_error(exc, source, what, cached_only) from exc
    return Path(path)


@dataclass(frozen=True)
class Listing:
    root: Path  # the folder holding build/
    commit: Optional[str]  # the Hub commit (None for a folder)
    variants: list[Variant]
    unusable: dict[str, str]  # folder name -> why


def list_source(
    source: Source,
    progress: Optional[bool] = None,
    everything: bool = False,
    cached_only: bool = False,
) -> Listing:
    """The variants SOURCE offers (for the Hub: their metadata only, unless `everything`;
    what the huggingface_hub cache holds, with `cached_only`)."""
    if source.folder is not None:
        root, commit = source.folder, None
    else:
        pattern = f"{BUILD_DIRNAME}/*" if everything else f"{BUILD_DIRNAME}/*/metadata.json"
        what = "every variant" if everything else "the variants' metadata"
        root = _snapshot(
            source, [pattern], what, progress, source.revision or "main", cached_only
        )
        commit = root.name
    variants, unusable = list_variants(root)
    if source.folder is not None and not variants and not unusable:
        _refuse_inner_folder(root)
    if source.lock is not None:
        pinned = source.lock["variants"]
        variants = [v for v in variants if v.name in pinned]
    return Listing(root, commit, variants, unusable)


def _refuse_inner_folder(root: Path) -> None:
    """A folder inside an export (a variant, or build/) given as SOURCE: the advice to
    export into it would nest a second export inside the first."""
    if (root / METADATA).is_file():
        export, what = root.parent.parent, "one variant's folder"
    elif root.name == BUILD_DIRNAME and root.parent.is_dir():
        export, what = root.parent, f"the {BUILD_DIRNAME}/ folder"
    else:
        return
    raise UsageError(
        f"--prebuilt {root} is {what} inside an export; SOURCE is the export folder itself",
        fix=f"pass --prebuilt {shlex.quote(str(export))}",
    )


# -- what this machine needs -------------------------------------------------------------
def _policy_problem(variant: Variant, policy: str) -> Optional[str]:
    """--source with --prebuilt: which kernel sources a variant may have been built from."""
    if policy == "auto":
        return None

    kind, _ = catalogue.classify_set(variant.inputs["sources"], catalogue.ours_hashes())
    wanted = catalogue.OURS if policy == "vendored" else catalogue.OFFICIAL
    if kind != wanted:
        which = "qwen-kvprep's own" if policy == "vendored" else "Qwen's official ones"
        return f"it was built from other kernel sources than {which} (--source {policy})"
    return None


def why_not(
    variant: Variant, tinfo: TorchInfo, gpus: tuple[tuple[int, int], ...], policy: str
) -> Optional[str]:
    """Why the variant cannot serve this machine, or None. A CPU variant must have exactly
    the key this machine's CPU build would have; a CUDA one the runtime inputs of that key
    and architectures that run on every visible GPU (what fix accepts from its own cache)."""
    problem = _policy_problem(variant, policy)
    if problem is not None:
        return problem
    wanted = abi_inputs(variant.inputs["sources"], tinfo)
    if variant.manifest["cuda"] and tinfo.cuda is None:
        return "it is a CUDA build and this torch is a CPU build"
    why = not_loadable(variant.manifest, wanted, gpus if variant.manifest["cuda"] else ())
    if why is not None or variant.manifest["cuda"]:
        return why
    if build_key(wanted) != variant.key:
        return "its build key differs from this machine's (the compiler flags differ)"
    return None


def _gpus() -> tuple[tuple[int, int], ...]:
    return tuple(_cap(a) for a in visible_gpu_archs())


# Where advice exports to when SOURCE is a folder that is not an export (a model folder,
# say), so that `build --export` never writes build/ among someone else's files.
EXPORT_BESIDE = "qwen-kvprep-variants"


def export_dest(folder: Path) -> Path:
    """`folder` when it is an export (it has build/) or empty, else EXPORT_BESIDE beside it."""
    try:
        if (folder / BUILD_DIRNAME).is_dir() or not any(folder.iterdir()):
            return folder
    except OSError:
        pass
    return folder.parent / EXPORT_BESIDE


@dataclass(frozen=True)
class Needed:
    name: str  # the variant name this machine would export
    text: str  # what it is, in words
    command: str  # what makes it


def needed(tinfo: TorchInfo, gpus: tuple[tuple[int, int], ...], source: Source) -> Needed:
    inputs: BuildInputs = abi_inputs(source_hashes(vendored_sources()), tinfo)
    arch = ";".join(f"{a}.{b}" for a, b in gpus)
    # a CUDA torch with no GPU visible (an image build, CI) runs the CPU-only extension of
    # this torch, the variant such a machine exports; a CUDA one would serve as well
    cuda = tinfo.cuda is not None and bool(gpus)
    if cuda:
        inputs["arch_list"] = [f"{a}.{b}" for a, b in gpus]
    dest = str(export_dest(source.folder)) if source.folder is not None else "DIR"
    command = f"qwen-kvprep build --export {shlex.quote(dest)}"
    if cuda:
        command += f" --arch {shlex.quote(arch)}"
    where = "with this torch and Python" + (" and a CUDA toolkit (nvcc)" if cuda else "")
    command = f"`{command}` on a machine {where}"
    if source.repo_id is not None:
        command += f", then `hf upload {source.repo_id} DIR`"
    if source.lock is not None:
        command += f", then lock anew: `qwen-kvprep build --lock {source.repo_id or dest}`"
    text = describe(inputs, cuda)
    if tinfo.cuda is not None and not cuda:
        text += "; no GPU is visible, so a CUDA variant of this torch serves too"
    return Needed(variant_name(inputs, cuda), text, command)


def choose(listing: Listing, source: Source, policy: str) -> Variant:
    """The variant for this machine (a CUDA one first where torch has CUDA), or a
    SourceError (`prebuilt.variant`) naming what is needed and what SOURCE has."""
    tinfo = torch_info()
    gpus = _gpus() if tinfo.cuda is not None else ()
    reasons: dict[str, str] = {}
    fitting: list[Variant] = []
    for variant in listing.variants:
        why = why_not(variant, tinfo, gpus, policy)
        if why is None:
            fitting.append(variant)
        else:
            reasons[variant.name] = why
    fitting.sort(key=lambda v: not v.manifest["cuda"])
    if fitting:
        return fitting[0]
    need = needed(tinfo, gpus, source)
    reasons.update(listing.unusable)
    has = "; ".join(f"{n} ({r})" for n, r in sorted(reasons.items())) or "no variant at all"
    pinned = " pinned by the lock" if source.lock is not None else ""
    message = (
        f"{source.where(listing.commit)} has no variant{pinned} for this machine, which needs "
        f"{need.name} ({need.text}); it has: {has}. Nothing was written"
    )
    raise SourceError.failing(
        "prebuilt.variant",
        message,
        f"make the missing variant: {need.command}",
        needed=need.name,
        available=sorted(reasons),
        reasons=dict(sorted(reasons.items())),
    )


def verify(variant: Variant, source: Source) -> None:
    """Every shipped file against the metadata, and the metadata against the lock; a
    SourceError (`prebuilt.verify` / `prebuilt.lock`) names what differs."""
    if source.lock is not None:
        pinned = source.lock["variants"][variant.name]
        if (pinned["metadata_sha256"], pinned["key"]) != (variant.metadata_sha256, variant.key):
            raise SourceError.failing(
                "prebuilt.lock",
                f"{variant.folder / 'metadata.json'} has sha256 {variant.metadata_sha256}, the "
                f"lock {source.spec} pins {pinned['metadata_sha256']}; nothing was installed",
                "the source changed since it was locked: check it, then lock anew "
                "(`qwen-kvprep build --lock SOURCE`)",
                [variant.folder],
                variant=variant.name,
            )
    bad = bad_files(variant)
    if bad:
        listing = "; ".join(
            f"{rel}: sha256 {got}, metadata.json says {variant.metadata['files'][rel]}"
            if got
            else f"{rel}: missing or not a regular file"
            for rel, got in sorted(bad.items())
        )
        again = (
            "export the variant again (`qwen-kvprep build --export "
            f"{shlex.quote(str(source.folder))}` on a machine of this kind)"
            if source.folder is not None
            else f"download the damaged files anew where the Hub is reachable: `qwen-kvprep "
            f"build --fetch {shlex.quote(source.spec)}`"
        )
        raise SourceError.failing(
            "prebuilt.verify",
            f"the prebuilt variant {variant.name} in {variant.folder} failed verification "
            f"({listing}); nothing was installed",
            again,
            [variant.folder / rel for rel in sorted(bad)],
            variant=variant.name,
            files={rel: got for rel, got in sorted(bad.items())},
        )


def prepare(spec: str, policy: str = "auto", progress: Optional[bool] = None) -> Chosen:
    """Resolve SOURCE, choose this machine's variant, download only it, verify it."""
    source = parse_source(spec)
    listing = list_source(source, progress)
    variant = choose(listing, source, policy)
    if source.repo_id is not None:
        pattern = f"{BUILD_DIRNAME}/{variant.name}/*"
        root = _snapshot(source, [pattern], f"variant {variant.name}", progress,
                         listing.commit or source.revision or "main")
        variant = Variant(variant.name, root / BUILD_DIRNAME / variant.name, variant.metadata,
                          variant.metadata_sha256)
    verify(variant, source)
    record: dict[str, Optional[str]] = {
        "origin": "prebuilt",
        "prebuilt": source.spec,
        "repo_id": source.repo_id,
        "revision": listing.commit or source.revision,
        "variant": variant.name,
        "key": variant.key,
    }
    where = f"{source.where(listing.commit)}" + (f" (locked by {spec})" if source.lock else "")
    return Chosen(variant, verified_sources(variant), where, record)


# -- fix's steps -------------------------------------------------------------------------
def choose_for_fix(ctx: FixContext) -> Chosen:
    """sources step: before anything is written, the variant and its verified sources."""
    options = ctx.options
    assert options.prebuilt is not None
    if not options.build:
        raise UsageError(
            "--prebuilt installs a build and --no-build skips the build: use one of them"
        )
    if options.arch:
        raise UsageError(
            "--arch chooses what to compile; a prebuilt variant's architectures are fixed "
            "(the variant that covers the visible GPUs is chosen)",
            fix="drop --arch",
        )
    progress = options.progress
    chosen = prepare(options.prebuilt, options.source, progress)
    ctx.prebuilt = chosen
    ctx.extra["prebuilt"] = _chosen_json(chosen)
    return chosen


def _chosen_json(chosen: Chosen) -> JSONObject:
    record: JSONObject = dict(chosen.record)
    record["where"] = chosen.where
    return record


def install_for_fix(ctx: FixContext) -> None:
    """build step: put the verified variant into the build cache (nothing is compiled)."""
    chosen = ctx.prebuilt
    assert chosen is not None
    layout = CacheLayout(resolve_cache_dir(ctx.options.cache_dir))
    variant = chosen.variant
    key = installed_key(variant)
    if ctx.options.dry_run:
        ctx.planned_key = key
        ctx.add(
            info(
                "build.build",
                f"would install the prebuilt variant {variant.name} from {chosen.where} as "
                f"build {key[:12]} in {layout.build_dir(key)}",
                key=key,
            )
        )
        return
    result = install(variant, layout, stderr_notify, chosen.record["prebuilt"] or chosen.where)
    ctx.use_build(
        result, ok,
        f"installed the prebuilt variant {variant.name} from {chosen.where} as build "
        f"{result.key[:12]} (sha256 verified; nothing compiled)",
    )


# -- build --export / --lock / --fetch ---------------------------------------------------
@dataclass(frozen=True)
class Outcome:
    """What one of build's prebuilt actions did: findings and its JSON fields."""

    findings: list[Finding]
    fields: JSONObject


def export_build(
    dest: Path, built: Outcome, result: BuildResult, source_dir: Optional[Path]
) -> Outcome:
    """`build --export DIR`: the build `built` found or compiled, as a variant in DIR."""
    sources = read_sources(source_dir, required=KERNEL_FILES[:1]) if source_dir else (
        vendored_sources()
    )
    try:
        done = export(result, sources, dest)
    except OSError as exc:  # a read-only or full DEST: said of DEST, not of a view of DIR
        raise os_failure(exc, dest, output_option=False) from exc
    verb = "replaced" if done.replaced else "added"
    message = (
        f"{verb} the variant {done.name} in {dest}; publish it with `hf upload ORG/NAME "
        f"{shlex.quote(str(dest))}` (other machines' exports add their variants beside it)"
    )
    findings = [*built.findings, ok("prebuilt.export", message, paths=[done.folder])]
    fields: JSONObject = {**built.fields, "variant": done.name, "export": str(done.folder)}
    return Outcome(findings, fields)


def write_lock(spec: str, out: Path) -> Outcome:
    """Pin SOURCE's revision (the Hub commit) and every variant's digests in `out`."""
    source = parse_source(spec)
    if source.lock is not None:
        raise UsageError(f"{spec} is a lock already; lock its source instead")
    check_output_file(out, "--lock-file")  # before the listing (a download, maybe)
    listing = list_source(source)
    if not listing.variants:
        raise SourceError.failing(
            "prebuilt.lock",
            f"{source.where(listing.commit)} holds no usable variant "
            f"({'; '.join(f'{n}: {r}' for n, r in listing.unusable.items()) or 'none at all'})",
            "export one first: `qwen-kvprep build --export DIR`",
        )
    lock: LockData = {
        "lock_version": LOCK_VERSION,
        "source": str(source.folder) if source.folder is not None else str(source.repo_id),
        "revision": listing.commit,
        "variants": {
            v.name: {
                "key": v.key,
                "metadata_sha256": v.metadata_sha256,
                "files": dict(v.metadata["files"]),
            }
            for v in listing.variants
        },
    }
    try:
        atomic_write_text(out, json.dumps(lock, indent=2, sort_keys=True) + "\n")
    except OSError as exc:  # named after the lock file, not the temporary one written first
        raise os_failure(
            OSError(exc.errno, exc.strerror, str(out)), output_option=False
        ) from exc
    names = sorted(lock["variants"])
    unusable = listing.unusable
    findings: list[Finding] = [
        ok(
            "prebuilt.lock",
            f"locked {source.where(listing.commit)} with {len(names)} variant(s) in {out}; "
            f"`fix --prebuilt {shlex.quote(str(out))}` then requires exactly these",
            paths=[out],
        )
    ]
    findings += [info("prebuilt.unusable", f"left out {n}: {r}") for n, r in unusable.items()]
    variants: list[JSON] = list(names)
    return Outcome(findings, {"lock": str(out), "revision": listing.commit, "variants": variants})


def fetch_all(spec: str, progress: Optional[bool] = None) -> Outcome:
    """Every variant of SOURCE into the huggingface_hub cache, each verified (and against
    the lock when SOURCE is one): an image built so serves with HF_HUB_OFFLINE=1."""
    source = parse_source(spec)
    listing = list_source(source, progress, everything=True)
    findings: list[Finding] = []
    for variant in listing.variants:
        try:
            try:
                verify(variant, source)
            except SourceError:
                # a damaged copy in the huggingface_hub cache: a plain download links the
                # same damaged blob again, so those files are downloaded anew, once
                if not _download_anew(source, listing, variant):
                    raise
                verify(variant, source)
                findings.append(info("prebuilt.fetch", f"{variant.name}: downloaded "
                                     "damaged files anew", paths=[variant.folder]))
        except SourceError as exc:
            findings += exc.findings
            continue
        findings.append(ok("prebuilt.fetch", f"{variant.name}: verified", paths=[variant.folder]))
    for name, why in listing.unusable.items():
        findings.append(fail("prebuilt.verify", f"{name} cannot be used: {why}"))
    if not listing.variants and not listing.unusable:
        findings.append(fail("prebuilt.fetch", f"{source.where(listing.commit)} has no variant"))
    names: list[JSON] = [v.name for v in listing.variants]
    fields: JSONObject = {"root": str(listing.root), "revision": listing.commit, "variants": names}
    return Outcome(findings, fields)


def _download_anew(source: Source, listing: Listing, variant: Variant) -> bool:
    """Download the files of `variant` that fail verification again, their damaged copies
    in the huggingface_hub cache removed first (a plain download links the same blob
    again, and some huggingface_hub releases return a commit's cached file even with
    force_download); False when SOURCE is no Hub repo, or offline."""
    from huggingface_hub import constants, hf_hub_download

    bad = bad_files(variant)
    if source.repo_id is None or listing.commit is None or not bad or constants.HF_HUB_OFFLINE:
        return False
    blobs = os.path.realpath(listing.root.parent.parent / "blobs")
    try:
        for rel in bad:
            pointer = variant.folder / rel
            blob = os.path.realpath(pointer)
            # only what lies in this repo's own cache folders: the snapshot's link, its blob
            if os.path.dirname(blob) == blobs and os.path.isfile(blob):
                os.unlink(blob)
            if os.path.islink(pointer) or os.path.isfile(pointer):
                os.unlink(pointer)
    except OSError as exc:
        raise os_failure(exc, output_option=False) from exc
    try:
        for rel in sorted(bad):
            hf_hub_download(source.repo_id, f"{BUILD_DIRNAME}/{variant.name}/{rel}",
                            revision=listing.commit)
    except hub_errors() as exc:
        raise _hub_error(exc, source, f"the files of {variant.name}") from exc
    return True


# -- doctor ------------------------------------------------------------------------------
def recorded(directory: Optional[Path]) -> Optional[str]:
    """The SOURCE DIRECTORY's fix recorded (`fix --prebuilt SOURCE`), or None."""
    state = load_state(directory) if directory is not None else None
    sources = state.get("sources") if state is not None else None
    if isinstance(sources, dict) and sources.get("origin") == "prebuilt":
        spec = sources.get("prebuilt")
        if isinstance(spec, str) and spec:
            return spec
    return None


def configured(directory: Optional[Path]) -> tuple[Optional[str], str]:
    """(SOURCE, where it was set): $QWEN_KVPREP_PREBUILT, which wins (the container's own
    word, a lock most of all, must not lose to what an earlier fix recorded), else what
    DIRECTORY's fix recorded."""
    env = os.environ.get(ENV_PREBUILT)
    if env:
        return env, ENV_PREBUILT
    spec = recorded(directory)
    return (spec, f"recorded by fix in {directory}") if spec else (None, "")


def doctor_findings(directory: Optional[Path]) -> list[Finding]:
    """doctor: the prebuilt source, the variant this machine needs and whether the source
    (for the Hub: the huggingface_hub cache, nothing is downloaded) and the build cache
    have it. Nothing when no prebuilt source is set."""
    spec, origin = configured(directory)
    if spec is None:
        return []
    earlier = recorded(directory)
    overrides = (
        f"; it overrides {earlier}, which fix recorded: prestart installs from {spec}"
        if earlier is not None and earlier != spec
        else ""
    )
    findings = [info("prebuilt.source", f"prebuilt source in force: {spec} ({origin}{overrides})")]
    try:
        source = parse_source(spec)
        need = needed(torch_info(), _gpus(), source)
        findings.append(info("prebuilt.needed", f"this machine needs {need.name} ({need.text})"))
        variant = choose(list_source(source, progress=False, cached_only=True), source, "auto")
    except KvprepError as exc:
        if exc.findings:
            found = exc.findings[0]
            return [*findings, warn(found.id, found.message, found.fix)]
        return [*findings, warn("prebuilt.variant", exc.message, exc.fix)]
    layout = CacheLayout(resolve_cache_dir(None))
    key = installed_key(variant)
    build = find_build(layout, key, origin=PREBUILT)
    installed = build is not None and build.manifest["so_sha256"] == variant.manifest["so_sha256"]
    state = (
        f"installed in the build cache as {key[:12]}"
        if installed
        else "not installed yet (fix or prestart installs it)"
    )
    findings.append(ok("prebuilt.variant", f"{source.where()} has {variant.name}; {state}"))
    return findings
