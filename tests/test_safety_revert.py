"""The records: revert, the journal and the state hold against races, tampering,
copies and damaged files. Nothing outside DIR and the modules cache is ever touched, no
user file is lost, and no traceback reaches the user."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable

import pytest

from qwen_kvprep import common
from qwen_kvprep.errors import KvprepError, StateError
from qwen_kvprep.journal.writer import USERS_DIRNAME, Journal
from qwen_kvprep.resources import KERNEL_FILES
from qwen_kvprep.steps.revert import revert_checkpoint
from tests.cli import document, invoke, kvprep, python
from tests.remote_code import code_folder
from tests.safety_kit import (
    MODULE_FILES,
    OFFICIAL_LOADER,
    journal_data,
    prepare,
    save_journal,
    sha,
    write_state,
)
from tests.treesnap import snapshot


@pytest.fixture()
def modules_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    return dict(os.environ)


def _assert_untouched(p: Any, before_dir: dict[str, Any], before_modules: dict[str, Any],
                      before_outside: dict[str, Any]) -> None:
    assert snapshot(p.directory) == before_dir
    assert snapshot(p.modules) == before_modules
    assert snapshot(p.outside) == before_outside


# ------------------------------------------------------------------ the journal as it should be


def test_revert_restores_everything_and_leaves_nothing(tmp_path: Path, modules_env: Any) -> None:
    p = prepare(tmp_path)
    outside = snapshot(p.outside)
    res = kvprep("revert", str(p.directory), env=modules_env)
    assert res.returncode == 0, res.stderr
    assert snapshot(p.directory) == p.pristine  # byte for byte, modes too, no .qwen-kvprep
    assert (p.folder / "cpp_kernels.py").read_bytes() == OFFICIAL_LOADER  # its original
    assert not any((p.folder / n).exists() for n in KERNEL_FILES)
    assert not (p.folder / USERS_DIRNAME).exists()
    assert snapshot(p.outside) == outside
    again = kvprep("revert", str(p.directory), env=modules_env)
    assert again.returncode == 0 and "nothing to revert" in again.stdout


def test_journal_records_relative_paths_hashes_and_the_owner(
    tmp_path: Path, modules_env: Any
) -> None:
    p = prepare(tmp_path)
    data = journal_data(p.directory)
    assert data["version"] == 2
    config = data["files"]["config.json"]
    assert config["store"] == f"originals/{config['sha256']}"
    assert sha((p.directory / ".qwen-kvprep" / config["store"]).read_bytes()) == config["sha256"]
    (group,) = data["planted"]
    assert group["root"] == str(p.modules)
    assert group["owner"]["path"] == str(p.directory)
    assert group["owner"]["ino"] == os.stat(p.directory).st_ino
    assert set(group["files"]) == {f"transformers_modules/Tiny-Chat/{n}" for n in MODULE_FILES}
    assert all(not os.path.isabs(k) for k in group["files"])


# ------------------------------------------------------------------ 1. races


RACE_WORKER = textwrap.dedent(
    """
    import random, sys
    from pathlib import Path
    from qwen_kvprep.errors import KvprepError
    from qwen_kvprep.steps.fix import FixOptions, run_fix
    from qwen_kvprep.steps.revert import revert_checkpoint

    directory, rounds, seed = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(seed)
    options = FixOptions(build=False, smoke=False, progress=False)
    for i in range(rounds):
        if rng.random() < 0.5:
            run_fix(directory, options)
        else:
            revert_checkpoint(directory)
    print("DONE")
    """
)


@pytest.mark.slow
def test_fix_and_revert_racing_never_lose_an_original(
    tmp_path: Path, shared_build_cache: Path
) -> None:
    """fix and revert on one folder at the same time, many times over, in separate
    processes: the lock serialises them, so the originals survive every interleaving and a
    final revert gives back the folder byte for byte (and empties the modules folder)."""
    from qwen_kvprep.tiny import generate_checkpoint

    ckpt = generate_checkpoint(tmp_path / "Race-Chat")
    pristine = snapshot(ckpt)
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"),
           "HF_MODULES_CACHE": str(tmp_path / "hf" / "modules"),
           "QWEN_KVPREP_CACHE": str(shared_build_cache), "HF_HUB_OFFLINE": "1"}
    workers = [
        subprocess.Popen([sys.executable, "-c", RACE_WORKER, str(ckpt), "12", str(seed)],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for seed in (1, 2, 3)
    ]
    for w in workers:
        out, err = w.communicate(timeout=600)
        assert w.returncode == 0 and "DONE" in out, err[-3000:]
        assert "Traceback" not in err
    res = kvprep("revert", str(ckpt), env=env)
    assert res.returncode == 0, res.stderr
    assert snapshot(ckpt) == pristine
    folder = tmp_path / "hf" / "modules" / "transformers_modules" / "Race-Chat"
    assert not any((folder / n).exists() for n in KERNEL_FILES)


def test_a_waiting_fix_or_revert_takes_the_lock_again_after_revert_removed_it(
    tmp_path: Path, modules_env: Any
) -> None:
    """revert removes .qwen-kvprep/ (lock file included) while holding the lock: a process
    waiting on the removed file must not think it holds the lock."""
    from qwen_kvprep.dirlock import folder_lock, lock_path

    p = prepare(tmp_path)
    holder = textwrap.dedent(
        """
        import sys, time
        from pathlib import Path
        from qwen_kvprep.dirlock import folder_lock
        from qwen_kvprep.journal.writer import remove_state_dir
        d = Path(sys.argv[1])
        with folder_lock(d, "test", 10, print):
            print("held", flush=True)
            time.sleep(1.0)
            remove_state_dir(d / ".qwen-kvprep")
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", holder, str(p.directory)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    said: list[str] = []
    with folder_lock(p.directory, "fix", 10, said.append) as locked:
        assert locked and said and "waiting for another fix" in said[0]
        assert proc.wait(timeout=10) == 0
        # we hold the lock on the file that is at the path now, not on the removed one
        held = os.stat(lock_path(p.directory))
        other = subprocess.run(
            [sys.executable, "-c",
             "import sys; from pathlib import Path; from qwen_kvprep.dirlock import folder_lock\n"
             "from qwen_kvprep.errors import LockTimeout\n"
             "try:\n"
             "    with folder_lock(Path(sys.argv[1]), 'x', 0.3, lambda m: None): print('GOT')\n"
             "except LockTimeout: print('BLOCKED')",
             str(p.directory)], capture_output=True, text=True, timeout=30)
        assert other.stdout.strip() == "BLOCKED", other.stderr
        assert os.stat(lock_path(p.directory)).st_ino == held.st_ino


def test_lock_serialises_and_creates_nothing_when_refused(tmp_path: Path) -> None:
    """The lock lives in DIR/.qwen-kvprep/, created only when a command is about to write."""
    from qwen_kvprep.dirlock import folder_lock, release_if_unused

    d = tmp_path / "m"
    d.mkdir()
    with folder_lock(d, "fix", 1, print):
        assert (d / ".qwen-kvprep" / "lock").exists()
        assert release_if_unused(d)
    assert list(d.iterdir()) == []


# ------------------------------------------------------------------ 2. originals gone


@pytest.mark.parametrize("how", ["deleted", "copy-without-state"])
def test_revert_without_the_originals_changes_nothing_and_says_how_to_recover(
    tmp_path: Path, modules_env: Any, how: str
) -> None:
    p = prepare(tmp_path)
    target = p.directory
    if how == "deleted":
        shutil.rmtree(p.directory / ".qwen-kvprep" / "originals")
    else:  # a copy that carried the journal but not originals/ (rsync --exclude, say)
        target = tmp_path / "models" / "Copy-Chat"
        shutil.copytree(p.directory, target, symlinks=True,
                        ignore=shutil.ignore_patterns("originals"))
    before = snapshot(target), snapshot(p.modules), snapshot(p.outside)
    res = kvprep("revert", str(target), env=modules_env)
    assert res.returncode == 1
    assert "Traceback" not in res.stderr and "internal error" not in res.stderr
    assert "config.json" in res.stderr and "missing" in res.stderr
    assert "nothing was changed" in res.stderr and "by hand" in res.stderr
    assert (snapshot(target), snapshot(p.modules), snapshot(p.outside)) == before
    assert (target / "config.json").exists()


def test_fix_says_that_revert_would_refuse_when_the_originals_are_gone(
    tmp_path: Path,
) -> None:
    # fix cannot bring the originals back and goes on; it must not let the user believe
    # that revert still can
    from qwen_kvprep.tiny import generate_checkpoint

    ckpt = generate_checkpoint(tmp_path / "models" / "Tiny-Chat")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"),
           "HF_MODULES_CACHE": str(tmp_path / "hf" / "modules"),
           "QWEN_KVPREP_CACHE": str(tmp_path / "build-cache"), "HF_HUB_OFFLINE": "1"}
    res = kvprep("fix", str(ckpt), "--no-build", "--no-smoke", env=env, timeout=600)
    assert res.returncode == 0, res.stderr
    res = kvprep("fix", str(ckpt), "--dry-run", "--no-build", "--no-smoke", "--json", env=env)
    assert not [f for f in json.loads(res.stdout)["findings"] if f["id"] == "state.journal"]
    shutil.rmtree(ckpt / ".qwen-kvprep" / "originals")
    res = kvprep("fix", str(ckpt), "--dry-run", "--no-build", "--no-smoke", "--json", env=env)
    assert res.returncode == 0 and "Traceback" not in res.stderr
    doc = json.loads(res.stdout)
    refusals = [f for f in doc["findings"] if f["id"] == "state.journal"]
    assert len(refusals) >= 2, doc["findings"]  # config.json, cpp_kernels.py, ...
    assert all(f["severity"] == "warn" and "would refuse" in f["message"] for f in refusals)
    assert any("config.json" in f["message"] and "missing" in f["message"] for f in refusals)
    assert all("doctor" in f["fix"] for f in refusals)


# ------------------------------------------------------------------ 3. a tampered journal


def _tamper(p: Any, how: str) -> None:
    data = journal_data(p.directory)
    files = data["files"]
    group = data["planted"][0]
    victim = str(p.outside / "victim.txt")
    if how == "dotdot":
        files["../outside/victim.txt"] = {"kind": "absent", "written": None}
    elif how == "absolute":
        files[victim] = {"kind": "absent", "written": None}
    elif how == "store-outside":
        files["config.json"]["store"] = "originals/../../outside/victim.txt"
    elif how == "planted-dotdot":
        group["files"]["../../outside/victim.txt"] = {"kind": "absent", "written": None}
    elif how == "planted-absolute":
        group["files"][victim] = {"kind": "absent", "written": None}
    elif how == "root-elsewhere":  # the recorded root is never used to resolve a path
        group["root"] = str(p.outside)
        group["files"] = {"cpp_kernels.py": {"kind": "absent", "written": None}}
    elif how in ("planted-model-code", "planted-other-model"):
        # a file of the modules cache fix never plants, claimed as fix's (its current sha256
        # in `written`): the folder's own modeling_qwen.py, or another model's code
        other = p.modules / "transformers_modules" / "Other-Chat"
        other.mkdir(parents=True, exist_ok=True)
        (other / "modeling_other.py").write_text("# someone else's model\n")
        target = (p.folder / "modeling_qwen.py" if how == "planted-model-code"
                  else other / "modeling_other.py")
        rel = str(target.relative_to(p.modules))
        digest = hashlib.sha256(target.read_bytes()).hexdigest()
        group["files"][rel] = {"kind": "absent", "written": [digest]}
    save_journal(p.directory, data)


@pytest.mark.parametrize(
    "how", ["dotdot", "absolute", "store-outside", "planted-dotdot", "planted-absolute",
            "root-elsewhere", "planted-model-code", "planted-other-model"],
)
def test_a_journal_pointing_outside_is_refused_or_confined(
    tmp_path: Path, modules_env: Any, how: str
) -> None:
    p = prepare(tmp_path)
    _tamper(p, how)
    outside = snapshot(p.outside)
    before = snapshot(p.directory), snapshot(p.modules)
    res = kvprep("revert", str(p.directory), env=modules_env)
    assert "Traceback" not in res.stderr
    assert snapshot(p.outside) == outside
    if how == "root-elsewhere":
        # a group for another modules root: its absent originals are listed, never removed
        assert res.returncode == 0, res.stderr
        assert "left" in res.stdout and str(p.outside) in res.stdout
    else:
        assert res.returncode == 1, res.stdout + res.stderr
        assert "nothing was changed" in res.stderr
        assert (snapshot(p.directory), snapshot(p.modules)) == before


@pytest.mark.parametrize("what", ["original", "originals-folder", "target-folder"])
def test_symlinks_in_the_way_are_never_followed(
    tmp_path: Path, modules_env: Any, what: str
) -> None:
    p = prepare(tmp_path)
    data = journal_data(p.directory)
    store = p.directory / ".qwen-kvprep" / data["files"]["config.json"]["store"]
    if what == "original":  # the stored original replaced by a link to a file outside
        store.unlink()
        store.symlink_to(p.outside / "victim.txt")
    elif what == "originals-folder":
        originals = p.directory / ".qwen-kvprep" / "originals"
        shutil.rmtree(originals)
        originals.symlink_to(p.outside / "dir")
    else:  # the modules folder replaced by a link out: revert would delete through it
        for name in MODULE_FILES:
            shutil.copy(p.folder / name, p.outside / "dir" / name)
        shutil.rmtree(p.folder)
        p.folder.symlink_to(p.outside / "dir")
    outside = snapshot(p.outside)
    res = kvprep("revert", str(p.directory), env=modules_env)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    assert snapshot(p.outside) == outside  # the link's target is neither deleted nor read
    assert "nothing was changed" in res.stderr


def test_a_modules_folder_replaced_by_a_link_says_to_remove_the_link(
    tmp_path: Path, modules_env: Any
) -> None:
    """The refusal names the link and says that removing it is all it takes (the modules
    cache is transformers' copy); once it is removed, revert completes."""
    p = prepare(tmp_path)
    for name in MODULE_FILES:
        shutil.copy(p.folder / name, p.outside / "dir" / name)
    shutil.rmtree(p.folder)
    p.folder.symlink_to(p.outside / "dir")
    outside = snapshot(p.outside)
    res = kvprep("revert", str(p.directory), env=modules_env)
    assert res.returncode == 1, res.stdout + res.stderr
    assert f"{p.folder} is a symbolic link now (to {p.outside / 'dir'})" in res.stderr
    assert f"Remove the link (`rm {p.folder}`" in res.stderr
    assert "Restore by hand" not in res.stderr
    p.folder.unlink()
    res = kvprep("revert", str(p.directory), env=modules_env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert snapshot(p.directory) == p.pristine
    assert snapshot(p.outside) == outside


def test_a_changed_original_is_not_restored(tmp_path: Path, modules_env: Any) -> None:
    p = prepare(tmp_path)
    data = journal_data(p.directory)
    store = p.directory / ".qwen-kvprep" / data["files"]["config.json"]["store"]
    store.write_text('{"model_type": "not what was there"}')
    before = snapshot(p.directory), snapshot(p.modules)
    res = kvprep("revert", str(p.directory), env=modules_env)
    assert res.returncode == 1
    assert "config.json" in res.stderr and "changed since fix kept it" in res.stderr
    assert (snapshot(p.directory), snapshot(p.modules)) == before


# ------------------------------------------------------------------ 4. copies


def test_reverting_a_copy_leaves_what_the_original_folder_uses(
    tmp_path: Path, modules_env: Any
) -> None:
    p = prepare(tmp_path)
    copy = tmp_path / "models" / "Tiny-Copy"
    subprocess.run(["cp", "-a", str(p.directory), str(copy)], check=True)
    planted = {n: (p.folder / n).read_bytes() for n in MODULE_FILES}
    res = kvprep("revert", str(copy), env=modules_env)
    assert res.returncode == 0, res.stderr
    assert "still prepared" in res.stdout
    assert {n: (p.folder / n).read_bytes() for n in MODULE_FILES} == planted
    assert snapshot(copy) == p.pristine  # the copy itself is restored
    # the original folder still reverts completely
    res = kvprep("revert", str(p.directory), env=modules_env)
    assert res.returncode == 0, res.stderr
    assert not any((p.folder / n).exists() for n in KERNEL_FILES)


def test_a_copy_whose_original_is_gone_reverts_the_planted_files(
    tmp_path: Path, modules_env: Any
) -> None:
    """mv across file systems is a copy and a delete: the copy is then the owner."""
    p = prepare(tmp_path)
    moved = tmp_path / "elsewhere" / "Tiny-Chat"
    moved.parent.mkdir()
    subprocess.run(["cp", "-a", str(p.directory), str(moved)], check=True)
    shutil.rmtree(p.directory)
    res = kvprep("revert", str(moved), env=modules_env)
    assert res.returncode == 0, res.stderr
    assert not any((p.folder / n).exists() for n in KERNEL_FILES)
    assert (p.folder / "cpp_kernels.py").read_bytes() == OFFICIAL_LOADER


def test_another_folder_of_the_same_name_keeps_the_planted_files(
    tmp_path: Path, modules_env: Any
) -> None:
    """/a/Tiny-Chat and /b/Tiny-Chat share transformers_modules/Tiny-Chat/."""
    a = prepare(tmp_path)
    b_root = tmp_path / "b"
    b = b_root / "Tiny-Chat"
    b.mkdir(parents=True)
    for name in ("modeling_qwen.py", "config.json", "cpp_kernels.py", *KERNEL_FILES):
        shutil.copy(a.directory / name, b / name)
    j = Journal(b)
    for name, data in MODULE_FILES.items():
        assert not j.plant(a.folder / name, data, a.modules)  # already there, identical
    j.register_user(a.folder)
    write_state(b, a.modules, a.folder)
    res = kvprep("revert", str(a.directory), env=modules_env)
    assert res.returncode == 0, res.stderr
    assert "still uses them" in res.stdout
    assert all((a.folder / n).exists() for n in KERNEL_FILES)
    res = kvprep("revert", str(b), env=modules_env)  # the last one using them
    assert res.returncode == 0, res.stderr
    assert not any((a.folder / n).exists() for n in KERNEL_FILES)


@pytest.mark.slow
def test_cp_a_of_a_fixed_tiny_checkpoint(tmp_path: Path, shared_build_cache: Path) -> None:
    """On a real fix: revert of a copy must not make DIR's model fall
    back (its modules-cache folder keeps the sources and the loader)."""
    from qwen_kvprep.tiny import generate_checkpoint

    ckpt = generate_checkpoint(tmp_path / "models" / "Tiny-Chat")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"),
           "HF_MODULES_CACHE": str(tmp_path / "hf" / "modules"),
           "QWEN_KVPREP_CACHE": str(shared_build_cache), "HF_HUB_OFFLINE": "1"}
    res = kvprep("fix", str(ckpt), "--no-build", "--no-smoke", env=env, timeout=600)
    assert res.returncode == 0, res.stderr
    folder = code_folder(tmp_path / "hf" / "modules", ckpt)
    planted = {n: (folder / n).read_bytes() for n in common.MODULE_FILES}
    copy = tmp_path / "copies" / "Tiny-Chat"  # same name: the same modules folder
    copy.parent.mkdir()
    subprocess.run(["cp", "-a", str(ckpt), str(copy)], check=True)
    res = kvprep("revert", str(copy), env=env)
    assert res.returncode == 0, res.stderr
    assert {n: (folder / n).read_bytes() for n in planted} == planted
    state = json.loads((ckpt / ".qwen-kvprep" / "state.json").read_text())
    assert state["modules"]["folder"] == str(folder)
    assert {n: sha(d) for n, d in planted.items()} == state["modules"]["files"]


LOAD = (
    "import sys; sys.dont_write_bytecode = False\n"
    "from transformers import AutoModelForCausalLM\n"
    "AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)\n"
)
MARKER = b"# >>> qwen-kvprep"


def _fixed_and_loaded(tmp_path: Path, build_cache: Path, *dirs: Path) -> dict[str, str]:
    """Each of `dirs` a tiny checkpoint, fixed and then loaded by transformers (which copies
    modeling_qwen.py with fix's lines and qwen_kvprep_compat.py into the modules cache)."""
    from qwen_kvprep.tiny import generate_checkpoint

    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"),
           "HF_MODULES_CACHE": str(tmp_path / "hf" / "modules"),
           "QWEN_KVPREP_CACHE": str(build_cache), "HF_HUB_OFFLINE": "1"}
    for ckpt in dirs:
        generate_checkpoint(ckpt)
        res = kvprep("fix", str(ckpt), "--no-build", "--no-smoke", env=env, timeout=600)
        assert res.returncode == 0, res.stderr
        load = python(LOAD, str(ckpt), env=env, timeout=600)
        assert load.returncode == 0, load.stderr[-4000:]
    return env


def _marked(modules: Path) -> list[Path]:
    return [p for p in modules.rglob("*")
            if p.is_file() and not p.is_symlink() and MARKER in p.read_bytes()]


@pytest.mark.slow
def test_revert_takes_out_the_copies_a_load_made(tmp_path: Path, shared_build_cache: Path) -> None:
    """transformers copies the changed modeling_qwen.py and qwen_kvprep_compat.py beside the
    planted files; revert (and its --dry-run list) takes them and their bytecode out, and
    leaves the user's other files there."""
    ckpt = tmp_path / "models" / "Tiny-Chat"
    env = _fixed_and_loaded(tmp_path, shared_build_cache, ckpt)
    modules = tmp_path / "hf" / "modules"
    folder = json.loads((ckpt / ".qwen-kvprep" / "state.json").read_text())["modules"]["folder"]
    copied = [Path(folder) / common.MODELING_FILE, Path(folder) / common.COMPAT_FILE]
    assert all(p.is_file() for p in copied) and _marked(modules)
    assert list(Path(folder).glob("__pycache__/modeling_qwen.*.pyc"))
    dry = kvprep("revert", str(ckpt), "--dry-run", env=env)
    assert dry.returncode == 0, dry.stderr
    assert all(str(p) in dry.stdout for p in copied)
    res = kvprep("revert", str(ckpt), env=env)
    assert res.returncode == 0, res.stderr
    assert _marked(modules) == []
    assert not any(p.exists() for p in copied)
    assert not list(modules.rglob("qwen_kvprep_*")) and not list(modules.rglob("modeling_qwen.*"))
    assert (Path(folder) / "configuration_qwen.py").is_file()  # the user's: stays


@pytest.mark.slow
def test_twin_folders_leave_no_copy_once_both_are_reverted(
    tmp_path: Path, shared_build_cache: Path
) -> None:
    a, b = tmp_path / "a" / "Tiny-Chat", tmp_path / "b" / "Tiny-Chat"
    env = _fixed_and_loaded(tmp_path, shared_build_cache, a, b)
    modules = tmp_path / "hf" / "modules"
    assert kvprep("revert", str(a), env=env).returncode == 0
    folder = json.loads((b / ".qwen-kvprep" / "state.json").read_text())["modules"]["folder"]
    assert (Path(folder) / common.COMPAT_FILE).is_file()  # b still uses its folder
    assert kvprep("revert", str(b), env=env).returncode == 0
    assert _marked(modules) == [] and not list(modules.rglob("qwen_kvprep_*"))


@pytest.mark.slow
def test_copies_not_ours_or_behind_a_link_stay(tmp_path: Path, shared_build_cache: Path) -> None:
    ckpt = tmp_path / "models" / "Tiny-Chat"
    env = _fixed_and_loaded(tmp_path, shared_build_cache, ckpt)
    folder = Path(json.loads((ckpt / ".qwen-kvprep" / "state.json").read_text())
                  ["modules"]["folder"])
    compat_copy = folder / common.COMPAT_FILE
    compat_copy.write_bytes(compat_copy.read_bytes() + b"# edited\n")
    outside = tmp_path / "outside.py"
    outside.write_bytes((folder / common.MODELING_FILE).read_bytes())
    (folder / common.MODELING_FILE).unlink()
    (folder / common.MODELING_FILE).symlink_to(outside)
    res = kvprep("revert", str(ckpt), env=env)
    assert res.returncode == 0, res.stderr
    assert compat_copy.read_bytes().endswith(b"# edited\n")
    assert (folder / common.MODELING_FILE).is_symlink() and MARKER in outside.read_bytes()


# ------------------------------------------------------------------ 5. the user's own changes


def test_a_file_changed_after_fix_is_left_by_revert_and_said(
    tmp_path: Path, modules_env: Any
) -> None:
    p = prepare(tmp_path)
    upstream = b'{"model_type": "qwen", "new": "upstream revision"}\n'
    (p.directory / "config.json").write_bytes(upstream)
    res = kvprep("revert", str(p.directory), env=modules_env)
    assert res.returncode == 0, res.stderr
    assert (p.directory / "config.json").read_bytes() == upstream
    assert "config.json changed since fix wrote it: left as it is" in res.stdout
    assert (p.directory / "cpp_kernels.py").read_bytes() == OFFICIAL_LOADER  # the rest


def test_a_new_fix_takes_the_changed_file_as_the_original(
    tmp_path: Path, modules_env: Any
) -> None:
    p = prepare(tmp_path)
    upstream = b'{"model_type": "qwen", "new": "upstream revision"}\n'
    (p.directory / "config.json").write_bytes(upstream)
    j = Journal(p.directory)
    assert j.write("config.json", b'{"patched": "again"}\n')
    assert j.retaken == [str(p.directory / "config.json")]
    assert kvprep("revert", str(p.directory), env=modules_env).returncode == 0
    assert (p.directory / "config.json").read_bytes() == upstream


def test_a_write_fix_itself_made_is_not_taken_for_the_users(
    tmp_path: Path, modules_env: Any
) -> None:
    """The loader fix wrote last time is replaced by a newer one: the original stays
    Qwen's, through any number of fixes (and a crash between journal and file)."""
    p = prepare(tmp_path)
    for i in range(10):
        Journal(p.directory).write("cpp_kernels.py", f"# loader v{i}\n".encode())
    assert kvprep("revert", str(p.directory), env=modules_env).returncode == 0
    assert (p.directory / "cpp_kernels.py").read_bytes() == OFFICIAL_LOADER


# ------------------------------------------------------------------ 7. damaged records


def _deep(n: int) -> str:
    return "[" * n + "]" * n


DAMAGE: dict[str, Callable[[Path], None]] = {
    "truncated": lambda f: f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2]),
    "empty": lambda f: f.write_bytes(b""),
    "list": lambda f: f.write_text("[1, 2, 3]"),
    "wrong-types": lambda f: f.write_text(
        json.dumps({"version": 2, "files": [], "planted": "x", "state_version": 1,
                    "files_": 3, "modules": 7})),
    "deep": lambda f: f.write_text(_deep(100_000)),
    "huge": lambda f: f.write_bytes(b" " * (3 << 20) + b"{}"),
    "not-utf8": lambda f: f.write_bytes(b'{"version": "\xff\xfe"}'),
    "fifo": lambda f: (f.unlink(), os.mkfifo(f)),  # type: ignore[func-returns-value]
}


def _doctor_json(directory: Path) -> dict[str, Any]:
    """`qwen-kvprep doctor DIR --json` through the real entry point, in this process (the
    environment probe imports torch once, not once per case)."""
    res = invoke("doctor", str(directory), "--json")
    assert "Traceback" not in res.stderr and "internal error" not in res.stderr, res.stderr
    return document(res)


@pytest.mark.parametrize("damage", sorted(DAMAGE))
@pytest.mark.parametrize("record", ["journal.json", "state.json"])
def test_damaged_records_are_findings_and_refusals_never_tracebacks(
    tmp_path: Path, modules_env: Any, record: str, damage: str,
) -> None:
    p = prepare(tmp_path)
    DAMAGE[damage](p.directory / ".qwen-kvprep" / record)
    before = snapshot(p.directory), snapshot(p.modules), snapshot(p.outside)
    doc = _doctor_json(p.directory)
    ids = {f["id"]: f for f in doc["findings"]}
    assert "env.python" in ids and "checkpoint.files" in ids  # doctor finished
    finding = ids["state.journal" if record == "journal.json" else "state.record"]
    assert finding["severity"] == "fail" and finding["fix"], finding
    assert (snapshot(p.directory), snapshot(p.modules), snapshot(p.outside)) == before
    res = kvprep("revert", str(p.directory), env=modules_env)
    assert "Traceback" not in res.stderr and "internal error" not in res.stderr
    if record == "journal.json":
        assert res.returncode == 1 and "nothing was changed" in res.stderr, res.stderr
        assert (snapshot(p.directory), snapshot(p.modules), snapshot(p.outside)) == before
    else:  # the state is not needed to revert
        assert res.returncode == 0, res.stderr
        assert snapshot(p.directory) == p.pristine


def test_prestart_treats_a_damaged_state_as_not_prepared(tmp_path: Path, modules_env: Any) -> None:
    from qwen_kvprep.quickstart import Request, state_mismatch

    p = prepare(tmp_path)
    for damage in ("truncated", "deep", "wrong-types", "fifo", "huge"):
        state = p.directory / ".qwen-kvprep" / "state.json"
        if state.exists() or state.is_symlink():
            state.unlink()
        write_state(p.directory, p.modules, p.folder)
        DAMAGE[damage](state)
        reason = state_mismatch(Request(str(p.directory)))
        assert reason is not None and "state" in reason, (damage, reason)


# ------------------------------------------------------------------ the randomised test

HOSTILE: list[Any] = [
    "../../outside/victim.txt", "/etc/passwd", "originals/../../../outside/victim.txt",
    "originals/" + "a" * 64, "", ".", "a//b", "..", "x\x00y", "C:\\x", "transformers_modules",
    "transformers_modules/Tiny-Chat/../../../outside/dir/f", 0, -1, 10**30, 1.5, True, None,
    [], {}, {"kind": "file"}, {"kind": "symlink", "target": "/"}, {"kind": "absent"},
    "x" * 5000, json.loads(_deep(200)),
]


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*prefix, i))
    return out


def _mutate(data: Any, rng: random.Random, outside: Path) -> Any:
    hostile = [*HOSTILE, str(outside / "victim.txt"), str(outside / "dir"), str(outside)]
    for _ in range(rng.randint(1, 4)):
        path = rng.choice(_paths(data))
        if not path:
            continue
        parent = data
        for key in path[:-1]:
            parent = parent[key]
        key = path[-1]
        op = rng.random()
        if op < 0.5:
            parent[key] = rng.choice(hostile)
        elif op < 0.65 and isinstance(parent, dict):
            del parent[key]
        elif op < 0.85 and isinstance(parent, dict):
            new = rng.choice([h for h in hostile if isinstance(h, str)])
            parent[new] = parent.pop(key)
        elif isinstance(parent, dict):
            parent[rng.choice(["extra", "kind", "store", "written", "root", "owner"])] = (
                rng.choice(hostile)
            )
    return data


def _mutate_file(p: Any, rng: random.Random) -> str:
    state_dir = p.directory / ".qwen-kvprep"
    choice = rng.randrange(10)
    if choice < 6:
        name = rng.choice(["journal.json", "state.json"])
        f = state_dir / name
        data = json.loads(f.read_text())
        f.write_text(json.dumps(_mutate(data, rng, p.outside)))
        return f"{name} values"
    if choice == 6:
        f = state_dir / rng.choice(["journal.json", "state.json"])
        text = f.read_bytes()
        f.write_bytes(text[: rng.randrange(len(text))])
        return f"{f.name} truncated"
    if choice == 7:
        originals = sorted((state_dir / "originals").iterdir())
        victim = rng.choice(originals)
        victim.unlink()
        victim.symlink_to(rng.choice([p.outside / "victim.txt", p.outside / "dir"]))
        return "original -> link out"
    if choice == 8:
        shutil.rmtree(p.folder)
        p.folder.symlink_to(p.outside / "dir")
        return "modules folder -> link out"
    f = state_dir / rng.choice(["journal.json", "state.json"])
    f.write_text(_deep(rng.choice([20, 1000, 50_000])))
    return f"{f.name} nested"


def test_randomised_tampering_never_escapes_and_never_crashes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Journal and state mutated at random (paths, types, sizes, nesting, links): revert,
    prestart's state check (which may plant files) and doctor's record checks run on each.
    Nothing outside DIR and the modules cache changes, and nothing raises but the one
    expected-failure hierarchy (what the CLI prints as a message, never a traceback)."""
    from qwen_kvprep.checks import load_all, run_one
    from qwen_kvprep.probe.caches import probe_caches
    from qwen_kvprep.probe.facts import Facts
    from qwen_kvprep.quickstart import Request, state_mismatch

    state_checks = [c for c in load_all().values() if c.area == "state"]
    rng = random.Random(12)
    for i in range(60):
        root = tmp_path / f"r{i}"
        root.mkdir()
        monkeypatch.setenv("HF_MODULES_CACHE", str(root / "modules"))
        p = prepare(root, build=True)
        what = _mutate_file(p, rng)
        outside = snapshot(p.outside)
        around = sorted(os.listdir(root)), sorted(os.listdir(root / "models"))
        try:
            reason = state_mismatch(Request(str(p.directory)))
            assert reason is None or isinstance(reason, str)
            facts = Facts(checkpoint=type("CP", (), {"path": p.directory})(),
                          caches=probe_caches(p.directory))
            for chk in state_checks:
                for finding in run_one(chk, facts):
                    assert "crashed" not in finding.message, (what, finding.message)
            with contextlib.suppress(KvprepError):
                revert_checkpoint(p.directory)
        except Exception as exc:  # pragma: no cover - the failure being looked for
            raise AssertionError(f"round {i} ({what}): {type(exc).__name__}: {exc}") from exc
        assert snapshot(p.outside) == outside, (i, what)
        assert (sorted(os.listdir(root)), sorted(os.listdir(root / "models"))) == around, what


def test_version_1_journals_still_revert(tmp_path: Path, modules_env: Any) -> None:
    """Folders fixed by the previous release keep working: planted paths were absolute."""
    p = prepare(tmp_path)
    data = journal_data(p.directory)
    v1: dict[str, Any] = {"version": 1, "files": {}, "planted": {}}
    for rel, entry in data["files"].items():
        v1["files"][rel] = {k: v for k, v in entry.items() if k in ("kind", "store")}
        if entry["kind"] == "file":  # version 1 kept the mode on the stored copy (copy2)
            os.chmod(p.directory / ".qwen-kvprep" / entry["store"], entry["mode"])
    for rel, entry in data["planted"][0]["files"].items():
        v1["planted"][str(p.modules / rel)] = {
            k: v for k, v in entry.items() if k in ("kind", "store")}
    save_journal(p.directory, v1)
    res = kvprep("revert", str(p.directory), env=modules_env)
    assert res.returncode == 0, res.stderr
    assert snapshot(p.directory) == p.pristine
    assert (p.folder / "cpp_kernels.py").read_bytes() == OFFICIAL_LOADER


def test_refusal_names_every_problem_for_json(tmp_path: Path, modules_env: Any) -> None:
    p = prepare(tmp_path)
    shutil.rmtree(p.directory / ".qwen-kvprep" / "originals")
    with pytest.raises(StateError) as err:
        Journal(p.directory).revert()
    assert {f.id for f in err.value.findings} == {"state.journal"}
    # config.json, cpp_kernels.py, and Qwen's cpp_kernels.py copy in the modules cache
    assert len(err.value.findings) == 3
    res = kvprep("revert", str(p.directory), "--json", env=modules_env)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    doc = json.loads(res.stdout)
    assert doc["ok"] is False and "revert refused" in doc["error"]["message"]
    assert [f["id"] for f in doc["findings"]] == ["state.journal"] * 3


@pytest.mark.parametrize("what", ["state-folder-link", "lock-fifo"])
def test_a_foreign_state_folder_or_lock_is_refused_by_the_preview_and_doctor_too(
    tmp_path: Path, modules_env: Any, what: str
) -> None:
    """revert refuses to write through them; its --dry-run (which runs every check revert
    runs) and doctor must not call the folder sound, nor prestart trust a state read there."""
    p = prepare(tmp_path)
    state = p.directory / ".qwen-kvprep"
    if what == "state-folder-link":
        shutil.move(str(state), str(p.outside / "moved-state"))
        state.symlink_to(p.outside / "moved-state")
    else:
        lock = state / "lock"
        if lock.exists():
            lock.unlink()
        os.mkfifo(lock)
    for args in (["revert", str(p.directory), "--dry-run"], ["revert", str(p.directory)]):
        res = kvprep(*args, env=modules_env, timeout=60)
        assert res.returncode == 1, (args, res.stdout + res.stderr)
        assert "refusing to write through it" in res.stderr and "Traceback" not in res.stderr
    res = kvprep("doctor", str(p.directory), "--json", env=modules_env, timeout=120)
    found = {f["id"]: f for f in json.loads(res.stdout)["findings"]}
    assert found["state.record"]["severity"] == "fail", found["state.record"]
    # the advice is what clears it (fix alone refuses to write through it, as revert does)
    removal = f"rm {state if what == 'state-folder-link' else state / 'lock'}"
    assert f"`{removal}`" in found["state.record"]["fix"], found["state.record"]
    assert res.returncode == 1


# ------------------------------------------------------------------ 9. the user's model code
# modeling_qwen.py gets marked lines from fix; every other line is the user's, also when
# they edit it after fix: revert takes out exactly the marked lines and keeps theirs.


@pytest.fixture()
def tiny(tmp_path: Path, isolated_hf: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from transformers import dynamic_module_utils as dmu

    from qwen_kvprep.tiny import generate_checkpoint

    # fix runs in this process, where transformers read the modules cache's place when it
    # was first imported: this test's private one instead
    monkeypatch.setattr(dmu, "HF_MODULES_CACHE", str(isolated_hf / "modules"))
    return generate_checkpoint(tmp_path / "Qwen", dtype="fp32")


def _fix_quick(directory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return invoke("fix", str(directory), *args, "--no-build", "--no-smoke")


def _ok(done: subprocess.CompletedProcess[str]) -> None:
    assert done.returncode == 0, done.stdout + done.stderr


USER_LINE = "USER_SETTING = 42  # the user's own line\n"


def _add_user_line(path: Path) -> str:
    """Insert the user's line after the imports at the top (away from fix's lines)."""
    text = path.read_text(encoding="utf-8")
    head, sep, rest = text.partition("\nimport ")
    assert sep, "the model code has no import line"
    edited = head + "\n" + USER_LINE.rstrip("\n") + sep + rest
    path.write_bytes(edited.encode("utf-8"))
    return edited


def _assert_only_ours_gone(path: Path, expected: bytes) -> None:
    from qwen_kvprep.common import COMPAT_FILE, FAST_FILE

    assert path.read_bytes() == expected
    assert not (path.parent / FAST_FILE).exists()
    assert not (path.parent / COMPAT_FILE).exists()


def test_an_edit_after_fix_survives_a_new_fix_and_revert(tiny: Path) -> None:
    """What prestart does when the model code changed: fix again, then revert."""
    path = tiny / "modeling_qwen.py"
    original = path.read_text(encoding="utf-8")
    _ok(_fix_quick(tiny))
    _add_user_line(path)
    _ok(_fix_quick(tiny))  # finds its lines in place: the file is left as the user made it
    assert USER_LINE in path.read_text(encoding="utf-8")
    done = invoke("revert", str(tiny))
    _ok(done)
    assert "marked lines taken out, yours kept" in done.stdout
    expected = original.replace("\nimport ", "\n" + USER_LINE + "import ", 1)
    _assert_only_ours_gone(path, expected.encode("utf-8"))


def test_revert_after_an_edit_takes_out_exactly_our_lines(tiny: Path) -> None:
    """No new fix: our block must not stay behind importing modules revert deletes."""
    from qwen_kvprep import compat

    path = tiny / "modeling_qwen.py"
    original = path.read_text(encoding="utf-8")
    _ok(_fix_quick(tiny))
    _add_user_line(path)
    with path.open("a", encoding="utf-8") as fh:
        fh.write("TAIL = 1\n")  # after our blocks
    _ok(invoke("revert", str(tiny)))
    text = path.read_text(encoding="utf-8")
    assert "qwen-kvprep:" not in text and compat.START_MARK not in text
    expected = original.replace("\nimport ", "\n" + USER_LINE + "import ", 1) + "TAIL = 1\n"
    _assert_only_ours_gone(path, expected.encode("utf-8"))
    compile(text, str(path), "exec")


def test_a_file_without_a_final_newline_comes_back_byte_for_byte(tiny: Path) -> None:
    path = tiny / "modeling_qwen.py"
    bare = path.read_text(encoding="utf-8").rstrip("\n")
    path.write_bytes(bare.encode("utf-8"))
    _ok(_fix_quick(tiny))
    _ok(_fix_quick(tiny, "--no-fast-path"))
    # the user edits a line after fix: revert keeps the edit and adds no line break
    text = path.read_text(encoding="utf-8")
    path.write_text(text.replace("\nimport ", "\n" + USER_LINE + "import ", 1), "utf-8")
    _ok(invoke("revert", str(tiny)))
    expected = bare.replace("\nimport ", "\n" + USER_LINE + "import ", 1)
    _assert_only_ours_gone(path, expected.encode("utf-8"))


@pytest.mark.parametrize("damage", ["end", "start", "inside"])
def test_edited_markers_are_refused_by_fix_and_revert_and_nothing_is_lost(
    tiny: Path, damage: str
) -> None:
    from qwen_kvprep import fastkv

    path = tiny / "modeling_qwen.py"
    _ok(_fix_quick(tiny))
    text = path.read_text(encoding="utf-8")
    if damage == "end":  # the fast path's end marker gone, the user's code after it
        cut = text.rstrip("\n").rsplit("\n", 1)[0] + "\n"
        assert text[len(cut) :] == fastkv.END + "\n"
        text = cut + "USER_AFTER = 1\n"
    elif damage == "start":
        text = text.replace(fastkv.BEGIN, "# edited by hand", 1)
    else:  # a line of the user's inside our block
        text = text.replace(fastkv.END, "USER_INSIDE = 1\n" + fastkv.END, 1)
    path.write_text(text, encoding="utf-8")
    before = snapshot(tiny)
    for _ in range(2):  # refused each time: fix is idempotent there too
        done = _fix_quick(tiny)
        assert done.returncode == 1, done.stdout + done.stderr
        assert "Traceback" not in done.stderr
        assert f"{path}, line " in done.stderr
        assert "markers back as fix wrote them" in done.stderr
        assert snapshot(tiny) == before
    done = invoke("revert", str(tiny))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "modeling_qwen.py, line " in done.stderr
    assert snapshot(tiny) == before
