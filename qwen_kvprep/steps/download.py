"""Download Qwen's own kernel sources through huggingface_hub and verify them.

huggingface_hub brings HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE, HF_HUB_CACHE/HF_HOME, its
timeouts, retries and progress bars with it. A fetched file is accepted only when its
sha256 and size are in the catalogue (catalogue.py): an HTML page from a proxy, a truncated
body or a different file is refused and described.

huggingface_hub is imported only inside the functions that use it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import sys
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from qwen_kvprep import catalogue, hubcli
from qwen_kvprep.common import KERNEL_FILES
from qwen_kvprep.errors import SourceError, UsageError
from qwen_kvprep.findings import Finding, fail
from qwen_kvprep.redact import install_log_filter

HEAD_BYTES = 32  # how much of a refused body a finding quotes


# -- describing bytes that were refused --------------------------------------------------
@dataclass(frozen=True)
class Received:
    size: int
    head: bytes
    sha256: str
    data: Optional[bytes]  # None when larger than anything we would accept

    @property
    def looks_like_html(self) -> bool:
        start = self.head.lstrip().lower()
        return start.startswith((b"<!doctype html", b"<html", b"<?xml", b"<head"))


def received_from_file(path: Path, keep_up_to: int) -> Received:
    """Hash a file by streaming it; keep its bytes only when it is no larger than
    `keep_up_to` (a server can send gigabytes where 50 kB were expected)."""
    h = hashlib.sha256()
    head = b""
    size = 0
    chunks: list[bytes] = []
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            if not head:
                head = chunk[:HEAD_BYTES]
            h.update(chunk)
            size += len(chunk)
            if size <= keep_up_to:
                chunks.append(chunk)
    return Received(size, head, h.hexdigest(), b"".join(chunks) if size <= keep_up_to else None)


def verify(name: str, got: Received, where: str, **more: str) -> Optional[Finding]:
    """None when `got` is the official `name`; else a failing `kernels.verify` finding
    that says what was received (size, first bytes, sha256) and what was expected."""
    known = catalogue.known_good().files[name]
    if got.sha256 == known.sha256 and got.size == known.size:
        return None
    what = "an HTML page" if got.looks_like_html else "not the official file"
    return fail(
        "kernels.verify",
        f"{name} from {where} is {what}: received {got.size} bytes, sha256 "
        f"{got.sha256[:16]}…, starting {got.head!r} (expected {known.size} bytes, "
        f"sha256 {known.sha256[:16]}…); nothing was written",
        "use `--source vendored` (qwen-kvprep's own kernels); if a proxy or HF_ENDPOINT "
        "served this, fix that and remove the bad cached copy before retrying",
        details={
            "file": name,
            "received_size": got.size,
            "received_head": repr(got.head),
            "received_sha256": got.sha256,
            "expected_size": known.size,
            "expected_sha256": known.sha256,
            **more,
        },
    )


# -- fetching ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Fetched:
    repo_id: str
    revision: str
    commit: Optional[str]  # the commit the Hub resolved `revision` to, when known
    files: Mapping[str, bytes]
    paths: Mapping[str, str]  # where huggingface_hub keeps them (its cache)


@contextlib.contextmanager
def _progress_bars(enabled: bool) -> Iterator[None]:
    """Silence huggingface_hub's bars for this call only (JSON output, no terminal)."""
    from huggingface_hub.utils import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )

    if enabled or are_progress_bars_disabled():
        yield
        return
    with warnings.catch_warnings():
        # HF_HUB_DISABLE_PROGRESS_BARS=0 forbids disabling them: the user's choice wins.
        warnings.simplefilter("ignore")
        disable_progress_bars()
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            enable_progress_bars()


@contextlib.contextmanager
def _keep_unchanged(folder: Optional[Path]) -> Iterator[None]:
    """When the checkpoint is itself a snapshot folder of the active huggingface_hub
    cache, hf_hub_download links the files it fetches into it. Changes to a checkpoint go
    through the journal only (so revert and --dry-run hold), so such links are removed
    again, whatever the outcome."""
    if folder is None:
        yield
        return
    absent = [n for n in KERNEL_FILES if not os.path.lexists(folder / n)]
    try:
        yield
    finally:
        for name in absent:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(folder / name)


_ERRNO = re.compile(r"\[Errno -?\d+\][^'\")]*")


def _cause_summary(exc: BaseException) -> str:
    """A short, readable reason: requests nests the OS error (connection refused, name
    not resolved) several reprs deep, and that is the part a user can act on."""
    cause = exc.__cause__ or exc
    inner: BaseException = cause
    for _ in range(5):  # ChunkedEncodingError(ProtocolError("Connection broken: ...", ...))
        if inner.args and isinstance(inner.args[0], BaseException):
            inner = inner.args[0]
    first = inner.args[0] if inner.args and isinstance(inner.args[0], str) else str(inner)
    errno = _ERRNO.search(str(cause))
    if errno is not None:
        text = errno.group(0).strip()
    else:
        text = next((line.strip() for line in first.splitlines() if line.strip()), "")
    return f"{type(cause).__name__}: {text[:200]}" if text else type(cause).__name__


def _known_repos_hint() -> str:
    return ", ".join(catalogue.known_good().repos)


def hub_errors(*more: type[BaseException]) -> tuple[type[BaseException], ...]:
    """What a huggingface_hub download raises for an expected failure (and `more`): its
    own errors are OSErrors, and so are requests' (huggingface_hub < 1.0); from 1.0 on a
    network failure outside the Hub's answers is httpx's (2.x: httpx2), which is not."""
    import importlib

    errors: list[type[BaseException]] = [OSError, ValueError, *more]
    for name in ("httpx", "httpx2"):
        try:
            errors.append(importlib.import_module(name).HTTPError)
        except (ImportError, AttributeError):
            continue
    return tuple(errors)


def fetch_error(
    exc: BaseException,
    *,
    repo_id: str,
    filename: str,
    revision: str,
    offline: bool,
    endpoint: str,
    cache_dir: str,
) -> SourceError:
    """One `kernels.fetch` finding naming the repo, file and revision, for any failure of
    hf_hub_download: what went wrong in words, and the next thing to try."""
    from huggingface_hub.utils import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{filename} of {repo_id}@{revision}"
    vendored = "use `--source vendored` (qwen-kvprep's own kernels, no download)"
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    # Order matters: LocalEntryNotFoundError is an EntryNotFoundError, GatedRepoError a
    # RepositoryNotFoundError, and all the Hub's HTTP errors are OSErrors.
    if isinstance(exc, LocalEntryNotFoundError):
        if offline:
            message = (
                f"HF_HUB_OFFLINE is set and {where} is not in the huggingface_hub cache "
                f"({cache_dir})"
            )
            fix = (
                f"{vendored}; or fetch it once while online: "
                f"`{hubcli.download()} {repo_id} {filename} --revision {revision}`"
            )
        else:
            message = (
                f"could not get {where} from {endpoint} ({_cause_summary(exc)}), and no copy "
                "is cached"
            )
            fix = f"check the network, HF_ENDPOINT and proxy settings and retry; or {vendored}"
            inner = exc.__cause__
            status = getattr(getattr(inner, "response", None), "status_code", status)
    elif isinstance(exc, GatedRepoError):
        message = f"{repo_id} is gated and this account has not been granted access ({where})"
        fix = (
            f"accept the license on the repo's page at {endpoint}/{repo_id}, then log in "
            f"(`{hubcli.login()}`) or set HF_TOKEN; or {vendored}"
        )
    elif isinstance(exc, RepositoryNotFoundError):
        message = (
            f"repo {repo_id} was not found at {endpoint} (or it is private and no valid "
            f"token was sent), fetching {where}"
        )
        fix = f"check --repo-id (Qwen v1 repos: {_known_repos_hint()}); or {vendored}"
    elif isinstance(exc, RevisionNotFoundError):
        message = f"revision {revision!r} does not exist in {repo_id} ({where})"
        fix = f"check --revision (a branch, tag or commit of {repo_id}); or {vendored}"
    elif isinstance(exc, EntryNotFoundError):
        message = (
            f"{repo_id}@{revision} has no {filename}: it is not a Qwen (v1) repo, or its "
            "revision predates the KV-cache kernels"
        )
        fix = f"use a repo that has them (e.g. Qwen/Qwen-7B-Chat); or {vendored}"
    elif isinstance(exc, HfHubHTTPError):
        message = f"HTTP {status} from {endpoint} for {where}: {_cause_summary(exc)}"
        fix = f"check HF_TOKEN if the server refused the credentials, or retry later; or {vendored}"
    else:
        # Network failures outside the HEAD call (a body cut short, SSL, a proxy), a
        # size check of huggingface_hub's own, a full disk.
        message = f"downloading {where} from {endpoint} failed: {_cause_summary(exc)}"
        fix = f"retry; if it persists, check the network and HF_ENDPOINT; or {vendored}"
    return SourceError.failing(
        "kernels.fetch",
        message,
        fix,
        repo_id=repo_id,
        file=filename,
        revision=revision,
        endpoint=endpoint,
        offline=offline,
        status=status,
        error=type(exc).__name__,
    )


def fetch_official(
    repo_id: str,
    revision: str,
    *,
    progress: Optional[bool] = None,
    checkpoint: Optional[Path] = None,
) -> Fetched:
    """Download both official files with hf_hub_download and verify them.

    Raises SourceError (findings `kernels.fetch` / `kernels.verify`) on any failure;
    UsageError for a malformed repo id. `progress=None` shows huggingface_hub's bars only
    when stderr is a terminal. `checkpoint`: the folder the files are meant for, kept
    unchanged here (see _keep_unchanged).
    """
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.utils import HFValidationError, validate_repo_id


    install_log_filter()  # its retry warnings print the URL, HF_ENDPOINT credentials and all
    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise UsageError(
            f"--repo-id {repo_id!r} is not a Hub repo id: {exc}",
            fix=f"pass ORG/NAME, e.g. one of: {_known_repos_hint()}",
        ) from exc

    # Offline means no network attempt at all, not a connection that fails after
    # huggingface_hub's retries: ask for the cached copy only.
    offline = bool(constants.HF_HUB_OFFLINE)
    if progress is None:
        progress = sys.stderr.isatty()
    endpoint = str(constants.ENDPOINT)
    cache_dir = str(constants.HF_HUB_CACHE)

    paths: dict[str, str] = {}
    with _keep_unchanged(checkpoint), _progress_bars(progress):
        for name in KERNEL_FILES:
            try:
                paths[name] = hf_hub_download(
                    repo_id, name, revision=revision, local_files_only=offline
                )
            except hub_errors() as exc:
                raise fetch_error(
                    exc,
                    repo_id=repo_id,
                    filename=name,
                    revision=revision,
                    offline=offline,
                    endpoint=endpoint,
                    cache_dir=cache_dir,
                ) from exc

        files: dict[str, bytes] = {}
        bad: list[Finding] = []
        for name, path in paths.items():
            limit = catalogue.known_good().files[name].size
            got = received_from_file(Path(path), keep_up_to=limit)
            problem = verify(
                name,
                got,
                f"{repo_id}@{revision}",
                repo_id=repo_id,
                revision=revision,
                # the blob, not the snapshot link: that is the file to delete if bad
                cached_path=os.path.realpath(path),
            )
            if problem is not None:
                bad.append(problem)
            elif got.data is not None:
                files[name] = got.data
    if bad:
        raise SourceError(
            f"the kernel sources fetched from {repo_id}@{revision} failed verification",
            fix=bad[0].fix,
            findings=bad,
        )
    return Fetched(repo_id, revision, _commit_of(paths), files, paths)


def _commit_of(paths: Mapping[str, str]) -> Optional[str]:
    """The commit hf_hub_download resolved to: its paths are `.../snapshots/<commit>/f`."""
    commits = set()
    for p in paths.values():
        parent = Path(p).parent
        if parent.parent.name != "snapshots":
            return None
        commits.add(parent.name)
    return commits.pop() if len(commits) == 1 else None
