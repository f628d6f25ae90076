"""A checkpoint named by its Hub repo id, found in the local huggingface_hub cache.

Every command that takes a checkpoint folder also takes `ORG/NAME` (with `--revision`),
the way transformers does: the repo is looked up offline in the cache huggingface_hub
downloads into (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub), by
huggingface_hub itself, and its snapshot folder is the checkpoint. Nothing is downloaded;
when the snapshot is not there, the error names the `hf download` command that puts it
there. A string that is an existing folder is always that folder.

A cache repo folder (`models--ORG--NAME`, holding blobs/, refs/ and snapshots/) is taken
the same way: its refs/REVISION names the snapshot.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from qwen_kvprep import hubcli
from qwen_kvprep.errors import UsageError

# huggingface_hub's rule for a repo id with its namespace (validate_repo_id): letters,
# digits, "-", "_" and "." in each part, no "--" or ".." and no leading/trailing "-" or ".".
_PART = r"[A-Za-z0-9](?:[\w.-]{0,94}[A-Za-z0-9_])?"
_REPO_ID = re.compile(rf"^{_PART}/{_PART}$")
_REPO_FOLDER = re.compile(r"^models--(.+)$")


@dataclass(frozen=True)
class Resolved:
    """Where a checkpoint argument led: the folder, and the Hub repo it was found for."""

    path: Path
    repo_id: Optional[str] = None  # set when the argument was a repo id or a repo folder
    revision: Optional[str] = None


def looks_like_repo_id(value: str) -> bool:
    """ORG/NAME as the Hub spells a model repo (a bare NAME is a folder here)."""
    return bool(_REPO_ID.match(value)) and "--" not in value and ".." not in value


def repo_folder(path: Path) -> Optional[str]:
    """The repo id when `path` is a cache repo folder (`models--ORG--NAME` holding
    snapshots/), else None."""
    m = _REPO_FOLDER.match(Path(os.path.normpath(path.absolute())).name)
    if m is None or not (path / "snapshots").is_dir():
        return None
    return "/".join(m.group(1).split("--"))


def download_command(repo_id: str, revision: Optional[str]) -> str:
    rev = f" --revision {shlex.quote(revision)}" if revision else ""
    return f"{hubcli.download()} {shlex.quote(repo_id)}{rev}"


def _cache_root(cache_dir: Optional[Path]) -> str:
    if cache_dir is not None:
        return str(cache_dir)
    from huggingface_hub import constants  # imported already by snapshot()

    return str(constants.HF_HUB_CACHE)


def snapshot(repo_id: str, revision: Optional[str], cache_dir: Optional[Path] = None) -> Path:
    """The snapshot folder of `repo_id` at `revision` (default main) in the local cache;
    UsageError, naming the download, when it is not there. Never touches the network."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.utils import LocalEntryNotFoundError  # there from 0.19 on
    except ImportError as exc:  # a dependency of qwen-kvprep, but an environment may lack it
        raise UsageError(
            f"{repo_id} is not a folder here, and huggingface_hub, which finds a repo id in "
            "the Hugging Face cache, cannot be imported",
            fix="give the checkpoint folder (the snapshot folder, for a cached repo), or "
            "`pip install 'huggingface-hub<1.0'`",
        ) from exc

    where = _cache_root(cache_dir)
    try:
        found = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=str(cache_dir) if cache_dir is not None else None,
            local_files_only=True,
        )
    except (LocalEntryNotFoundError, OSError, ValueError) as exc:
        # LocalEntryNotFoundError: no ref or no snapshot; ValueError: an id the Hub refuses
        at = f" at revision {revision}" if revision else ""
        raise UsageError(
            f"{repo_id} is not a folder here, and the Hugging Face cache ({where}) holds no "
            f"snapshot of it{at}",
            fix=f"download it first: `{download_command(repo_id, revision)}` (or give the "
            "folder the model is in)",
        ) from exc
    return Path(found)


def resolve(value: str, revision: Optional[str] = None) -> Resolved:
    """The checkpoint folder `value` names: itself when it is a folder (a cache repo folder:
    its snapshot at `revision`, default main), else the cached snapshot of the repo id.

    UsageError when it is neither a folder nor a cached repo."""
    path = Path(value)
    if path.is_dir():
        repo = repo_folder(path)
        if repo is None:
            return Resolved(path.absolute())
        try:
            return Resolved(snapshot(repo, revision, path.absolute().parent), repo, revision)
        except UsageError:
            if revision is not None:
                raise  # the revision asked for is not there
            # no refs/main or no snapshot: the folder itself, which checkpoint.identity explains
            return Resolved(path.absolute())
    if path.exists():
        raise UsageError(f"not a directory: {value}")
    if looks_like_repo_id(value):
        return Resolved(snapshot(value, revision), value, revision)
    raise UsageError(
        f"no such directory: {value}",
        fix="give the checkpoint folder, or a Hub repo id such as Qwen/Qwen-7B-Chat that "
        "is in the Hugging Face cache",
    )
