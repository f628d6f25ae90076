"""The path as a server spells it, folders of one name, and what a killed command leaves
(issue 25): every spelling of DIR finds the planted files, twins leave nothing behind,
and the next command finishes or cleans what a killed one left. Kills are simulated by
fault injection (os.replace / os.unlink raising at the N-th call), never by timing."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from qwen_kvprep.common import USERS_DIRNAME
from qwen_kvprep.journal.writer import Journal
from qwen_kvprep.resources import KERNEL_FILES
from qwen_kvprep.steps.revert import revert_checkpoint
from tests.checks.facts import ckpt, facts, text, worst
from tests.remote_code import code_folder, hashed_folders
from tests.safety_kit import MODULE_FILES, OFFICIAL_LOADER, prepare, write_state


@pytest.fixture()
def modules_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    return dict(os.environ)


class Killed(BaseException):
    """A SIGKILL stand-in: nothing after it runs, not even cleanup handlers."""


@pytest.fixture()
def kill_at(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """kill_at(name, n): the n-th call of os.<name> (replace or unlink) 'kills' the process;
    from then on every os.replace and os.unlink does too (a dead process cleans nothing)."""
    real: dict[str, Callable[..., Any]] = {"replace": os.replace, "unlink": os.unlink}
    state = {"dead": False}

    def arm(name: str, n: int) -> None:
        calls = {"n": 0}
        state["dead"] = False  # a new process

        def wrap(fn_name: str) -> Any:
            def fn(*args: Any, **kw: Any) -> Any:
                if state["dead"]:
                    raise Killed()
                if fn_name == name:
                    calls["n"] += 1
                    if calls["n"] == n:
                        state["dead"] = True
                        raise Killed()
                return real[fn_name](*args, **kw)

            return fn

        monkeypatch.setattr(os, "replace", wrap("replace"))
        monkeypatch.setattr(os, "unlink", wrap("unlink"))

    yield arm
    monkeypatch.setattr(os, "replace", real["replace"])
    monkeypatch.setattr(os, "unlink", real["unlink"])


def _twin(a: Any, tmp_path: Path, loader: bytes) -> Path:
    """/b/<name>, prepared after a with its own loader, planted into a's folder."""
    b: Path = tmp_path / "b" / a.directory.name
    b.mkdir(parents=True)
    for name in ("modeling_qwen.py", "config.json", *KERNEL_FILES):
        shutil.copy(a.directory / name, b / name)
    j = Journal(b)
    j.write("cpp_kernels.py", loader)
    for name, data in {**MODULE_FILES, "cpp_kernels.py": loader}.items():
        j.plant(a.folder / name, data, a.modules)
    j.register_user(a.folder)
    write_state(b, a.modules, a.folder)
    return b


# ------------------------------------------------------------------ 2. twins


@pytest.mark.parametrize("first", ["a", "b"])
def test_twins_with_their_own_loaders_leave_nothing_after_both_reverted(
    tmp_path: Path, modules_env: Any, first: str
) -> None:
    a = prepare(tmp_path)  # the folder held Qwen's own cpp_kernels.py before either fix
    b_loader = b"# qwen-kvprep loader (b's)\n"
    b = _twin(a, tmp_path, b_loader)
    assert (a.folder / "cpp_kernels.py").read_bytes() == b_loader  # b planted last
    order = [a.directory, b] if first == "a" else [b, a.directory]
    revert_checkpoint(order[0])
    # the other one still prepared: it finds its own loader there
    other = order[1]
    assert all((a.folder / n).exists() for n in KERNEL_FILES)
    assert (a.folder / "cpp_kernels.py").read_bytes() == (other / "cpp_kernels.py").read_bytes()
    revert_checkpoint(order[1])
    assert not any((a.folder / n).exists() for n in KERNEL_FILES)
    assert (a.folder / "cpp_kernels.py").read_bytes() == OFFICIAL_LOADER  # the true original
    assert not (a.folder / USERS_DIRNAME).exists()


def test_a_twin_replanting_over_the_others_copy_does_not_take_it_for_the_users(
    tmp_path: Path, modules_env: Any
) -> None:
    a = prepare(tmp_path)
    b = _twin(a, tmp_path, b"# qwen-kvprep loader (b's)\n")
    j = Journal(a.directory)  # a's fix again, over b's copy
    assert j.plant(a.folder / "cpp_kernels.py", MODULE_FILES["cpp_kernels.py"], a.modules)
    assert not j.retaken
    revert_checkpoint(b)
    revert_checkpoint(a.directory)
    assert (a.folder / "cpp_kernels.py").read_bytes() == OFFICIAL_LOADER
    assert not any((a.folder / n).exists() for n in KERNEL_FILES)


# ------------------------------------------------------------------ 3. debris


def test_a_fix_through_a_symlink_and_a_revert_through_the_real_path_leave_no_marker(
    tmp_path: Path, modules_env: Any
) -> None:
    p = prepare(tmp_path)
    link = tmp_path / "link"
    link.symlink_to(p.directory)
    Journal(link).register_user(p.folder)  # what a fix or prestart by the link records
    assert len(os.listdir(p.folder / USERS_DIRNAME)) == 2
    revert_checkpoint(p.directory)
    assert not (p.folder / USERS_DIRNAME).exists()
    assert not any((p.folder / n).exists() for n in KERNEL_FILES)


def test_a_plant_killed_at_its_rename_leaves_a_temp_the_next_revert_removes(
    tmp_path: Path, modules_env: Any, kill_at: Any
) -> None:
    p = prepare(tmp_path)
    j = Journal(p.directory)
    kill_at("replace", 2)  # the journal's own save is the first rename
    with pytest.raises(Killed):
        j.plant(p.folder / KERNEL_FILES[0], b"// a newer binding\n", p.modules)
    kill_at("replace", 10**9)  # alive again: a new process
    temps = [n for n in os.listdir(p.folder) if n.endswith(".tmp")]
    assert temps, os.listdir(p.folder)
    old = time.time() - 3600
    for n in temps:
        os.utime(p.folder / n, (old, old))
    f = facts(checkpoint=ckpt(path=p.directory), cache=_caches(p.directory))
    assert "killed" in text("state.record", f)
    result = revert_checkpoint(p.directory)
    assert set(temps) <= set(result.temps)
    assert not [n for n in os.listdir(p.folder) if n.endswith(".tmp")]


def test_a_revert_killed_in_its_last_steps_is_finished_by_the_next(
    tmp_path: Path, modules_env: Any, kill_at: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = prepare(tmp_path)
    state_dir = p.directory / ".qwen-kvprep"
    import qwen_kvprep.journal.writer as journal_mod

    def killed_rmtree(state: Path) -> None:
        os.unlink(state / "journal.json")  # the first thing rmtree happened to remove
        raise Killed()

    monkeypatch.setattr(journal_mod, "remove_state_dir", killed_rmtree)
    with pytest.raises(Killed):
        revert_checkpoint(p.directory)
    monkeypatch.undo()
    assert (state_dir / "state.json").exists() and (state_dir / "lock").exists()
    f = facts(checkpoint=ckpt(path=p.directory), cache=_caches(p.directory))
    assert worst("state.record", f).value == "fail"
    assert "revert was cut short" in text("state.record", f)
    result = revert_checkpoint(p.directory)
    assert str(state_dir / "state.json") in result.finished
    assert not state_dir.exists()


def test_a_revert_killed_once_the_files_are_back_is_a_failure_until_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kill_at: Any
) -> None:
    """Kill a revert at each of its unlinks: whenever every file is back as it was but the
    records are still there, doctor fails them and names the revert that finishes the
    job; that revert leaves nothing."""
    from tests.treesnap import snapshot

    struck = 0
    for n in range(1, 60):
        root = tmp_path / f"unlink-{n}"
        monkeypatch.setenv("HF_MODULES_CACHE", str(root / "modules"))
        p = prepare(root)
        state_dir = p.directory / ".qwen-kvprep"
        kill_at("unlink", n)
        try:
            revert_checkpoint(p.directory)
            killed = False
        except Killed:
            killed = True
        kill_at("unlink", 10**9)  # alive again
        files = {k: v for k, v in snapshot(p.directory).items() if ".qwen-kvprep" not in k}
        records = [n for n in ("journal.json", "state.json") if (state_dir / n).exists()]
        if records and files == {k: v for k, v in p.pristine.items()}:
            struck += 1
            f = facts(checkpoint=ckpt(path=p.directory), cache=_caches(p.directory))
            assert worst("state.record", f).value == "fail", (n, records)
            said = text("state.record", f)
            assert f"qwen-kvprep revert {p.directory}" in said, said
        revert_checkpoint(p.directory)
        assert not state_dir.exists(), n
        assert snapshot(p.directory) == p.pristine, n
        if not killed:
            break  # n is past the last unlink: every point was tried
    else:
        pytest.fail("the revert made more unlinks than tried")
    assert struck >= 2  # the state removed first, then the originals, the journal last


def _caches(directory: Path) -> Any:
    from qwen_kvprep.probe.caches import probe_caches

    return probe_caches(directory)


# ------------------------------------------------------------------ 1. spellings


def test_every_spelling_of_the_folder_is_planted_into(tmp_path: Path) -> None:
    from qwen_kvprep.modcache import spelling_folders, transformers_root
    from qwen_kvprep.tiny import generate_checkpoint

    real = generate_checkpoint(tmp_path / "models" / "Qwen-Chat")
    root = transformers_root()
    # `DIR/` runs from transformers_modules/ itself; transformers 5 names the folder after
    # the normalised path, so there `DIR/` is DIR
    slash = [] if hashed_folders() else [code_folder(root, real, "")]
    assert [f for f, _ in spelling_folders(real)] == slash
    link = tmp_path / "current"
    link.symlink_to(real)
    by_real_path = code_folder(root, real, "Qwen-Chat")
    assert [f for f, _ in spelling_folders(link)] == [*slash, by_real_path]


def test_doctor_judges_the_folder_a_trailing_slash_loads_from(tmp_path: Path) -> None:
    from qwen_kvprep.probe.caches import SLASH_SPELLING, module_folder_candidates

    root = tmp_path / "modules"
    cands = dict((how, p) for p, how in module_folder_candidates(tmp_path / "Qwen", root))
    assert cands[SLASH_SPELLING] == root / "transformers_modules"


@pytest.mark.slow
def test_fix_with_a_trailing_slash_runs_the_kernel_by_every_spelling(
    tmp_path: Path, isolated_hf: Path
) -> None:
    from qwen_kvprep.tiny import generate_checkpoint
    from tests.cli import kvprep

    model = tmp_path / "m" / "Qwen"
    generate_checkpoint(model)
    link = tmp_path / "serving"
    link.symlink_to(model)
    res = kvprep("fix", f"{model}/", "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert doc["smoke"]["kernel_layers"] >= 1
    spellings = [(".", model), ("./Qwen", model.parent), ("Qwen/../Qwen", model.parent)]
    if not hashed_folders():
        # a link with a slash runs from transformers_modules/ itself, as `DIR/` does;
        # transformers 5 runs it from the link's own name, which fix cannot know
        spellings.append((f"{link}/", tmp_path))
    for spelt, cwd in spellings:
        res = kvprep("smoke", spelt, "--json", cwd=cwd)
        assert res.returncode == 0, (spelt, res.stdout, res.stderr)
        assert json.loads(res.stdout)["smoke"]["kernel_layers"] >= 1, spelt
    res = kvprep("revert", str(model))
    assert res.returncode == 0, res.stderr


# ------------------------------------------------------------------ 4, 5. messages


FILES = ("config.json",)


def test_config_refusals_claim_transformers_only_where_checked() -> None:
    too_big = ckpt(config=None, files=FILES, config_error="cannot read config.json: is "
                   "52,428,800 bytes, more than the 16,777,216 allowed")
    for kind, said in ((None, "refuses it as a model config"), ("size", "would read it whole")):
        said_of = text("config.parse", facts(checkpoint=replace(too_big, config_error_kind=kind)))
        assert "qwen-kvprep refuses it" in said_of and said in said_of
        assert "not a valid JSON file" not in said_of
    syntax = ckpt(config=None, config_error="config.json is not valid JSON: x at line 2",
                  files=FILES, config_error_line=2, config_error_kind="json")
    assert "not a valid JSON file" in text("config.parse", facts(checkpoint=syntax))


@pytest.mark.parametrize(
    ("content", "kind"),
    [
        (b'{"model_type": "qwen",,}', "json"),
        (b'{"model_type": "qw\xe9n"}', "json"),
        (b'{"model_type": "qwen", "n": ' + b"9" * 5000 + b"}", "digits"),
        (b'{"model_type": "qwen", "pad": "' + b"x" * (17 << 20) + b'"}', "size"),
        (b'{"model_type": "qwen", "a": 1, "a": 2}', None),
    ],
)
def test_the_kind_of_a_refused_config_is_what_was_checked_against_transformers(
    tmp_path: Path, content: bytes, kind: str
) -> None:
    from qwen_kvprep.probe.checkpoint import probe_checkpoint

    (tmp_path / "config.json").write_bytes(content)
    cp = probe_checkpoint(tmp_path)
    assert cp.config is None and cp.config_error_kind == kind, cp.config_error


def test_a_full_disk_during_a_build_says_so_where_and_how_much(tmp_path: Path) -> None:
    from qwen_kvprep.buildcache import CacheLayout
    from qwen_kvprep.buildcache.builder import _failure

    log = tmp_path / "build.log"
    log.write_text("/usr/bin/ld: final link failed: No space left on device\n")
    plan = type("Plan", (), {"key": "k" * 64, "mode": "CPU-only build"})()
    layout = CacheLayout(tmp_path / "cache")
    layout.logs.mkdir(parents=True)
    layout.tmp.mkdir(parents=True)
    err = _failure(plan, layout, log, {"ok": False, "stage": "build"})
    assert "the disk is full" in err.message and str(layout.tmp) in err.message
    assert "MiB free" in err.message
    assert err.fix is not None and "GiB" in err.fix


def test_identical_twins_put_back_what_was_there_before_either(
    tmp_path: Path, modules_env: Any
) -> None:
    a = prepare(tmp_path)  # the folder held Qwen's own cpp_kernels.py before
    b = _twin(a, tmp_path, MODULE_FILES["cpp_kernels.py"])  # the same bytes as a's
    revert_checkpoint(a.directory)
    revert_checkpoint(b)
    assert (a.folder / "cpp_kernels.py").read_bytes() == OFFICIAL_LOADER
    assert not any((a.folder / n).exists() for n in KERNEL_FILES)


def test_records_of_folders_no_longer_prepared_are_reported_and_dropped(
    tmp_path: Path, modules_env: Any
) -> None:
    p = prepare(tmp_path)
    gone = tmp_path / "gone" / p.directory.name
    gone.mkdir(parents=True)
    (gone / ".qwen-kvprep").mkdir()
    (gone / ".qwen-kvprep" / "state.json").write_text("{}")
    Journal(gone).register_user(p.folder)
    shutil.rmtree(gone)  # removed without revert
    f = facts(checkpoint=ckpt(path=p.directory), cache=_caches(p.directory))
    assert "removed without revert" in text("state.record", f)
    Journal(p.directory).register_user(p.folder)  # the next fix or prestart drops it
    assert len(os.listdir(p.folder / USERS_DIRNAME)) == 1


def test_a_record_survives_another_fix_pruning_the_empty_records_folder(
    tmp_path: Path, modules_env: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two checkpoints' fixes share transformers_modules/ itself (the `DIR/` spelling): the
    # other one's prune removes the records folder in the instant it is still empty.
    from qwen_kvprep.journal import writer

    p = prepare(tmp_path)
    shutil.rmtree(p.folder / USERS_DIRNAME)  # this checkpoint registers for the first time
    real = writer.atomic_write_text
    pruned = []

    def racing(path: Path, text: str) -> None:
        if not pruned:
            pruned.append(path)
            assert writer.prune_users(p.folder) == []
            assert not path.parent.exists()
        real(path, text)

    monkeypatch.setattr(writer, "atomic_write_text", racing)
    Journal(p.directory).register_user(p.folder)
    assert pruned
    assert os.listdir(p.folder / USERS_DIRNAME) == [pruned[0].name]


def test_a_fresh_container_gets_every_spelling_planted_by_the_fast_path(
    tmp_path: Path, modules_env: Any
) -> None:
    from qwen_kvprep.quickstart import Planting, Request, state_mismatch
    from tests.safety_kit import fake_build

    p = prepare(tmp_path)
    package = p.modules / "transformers_modules"
    write_state(p.directory, p.modules, p.folder, fake_build(tmp_path / "b"))
    state = json.loads((p.directory / ".qwen-kvprep" / "state.json").read_text())
    state["modules"]["also"] = [str(package)]
    (p.directory / ".qwen-kvprep" / "state.json").write_text(json.dumps(state))
    shutil.rmtree(p.modules)  # a fresh container: an empty modules cache
    planting = Planting()
    assert state_mismatch(Request(str(p.directory)), planting) is None
    assert all((package / n).is_file() for n in MODULE_FILES)
    assert all((p.folder / n).is_file() for n in MODULE_FILES)
    # the same folder by a symlink whose name fix planted for is the same prepared folder
    link = tmp_path / "elsewhere"
    link.mkdir()
    (link / p.directory.name).symlink_to(p.directory)
    assert state_mismatch(Request(str(link / p.directory.name))) is None
    other = tmp_path / "serving"
    other.symlink_to(p.directory)  # a name fix did not plant for: prepared again
    assert "recorded for" in str(state_mismatch(Request(str(other))))


def test_the_fast_path_records_its_use_though_another_fix_prunes_the_records_folder(
    tmp_path: Path, modules_env: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qwen_kvprep import quickstart
    from tests.safety_kit import fake_build

    p = prepare(tmp_path)
    write_state(p.directory, p.modules, p.folder, fake_build(tmp_path / "b"))
    shutil.rmtree(p.modules)  # a fresh container: an empty modules cache
    real_open = os.open
    pruned = []

    def racing_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if path == USERS_DIRNAME and not pruned:  # right after its mkdir, as a prune does
            pruned.append(path)
            os.rmdir(USERS_DIRNAME, dir_fd=kwargs["dir_fd"])
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(quickstart.os, "open", racing_open)
    assert quickstart.state_mismatch(quickstart.Request(str(p.directory))) is None
    monkeypatch.undo()
    assert pruned
    assert len(os.listdir(p.folder / USERS_DIRNAME)) == 1


def test_a_build_whose_compiler_hits_a_full_disk_is_refused_with_where_and_how_much(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC injected where the compiler writes (the worker), not by filling a disk."""
    import errno

    from qwen_kvprep.buildcache import CacheLayout, builder
    from qwen_kvprep.errors import BuildError
    from qwen_kvprep.resources import kernels_dir

    def full_disk(spec_path: Path, log: Any, env: Any, cwd: Path) -> None:
        spec = json.loads(Path(spec_path).read_text())
        error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(cwd / "x.o"))
        log.write(f"c++ -c x.cpp -o x.o\nfatal error: {error}\n".encode())
        Path(spec["result"]).write_text(json.dumps({"ok": False, "stage": "build",
                                                    "error": str(error)}))

    monkeypatch.setattr(builder, "_run_worker", full_disk)
    sources = {n: (kernels_dir() / n).read_bytes() for n in KERNEL_FILES[:1]}
    layout = CacheLayout(tmp_path / "cache")
    with pytest.raises(BuildError) as info:
        builder.ensure_build(builder.plan_build(sources), layout)
    assert "the disk is full" in info.value.message
    assert str(layout.tmp) in info.value.message and "MiB free" in info.value.message
    assert info.value.fix is not None and "1 GiB" in info.value.fix


def test_transformers_copy_of_our_loader_is_not_kept_as_an_original(
    tmp_path: Path, modules_env: Any
) -> None:
    """A load by a symlink copied the checkpoint's loader into the link's folder before
    fix was run by that link: revert removes it instead of bringing it back."""
    from tests.safety_kit import LOADER

    p = prepare(tmp_path)
    cur = p.modules / "transformers_modules" / "cur"
    cur.mkdir()
    (cur / "cpp_kernels.py").write_bytes(LOADER)  # transformers' copy of ours
    j = Journal(p.directory)
    renewed = b"# qwen-kvprep loader (rendered for the link)\n"
    j.write("cpp_kernels.py", renewed)
    j.plant(cur / "cpp_kernels.py", renewed, p.modules)
    j.register_user(cur)
    revert_checkpoint(p.directory)
    assert not (cur / "cpp_kernels.py").exists()
    assert (p.folder / "cpp_kernels.py").read_bytes() == OFFICIAL_LOADER


@pytest.mark.parametrize(
    ("spelt", "version", "fails"),
    [
        ("/m/Qwen", "4.37.2", False),
        ("/m/Qwen/", "4.32.1", False),  # loads (from transformers_modules/ itself)
        ("/m/Qwen/.", "4.37.2", True),  # measured: ModuleNotFoundError
        (".", "4.38.2", True),
        (".", "4.39.0", False),  # normalised from 4.39 on (read in its source)
        ("./", "4.53.3", False),
        (".", None, False),  # unknown version: nothing claimed
        ("/m/Qwen/sub/..", "4.53.3", True),  # measured: ImportError
        ("../", "4.32.1", True),
    ],
)
def test_the_spellings_transformers_cannot_load(
    spelt: str, version: Any, fails: bool
) -> None:
    from qwen_kvprep.common import spelling_problem

    assert (spelling_problem(spelt, version) is not None) == fails


def test_doctor_says_plainly_that_a_spelling_cannot_load() -> None:
    from tests.checks.facts import env_facts

    for spelt, version in (("Qwen/sub/..", "4.53.3"), (".", "4.37.2")):
        f = facts(env=env_facts(transformers_version=version), checkpoint=ckpt(spelt=spelt))
        assert worst("checkpoint.dirname", f).value == "fail"
        said = text("checkpoint.dirname", f)
        assert "its own path" in said and "transformers_modules." in said
    ok_facts = facts(env=env_facts(transformers_version="4.53.3"), checkpoint=ckpt(spelt="."))
    assert worst("checkpoint.dirname", ok_facts).value == "ok"


@pytest.mark.parametrize("call", ["replace", "unlink"])
def test_a_revert_killed_at_any_write_is_finished_by_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kill_at: Any, call: str
) -> None:
    """Kill the revert of one of two folders of the same name at its 1st, 2nd, ... rename
    or unlink; the next revert (and then the other folder's) leaves nothing of either."""
    for n in range(1, 40):
        root = tmp_path / f"{call}-{n}"
        monkeypatch.setenv("HF_MODULES_CACHE", str(root / "modules"))
        a = prepare(root)
        b = _twin(a, root, b"# qwen-kvprep loader (b's)\n")
        kill_at(call, n)
        try:
            revert_checkpoint(a.directory)
            killed = False
        except Killed:
            killed = True
        kill_at(call, 10**9)  # alive again
        revert_checkpoint(a.directory)
        revert_checkpoint(b)
        assert not (a.directory / ".qwen-kvprep").exists(), n
        assert not (b / ".qwen-kvprep").exists(), n
        assert (a.folder / "cpp_kernels.py").read_bytes() == OFFICIAL_LOADER, n
        assert not any((a.folder / f).exists() for f in KERNEL_FILES), n
        assert not (a.folder / USERS_DIRNAME).exists(), n
        assert not [f for f in os.listdir(a.folder) if f.endswith(".tmp")], n
        if not killed:
            assert n > 1, f"no {call} call: the kill never struck"
            break  # n is past the last write: every point was tried
    else:
        pytest.fail("the revert made more writes than tried")


def test_a_fix_of_a_twin_killed_at_any_write_leaves_nothing_after_both_reverts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kill_at: Any
) -> None:
    """Every write of fix's journal and plants is a rename (it unlinks nothing here)."""
    call = "replace"
    for n in range(1, 40):
        root = tmp_path / f"{call}-{n}"
        monkeypatch.setenv("HF_MODULES_CACHE", str(root / "modules"))
        a = prepare(root)
        kill_at(call, n)
        try:
            b = _twin(a, root, b"# qwen-kvprep loader (b's)\n")
            killed = False
        except Killed:
            b = root / "b" / a.directory.name
            killed = True
        kill_at(call, 10**9)
        old = time.time() - 60  # what the kill left is past the modules cache's grace
        for folder in (a.folder, a.folder / USERS_DIRNAME):
            for name in os.listdir(folder) if folder.is_dir() else []:
                os.utime(folder / name, (old, old), follow_symlinks=False)
        revert_checkpoint(a.directory)
        revert_checkpoint(b)
        assert (a.folder / "cpp_kernels.py").read_bytes() == OFFICIAL_LOADER, n
        assert not any((a.folder / f).exists() for f in KERNEL_FILES), n
        assert not (a.folder / USERS_DIRNAME).exists(), n
        assert not [f for f in os.listdir(a.folder) if f.endswith(".tmp")], n
        assert not (b / ".qwen-kvprep").exists(), n
        if not killed:
            assert n > 1, f"no {call} call: the kill never struck"
            break
    else:
        pytest.fail("the fix made more writes than tried")
