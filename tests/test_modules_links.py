"""The modules cache as a shared place: fix never writes through a link it did not make
there, and revert never deletes through one. A folder of transformers_modules linked to a
folder of the user's (holding their own cpp_kernels.py) is refused before the first write,
and a linked records folder loses nothing to a revert."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from qwen_kvprep.common import USERS_DIRNAME
from qwen_kvprep.tiny import generate_checkpoint
from tests.cli import document, kvprep
from tests.remote_code import code_folder
from tests.treesnap import snapshot

FIX = ("--json", "--no-build", "--no-smoke")


@pytest.fixture()
def ckpt(tmp_path: Path, isolated_hf: Path) -> Path:
    return generate_checkpoint(tmp_path / "work" / "Qwen-tiny")


def users_own(tmp_path: Path) -> Path:
    """A folder of the user's, with their own cpp_kernels.py."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "cpp_kernels.py").write_text("# my own kernels, nowhere else\n")
    (mine / "notes.txt").write_text("keep\n")
    return mine


def name_folder(modules: Path, ckpt: Path) -> Path:
    """transformers_modules/<name>: the checkpoint's folder (5.x adds <hash>/ below it)."""
    folder = code_folder(modules, ckpt)
    package = modules / "transformers_modules"
    return package / folder.relative_to(package).parts[0]


def refusal(res: Any, link: Path) -> None:
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    assert "Traceback" not in res.stdout + res.stderr
    (failed,) = [f for f in document(res)["findings"] if f["severity"] == "fail"]
    assert failed["id"] == "modules.link", failed
    assert f"{link} is a symbolic link" in failed["message"]
    assert f"rm {link}" in failed["fix"]


@pytest.mark.slow
def test_fix_refuses_a_modules_folder_linked_to_the_users_own(
    ckpt: Path, tmp_path: Path, isolated_hf: Path
) -> None:
    mine = users_own(tmp_path)
    link = name_folder(isolated_hf / "modules", ckpt)
    link.parent.mkdir(parents=True)
    link.symlink_to(mine, target_is_directory=True)
    before, theirs = snapshot(ckpt, digest=True), snapshot(mine, digest=True)
    for extra in (("--dry-run",), ()):
        refusal(kvprep("fix", str(ckpt), *FIX, *extra), link)
    refusal(kvprep("prestart", str(ckpt), "--json", "--", "true"), link)
    # nothing written on either side of the link, and the link is the user's to remove
    assert snapshot(ckpt, digest=True) == before
    assert snapshot(mine, digest=True) == theirs
    assert link.is_symlink()


@pytest.mark.slow
def test_revert_deletes_nothing_through_a_linked_records_folder(
    ckpt: Path, tmp_path: Path, isolated_hf: Path
) -> None:
    res = kvprep("fix", str(ckpt), *FIX)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    folder = Path(document(res)["modules"]["folder"])
    users = folder / USERS_DIRNAME
    (record,) = os.listdir(users)
    # the records folder replaced by a link to someone's folder that holds a file of the
    # same name as this checkpoint's record
    elsewhere = tmp_path / "elsewhere"
    users.rename(elsewhere)
    users.symlink_to(elsewhere, target_is_directory=True)
    assert (elsewhere / record).is_file()
    # fix refuses to record its use through it
    refusal(kvprep("fix", str(ckpt), *FIX), users)
    res = kvprep("revert", str(ckpt))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert (elsewhere / record).is_file()
    assert users.is_symlink()


@pytest.mark.slow
def test_revert_puts_back_an_original_whose_folder_is_gone(
    ckpt: Path, isolated_hf: Path
) -> None:
    """A file of the user's that fix found in a modules-cache folder (a kernel source
    copied there by hand) is kept by the journal; when that folder is gone by the time of
    the revert (removed, or a link to it taken away), revert puts the file back rather
    than dropping the only copy with the journal."""
    res = kvprep("fix", str(ckpt), *FIX, "--dry-run")
    folder = Path(document(res)["modules"]["folder"])
    folder.mkdir(parents=True)
    mine = b"// my own copy of the kernel, nowhere else\n"
    (folder / "cache_autogptq_cuda_256.cpp").write_bytes(mine)
    res = kvprep("fix", str(ckpt), *FIX)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert (folder / "cache_autogptq_cuda_256.cpp").read_bytes() != mine
    shutil.rmtree(folder)
    res = kvprep("revert", str(ckpt))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert (folder / "cache_autogptq_cuda_256.cpp").read_bytes() == mine
    assert "found nowhere else" in res.stdout
