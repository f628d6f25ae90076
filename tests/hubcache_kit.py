"""A Hugging Face cache laid out as huggingface_hub lays it out, made from a folder.

`cache_repo` moves nothing over the network: it copies each file of a checkpoint into
blobs/ (named by its sha256, as huggingface_hub names LFS blobs) and links it from
snapshots/COMMIT/, with refs/main naming COMMIT."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_repo(
    hub_cache: Path, repo_id: str, source: Path, commit: str = COMMIT, ref: str = "main"
) -> Path:
    """The snapshot folder of `repo_id` at `commit` in `hub_cache`, holding `source`'s files."""
    repo = hub_cache / f"models--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True)
    for file in sorted(source.iterdir()):
        if not file.is_file():
            continue
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        blob = repo / "blobs" / digest
        if not blob.exists():
            shutil.copyfile(file, blob)
        os.symlink(os.path.relpath(blob, snap), snap / file.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snap
