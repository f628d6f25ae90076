"""Step of `fix` after validate: choose the kernel sources and put them into the checkpoint.

`--source vendored` takes qwen-kvprep's own kernels/; `--source hub` fetches Qwen's files
through huggingface_hub (download.fetch_official, verified by sha256); `--source auto`
keeps a correct pair already in the directory (official or ours, by hash) and otherwise
takes the vendored pair. The chosen files land in `ctx.sources` (read by build and modules) and in
the checkpoint through the journal, only after they were verified.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from qwen_kvprep import catalogue, resources
from qwen_kvprep.common import KERNEL_FILES, sha256_bytes
from qwen_kvprep.errors import SourceError, UsageError, current_user
from qwen_kvprep.findings import Finding, fail, info, ok, warn
from qwen_kvprep.steps import download
from qwen_kvprep.steps.context import FixContext, SourceSet
from qwen_kvprep.untrusted import NotRegularFile, read_regular

if TYPE_CHECKING:
    from qwen_kvprep.probe.facts import Facts

SOURCES = ("auto", "vendored", "hub")


def run(ctx: FixContext) -> None:
    options = ctx.options
    source = options.source
    if source not in SOURCES:
        raise UsageError(f"--source must be one of {', '.join(SOURCES)}, not {source!r}")
    if source != "hub" and (options.repo_id or options.revision):
        raise UsageError(
            "--repo-id and --revision choose what `--source hub` downloads; "
            f"they mean nothing with --source {source}",
            fix="add `--source hub`, or drop --repo-id/--revision",
        )

    present = _read_present(Path(ctx.directory))
    hashes = {n: (sha256_bytes(b) if b is not None else None) for n, b in present.items()}
    kind, per_file = catalogue.classify_set(hashes, catalogue.ours_hashes())

    if options.prebuilt:
        from qwen_kvprep.steps import prebuilt

        files = prebuilt.choose_for_fix(ctx).sources
        kind = catalogue.classify_set(
            {n: sha256_bytes(d) for n, d in files.items()}, catalogue.ours_hashes()
        )[0]
        record = ctx.prebuilt.record if ctx.prebuilt is not None else {}
        chosen = SourceSet("prebuilt", kind, files, record.get("repo_id"), record.get("revision"))
    elif source == "vendored":
        chosen = _vendored()
    elif source == "hub":
        chosen = _from_hub(ctx, kind, present)
    else:
        chosen = _auto(ctx, kind, present)

    _install(ctx, chosen, per_file, hashes)
    ctx.sources = chosen
    ctx.extra["sources"] = chosen.to_json()


def _read_present(directory: Path) -> dict[str, Optional[bytes]]:
    out: dict[str, Optional[bytes]] = {}
    for name in KERNEL_FILES:
        path = directory / name
        try:
            # Follows a symlink into a huggingface_hub blob: what matters is the content.
            out[name] = read_regular(path, 64 << 20)
        except FileNotFoundError:
            out[name] = None
        except NotRegularFile as exc:
            raise SourceError(
                f"{path} {exc.strerror}",
                fix=f"remove it (`rm {shlex.quote(str(path))}`); fix then puts the kernel "
                "source there",
            ) from exc
        except OSError as exc:
            raise SourceError(
                f"cannot read {path}: {exc.strerror or exc}",
                fix=f"check the permissions of {shlex.quote(str(path))} (running as user "
                f"{current_user()})",
            ) from exc
    return out


def _vendored() -> SourceSet:
    try:
        folder = resources.kernels_dir()
        files = {name: (folder / name).read_bytes() for name in KERNEL_FILES}
    except OSError as exc:
        raise SourceError.failing(
            "kernels.sources",
            f"qwen-kvprep's own kernel sources are missing from this installation ({exc})",
            "reinstall qwen-kvprep (`pip install --force-reinstall qwen-kvprep`)",
        ) from exc
    return SourceSet("vendored", catalogue.OURS, files)


def _torch_info() -> tuple[Optional[str], Optional[str]]:
    """(torch version, torch.version.cuda) of the torch that will build the extension."""
    try:
        import torch
    except Exception:  # not installed, or a broken install (missing CUDA libraries)
        return None, None
    return str(torch.__version__), getattr(torch.version, "cuda", None)


def _compat_finding(compat: catalogue.Compat, severity: str) -> Finding:
    make = fail if severity == "fail" else warn
    return make(
        "kernels.official_compat",
        f"the official kernel sources cannot be compiled here: {compat.reason}",
        "use `--source vendored` (qwen-kvprep's kernels implement the same two functions "
        "and compile with this torch)",
    )


def _auto(ctx: FixContext, kind: str, present: Mapping[str, Optional[bytes]]) -> SourceSet:
    if kind == catalogue.OURS:
        return SourceSet("checkpoint", catalogue.OURS, _complete(present))
    if kind == catalogue.OFFICIAL:
        compat = catalogue.official_compat(*_torch_info())
        if compat.status != "no":
            return SourceSet("checkpoint", catalogue.OFFICIAL, _complete(present))
        ctx.add(
            info(
                "kernels.official_compat",
                f"the checkpoint holds the official kernel sources, but {compat.reason}: "
                "using qwen-kvprep's kernels instead (the originals are kept for "
                "`qwen-kvprep revert`)",
            )
        )
    return _vendored()


def _complete(present: Mapping[str, Optional[bytes]]) -> dict[str, bytes]:
    return {name: data for name, data in present.items() if data is not None}


def _from_hub(ctx: FixContext, kind: str, present: Mapping[str, Optional[bytes]]) -> SourceSet:
    options = ctx.options
    compat = catalogue.official_compat(*_torch_info())
    if compat.status == "no" and options.build:
        # Refuse before downloading: the build step could only fail on these sources.
        finding = _compat_finding(compat, "fail")
        raise SourceError(
            finding.message,
            fix=f"{finding.fix}; or `--no-build` to only place the official files",
            findings=[finding],
        )
    if compat.status == "no":
        ctx.add(_compat_finding(compat, "warn"))

    repo_id, revision = resolve_repo(ctx.directory, ctx.facts, options.repo_id, options.revision)
    if kind == catalogue.OFFICIAL:
        # The known-good list has one hash per file, so a verified download could only
        # bring these same bytes again: no network needed, offline or not.
        ctx.add(
            info(
                "kernels.sources",
                "the checkpoint already holds the official kernel sources (sha256 verified); "
                "nothing to download",
            )
        )
        return SourceSet("checkpoint", catalogue.OFFICIAL, _complete(present), repo_id, revision)
    if repo_id is None:
        raise UsageError(
            f"--source hub needs --repo-id: {ctx.directory} does not say which Hub repo it "
            "came from (it is not a huggingface_hub cache snapshot)",
            fix="pass --repo-id ORG/NAME; Qwen v1 repos with the kernel sources: "
            + ", ".join(catalogue.known_good().repos)
            + "; or use --source vendored",
        )
    fetched = download.fetch_official(
        repo_id,
        revision,
        progress=options.progress,
        checkpoint=Path(ctx.directory),
    )
    return SourceSet("hub", catalogue.OFFICIAL, fetched.files, repo_id, revision, fetched.commit)


def resolve_repo(
    directory: Path,
    facts: Optional[Facts],
    repo_option: Optional[str],
    revision_option: Optional[str],
) -> tuple[Optional[str], str]:
    """(repo id, revision) for `--source hub`.

    The repo: --repo-id, else what the checkpoint says about itself (a huggingface_hub
    cache snapshot `.../models--ORG--NAME/snapshots/REV`). The revision: --revision, else
    the snapshot's commit when the repo is the snapshot's own, else "main".
    """
    checkpoint = facts.checkpoint if facts is not None else None
    own_repo: Optional[str] = None
    own_revision: Optional[str] = None
    if checkpoint is not None:
        own_repo, own_revision = checkpoint.repo_id, checkpoint.revision
    else:
        from qwen_kvprep.probe.checkpoint import hub_snapshot

        own_repo, own_revision, _ = hub_snapshot(Path(directory))
    repo_id = repo_option or own_repo
    if revision_option:
        revision = revision_option
    elif own_revision and repo_id == own_repo:
        revision = own_revision
    else:
        revision = "main"
    return repo_id, revision


def _describe(sources: SourceSet, ctx: FixContext) -> str:
    if sources.origin == "prebuilt" and ctx.prebuilt is not None:
        return (
            f"the kernel sources of the prebuilt variant {ctx.prebuilt.variant.name} from "
            f"{ctx.prebuilt.where} (sha256 verified)"
        )
    if sources.origin == "hub":
        commit = f" (commit {sources.commit[:12]})" if sources.commit else ""
        return (
            f"the official kernel sources from {sources.repo_id}@{sources.revision}{commit}, "
            "sha256 verified"
        )
    if sources.origin == "checkpoint":
        which = "official" if sources.kind == catalogue.OFFICIAL else "qwen-kvprep's"
        return f"the {which} kernel sources already in the checkpoint (sha256 verified)"
    return "qwen-kvprep's own kernel sources"


def _install(
    ctx: FixContext,
    chosen: SourceSet,
    per_file: Mapping[str, str],
    hashes: Mapping[str, Optional[str]],
) -> None:
    written: list[str] = []
    replaced: dict[str, str] = {}
    for name, data in chosen.files.items():
        if ctx.journal.write(name, data):
            written.append(name)
            if per_file[name] != catalogue.MISSING:
                replaced[name] = per_file[name]
    verb = "would write" if ctx.options.dry_run else "wrote"
    action = f"; {verb} {', '.join(written)}" if written else ""
    ctx.add(
        ok(
            "kernels.sources",
            f"using {_describe(chosen, ctx)}{action}",
            paths=[Path(ctx.directory) / n for n in written],
            details=chosen.to_json(),
        )
    )
    modified = {n: k for n, k in replaced.items() if k == catalogue.MODIFIED}
    if modified:
        listing = ", ".join(f"{n} (sha256 {str(hashes[n])[:16]}…)" for n in sorted(modified))
        ctx.add(
            warn(
                "kernels.sources",
                f"replaced kernel sources that were neither official nor qwen-kvprep's: {listing}",
                "`qwen-kvprep revert` restores them",
                paths=[Path(ctx.directory) / n for n in sorted(modified)],
                replaced={n: hashes[n] for n in sorted(modified)},
            )
        )
