"""convert's safety: DIR never written, OUT's rules, the staging folder, a killed run
finished by the same command, clear errors for a full disk and a read-only OUT folder."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from qwen_kvprep.convert import output, weights
from qwen_kvprep.convert.run import ConvertOptions, convert
from qwen_kvprep.errors import CheckpointError, FileSystemError, LockTimeout, UsageError
from qwen_kvprep.tiny import generate_checkpoint
from tests import needs
from tests.cli import document, invoke
from tests.convert_kit import bits_equal, expected_dense, load_out, load_source
from tests.needs import REPO
from tests.treesnap import snapshot

NO_VERIFY = ConvertOptions(verify=False)


@pytest.fixture()
def ckpt(tmp_path: Path) -> Path:
    return generate_checkpoint(tmp_path / "ckpt", shards=2)


def test_dir_is_never_written_even_read_only(tmp_path: Path, ckpt: Path) -> None:
    for path in [ckpt, *ckpt.iterdir()]:
        path.chmod(0o555 if path.is_dir() else 0o444)
    before = snapshot(ckpt, mtimes=True)
    try:
        convert(ckpt, tmp_path / "out", NO_VERIFY)
    finally:
        after = snapshot(ckpt, mtimes=True)
        ckpt.chmod(0o755)
    # as root the modes above stop nothing: the snapshot is the proof
    assert after == before
    assert (tmp_path / "out" / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "out"]  # no staging, no lock


def test_empty_out_folder_is_used(tmp_path: Path, ckpt: Path) -> None:
    (tmp_path / "out").mkdir()
    convert(ckpt, tmp_path / "out", NO_VERIFY)
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()


def test_out_rules(tmp_path: Path, ckpt: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(UsageError, match=r"exists and is not empty \(keep.txt\)"):
        convert(ckpt, tmp_path / "full", NO_VERIFY)
    with pytest.raises(UsageError, match="lies inside DIR"):
        convert(ckpt, ckpt / "qwen2", NO_VERIFY)
    with pytest.raises(UsageError, match=r"DIR .* lies inside OUT"):
        convert(ckpt, tmp_path, NO_VERIFY)
    (tmp_path / "link").symlink_to(ckpt)
    with pytest.raises(UsageError, match="lies inside DIR"):
        convert(ckpt, tmp_path / "link" / "x", NO_VERIFY)
    (tmp_path / "empty").mkdir()
    (tmp_path / "to-empty").symlink_to(tmp_path / "empty")
    with pytest.raises(UsageError, match="exists and is a symlink"):
        convert(ckpt, tmp_path / "to-empty", NO_VERIFY)
    with pytest.raises(UsageError, match="does not exist"):
        convert(ckpt, tmp_path / "no" / "out", NO_VERIFY)
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"


def test_not_a_qwen_v1_folder(tmp_path: Path) -> None:
    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError):
        convert(other, tmp_path / "out", NO_VERIFY)
    assert not (tmp_path / "out").exists()


def test_full_disk_before_writing(
    tmp_path: Path, ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = output.shutil.disk_usage

    def tiny_disk(path: object) -> object:
        return real(path)._replace(free=1000)  # type: ignore[arg-type]

    monkeypatch.setattr(output.shutil, "disk_usage", tiny_disk)
    with pytest.raises(FileSystemError, match="not enough space for OUT"):
        convert(ckpt, tmp_path / "out", NO_VERIFY)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_full_disk_while_writing(
    tmp_path: Path, ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []

    def full(self: weights.ShardWriter, data: object) -> None:
        calls.append(1)
        if len(calls) > 3:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        self._fh.write(data)  # type: ignore[arg-type]

    monkeypatch.setattr(weights.ShardWriter, "_write", full)
    with pytest.raises(FileSystemError, match="no space left") as info:
        convert(ckpt, tmp_path / "out", NO_VERIFY)
    assert "run the same command again" in (info.value.fix or "")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # staging removed


def test_read_only_out_folder(
    tmp_path: Path, ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def read_only(self: object, *a: object, **k: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system", str(tmp_path / "x"))

    monkeypatch.setattr(output.filelock.FileLock, "acquire", read_only)
    with pytest.raises(FileSystemError, match="read-only file system"):
        convert(ckpt, tmp_path / "out", NO_VERIFY)
    assert not (tmp_path / "out").exists()


def test_a_second_convert_of_the_same_out_is_refused(tmp_path: Path, ckpt: Path) -> None:
    import filelock

    held = filelock.FileLock(str(output.lock_of(tmp_path / "out")))
    with held, pytest.raises(LockTimeout, match="another convert is writing"):
        convert(ckpt, tmp_path / "out", NO_VERIFY)
    assert not (tmp_path / "out").exists()


_KILL_AFTER_FIRST_SHARD = """
import os, signal, sys
from pathlib import Path
from qwen_kvprep.convert import weights
from qwen_kvprep.convert.run import ConvertOptions, convert
finish = weights.ShardWriter.finish
def finish_then_die(self):
    digest = finish(self)
    os.kill(os.getpid(), signal.SIGKILL)
    return digest
weights.ShardWriter.finish = finish_then_die
convert(Path(sys.argv[1]), Path(sys.argv[2]), ConvertOptions(verify=False))
"""


def _private_shards(ckpt: Path, config: int) -> None:
    for shard in ckpt.glob("*.safetensors"):
        shard.chmod(0o600)
    (ckpt / "config.json").chmod(config)


def _killed_after_first_shard(ckpt: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _KILL_AFTER_FIRST_SHARD, str(ckpt), str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )


def test_a_killed_run_leaves_nothing_that_loads_and_the_same_command_finishes(
    tmp_path: Path, ckpt: Path
) -> None:
    out = tmp_path / "out"
    child = _killed_after_first_shard(ckpt, out)
    assert child.returncode == -9, child.stderr
    staging = output.staging_of(out)
    assert not out.exists()
    assert (staging / "model-00001-of-00002.safetensors").is_file()  # it was cut short
    assert not (staging / "config.json").exists()  # nothing a loader takes for a model
    result = invoke("convert", str(ckpt), str(out), "--no-verify")
    assert result.returncode == 0, result.stderr
    assert not staging.exists() and not output.lock_of(out).exists()
    got, exp = load_out(out), expected_dense(load_source(ckpt), 2)
    assert set(got) == set(exp) and all(bits_equal(got[n], t) for n, t in exp.items())


def test_staged_files_are_never_more_readable_than_in_out_even_after_a_kill(
    tmp_path: Path, ckpt: Path
) -> None:
    _private_shards(ckpt, config=0o640)
    out = tmp_path / "out"
    child = _killed_after_first_shard(ckpt, out)
    assert child.returncode == -9, child.stderr
    staging = output.staging_of(out)
    assert staging.stat().st_mode & 0o077 == 0, oct(staging.stat().st_mode)
    staged = {p.name: p.stat().st_mode & 0o777 for p in staging.iterdir()}
    assert {"model-00001-of-00002.safetensors", "tokenizer.json"} <= set(staged), staged
    for name, mode in staged.items():
        cap = 0o600 if name.endswith(".safetensors") else 0o640
        assert mode & ~cap == 0, (name, oct(mode))
    result = invoke("convert", str(ckpt), str(out), "--no-verify")
    assert result.returncode == 0, result.stderr
    assert out.stat().st_mode & 0o777 == 0o777 & ~output.umask()  # as a new folder gets
    (tmp_path / "admins").mkdir(mode=0o750)
    _killed_after_first_shard(ckpt, tmp_path / "admins")
    inside = output.staging_of(tmp_path / "admins")
    assert inside.parent == tmp_path / "admins" and inside.stat().st_mode & 0o077 == 0


def test_a_folder_at_the_staging_name_that_is_not_ours_is_left_alone(
    tmp_path: Path, ckpt: Path
) -> None:
    staging = output.staging_of(tmp_path / "out")
    staging.mkdir()
    (staging / "notes").write_text("someone's")
    with pytest.raises(UsageError, match="was not made by convert"):
        convert(ckpt, tmp_path / "out", NO_VERIFY)
    assert (staging / "notes").read_text() == "someone's"


def test_cli_text_json_and_exit_codes(tmp_path: Path, ckpt: Path) -> None:
    out = tmp_path / "out"
    done = invoke("convert", str(ckpt), str(out), "--no-verify")
    assert done.returncode == 0, done.stderr
    assert "exact up to 8,192 tokens" in done.stdout
    assert "27 tensors" in done.stdout
    again = invoke("convert", str(ckpt), str(out), "--no-verify", "--json")
    assert again.returncode == 0, again.stderr  # the same conversion: nothing to do
    assert document(again)["unchanged"] is True
    other = invoke("convert", str(ckpt), str(out), "--no-verify", "--json",
                   "--max-shard-size", "1MB")
    assert other.returncode == 2
    doc = document(other)
    assert doc["ok"] is False and "not empty" in doc["error"]["message"]
    ok = invoke("convert", str(ckpt), str(tmp_path / "o2"), "--no-verify", "--json",
                "--max-shard-size", "1MB")
    assert ok.returncode == 0, ok.stderr
    doc = document(ok)
    assert doc["ok"] is True and doc["exact_up_to"] == 8192 and doc["compare"]["ok"]
    assert len([f for f in doc["files"] if f["name"].endswith(".safetensors")]) == 3
    bad = invoke("convert", str(ckpt), str(tmp_path / "o3"), "--max-shard-size", "lots")
    assert bad.returncode == 2 and "5GB" in bad.stderr
    half = invoke("convert", str(ckpt), str(tmp_path / "o3"), "--max-shard-size", "0.5")
    assert half.returncode == 2 and "at least one byte" in half.stderr, half.stderr
    assert "positive" not in half.stderr  # 0.5 is positive: the words must not say it is not
    assert not os.path.exists(tmp_path / "o3")
    lost = invoke("convert", str(tmp_path / "nowhere"), str(tmp_path / "o4"))
    assert lost.returncode == 2, lost.stderr


def test_a_failed_proof_publishes_nothing(
    tmp_path: Path, ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from types import SimpleNamespace

    from qwen_kvprep.convert import run
    from qwen_kvprep.errors import RefusedError
    from qwen_kvprep.findings import fail

    seen: list[Path] = []

    def verify(src: Path, out: Path, **kw: object) -> object:
        seen.append(out)
        assert (out / "config.json").is_file()  # the staged folder, complete
        return SimpleNamespace(
            ok=False, lines=["logits differ"], checks=[fail("convert.verify", "logits differ")],
            to_json=dict,
        )

    real = run._optional
    monkeypatch.setattr(
        run, "_optional",
        lambda name: SimpleNamespace(verify=verify) if name == "verify" else real(name),
    )
    with pytest.raises(RefusedError, match="does not behave as the original") as info:
        convert(ckpt, tmp_path / "out", ConvertOptions())
    assert [f.message for f in info.value.findings] == ["logits differ"]
    assert seen == [output.staging_of(tmp_path / "out")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


# -- real file systems (root: tmpfs mounts) -------------------------------------------------


@contextlib.contextmanager
def _tmpfs(where: Path, size: str) -> Iterator[Path]:
    if not needs.is_root():
        needs.skip("root", "mounting a tmpfs (read-only or full file system) needs root")
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True, text=True)
    if done.returncode != 0:  # root without CAP_SYS_ADMIN (an unprivileged container)
        needs.skip("root", f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _remount_ro(mnt: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)


def test_real_read_only_dir_and_read_only_out_folder(tmp_path: Path, ckpt: Path) -> None:
    with _tmpfs(tmp_path / "ro-src", "64m") as src_mnt:
        src = src_mnt / "ckpt"
        shutil.copytree(ckpt, src)
        _remount_ro(src_mnt)
        before = snapshot(src, mtimes=True)
        res = invoke("convert", str(src), str(tmp_path / "out"), "--no-verify")
        assert res.returncode == 0, res.stderr
        assert snapshot(src, mtimes=True) == before
        with _tmpfs(tmp_path / "ro-out", "128m") as out_mnt:
            _remount_ro(out_mnt)
            res = invoke("convert", str(src), str(out_mnt / "qwen2"), "--no-verify")
            assert res.returncode == 1, res.stderr
            assert "read-only file system" in res.stderr and "Traceback" not in res.stderr
            assert os.listdir(out_mnt) == []


def test_real_full_disk_is_said_before_writing(tmp_path: Path, ckpt: Path) -> None:
    with _tmpfs(tmp_path / "small", "1m") as mnt:
        res = invoke("convert", str(ckpt), str(mnt / "qwen2"), "--no-verify")
        assert res.returncode == 1, res.stderr
        assert "not enough space for OUT" in res.stderr and "nothing was written" in res.stderr
        assert os.listdir(mnt) == []


@contextlib.contextmanager
def _bind(what: Path, where: Path) -> Iterator[Path]:
    if not needs.is_root():
        needs.skip("root", "a bind mount needs root")
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "--bind", str(what), str(where)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        needs.skip("root", f"cannot bind-mount here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_out_through_a_bind_mount_of_dir_is_inside_dir(tmp_path: Path, ckpt: Path) -> None:
    before = snapshot(ckpt, mtimes=True)
    with _bind(ckpt, tmp_path / "view") as view:
        res = invoke("convert", str(ckpt), str(view / "qwen2"), "--no-verify")
        assert res.returncode == 2, res.stderr
        assert "lies inside DIR" in res.stderr
        # the other way round: DIR reached through the bind of itself
        with pytest.raises(UsageError, match="lies inside DIR"):
            convert(view, ckpt / "qwen2", NO_VERIFY)
    assert snapshot(ckpt, mtimes=True) == before


def _same_model(ckpt: Path, out: Path) -> None:
    got, exp = load_out(out), expected_dense(load_source(ckpt), 2)
    assert set(got) == set(exp) and all(bits_equal(got[n], t) for n, t in exp.items())


def test_out_an_empty_mounted_volume_is_written_in_place(tmp_path: Path, ckpt: Path) -> None:
    # a volume under a roomy parent: the rename onto a mount point would fail (EBUSY)
    with _tmpfs(tmp_path / "vol", "64m") as vol:
        res = invoke("convert", str(ckpt), str(vol), "--no-verify")
        assert res.returncode == 0, res.stderr
        assert os.path.ismount(vol)
        assert not [n for n in os.listdir(vol) if n.startswith(".")]  # no staging, no lock
        assert sorted(os.listdir(tmp_path)) == ["ckpt", "vol"]
        _same_model(ckpt, vol)
    # a volume under a parent too small for the model: the space is the volume's
    with _tmpfs(tmp_path / "small", "1m") as small, _tmpfs(small / "vol", "64m") as vol:
        res = invoke("convert", str(ckpt), str(vol), "--no-verify")
        assert res.returncode == 0, res.stderr
        assert os.listdir(small) == ["vol"]
        _same_model(ckpt, vol)


def test_a_fresh_volume_holding_only_lost_found_is_an_empty_out(
    tmp_path: Path, ckpt: Path
) -> None:
    with _tmpfs(tmp_path / "vol", "64m") as vol:
        (vol / "lost+found").mkdir(mode=0o700)  # what mkfs.ext4 and mkfs.xfs leave
        res = invoke("convert", str(ckpt), str(vol), "--no-verify")
        assert res.returncode == 0, res.stderr
        assert (vol / "lost+found").is_dir()
        _same_model(ckpt, vol)
        res = invoke("convert", str(ckpt), str(vol), "--no-verify")
        assert res.returncode == 0 and "kept" in res.stdout, res.stderr
    with _tmpfs(tmp_path / "used", "64m") as used:
        (used / "lost+found").mkdir()
        (used / "notes").write_text("mine")
        res = invoke("convert", str(ckpt), str(used), "--no-verify")
        assert res.returncode == 2 and "exists and is not empty (notes)" in res.stderr
        # `rm -r` of a mount point removes lost+found, then fails: never advised
        assert f"rm -r {used}" not in res.stderr and "it is a mount point" in res.stderr
        assert "-exec rm -r --one-file-system" in res.stderr


def test_a_full_volume_at_out_is_named_not_its_parent(
    tmp_path: Path, ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = output.shutil.disk_usage

    def roomy(path: object) -> object:  # the check before writing is passed: the write fails
        return real(path)._replace(free=1 << 40)  # type: ignore[arg-type]

    with _tmpfs(tmp_path / "vol", "1m") as vol:
        monkeypatch.setattr(output.shutil, "disk_usage", roomy)
        with pytest.raises(FileSystemError) as err:
            convert(ckpt, vol, NO_VERIFY)
        assert f"no space left on the device holding {vol} " in err.value.message
        assert f"df -h {vol}`" in (err.value.fix or "")
        assert os.listdir(vol) == []


def test_an_admins_out_keeps_its_owner_and_mode_and_nothing_is_more_readable(
    tmp_path: Path, ckpt: Path
) -> None:
    _private_shards(ckpt, config=0o440)
    new = tmp_path / "new"
    convert(ckpt, new, NO_VERIFY)
    for path in new.iterdir():
        mode = path.stat().st_mode & 0o777
        cap = 0o600 if path.name.endswith((".safetensors", ".index.json")) else 0o640
        assert mode & ~cap == 0 and mode & 0o600 == 0o600, (path.name, oct(mode))
    if not needs.is_root():
        needs.skip("root", "giving OUT to another owner needs root")
    out = tmp_path / "out"
    out.mkdir()
    os.chown(out, 4321, 4321)
    out.chmod(0o2770)
    convert(ckpt, out, NO_VERIFY)
    st = out.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (4321, 4321, 0o2770)
    for path in out.iterdir():  # the folder's setgid group, as the admin meant it
        assert path.stat().st_gid == 4321, path.name
    _same_model(ckpt, out)


_KILL_AT = """
import os, signal, sys
from pathlib import Path
from qwen_kvprep.convert.run import ConvertOptions, convert
out, at = Path(sys.argv[2]).absolute(), sys.argv[3]
moved = []
def killing(real):
    def call(src, dst, *a, **k):
        if Path(dst) == out or Path(dst).parent == out and not Path(dst).name.startswith("."):
            moved.append(dst)
            if at == "renamed" or Path(dst).name == "config.json" and at == "moved":
                real(src, dst, *a, **k)  # published: killed before the claim and lock go
                os.kill(os.getpid(), signal.SIGKILL)
            if at == "rename" or at == "moves" and len(moved) == 3:  # the third into OUT
                os.kill(os.getpid(), signal.SIGKILL)
        return real(src, dst, *a, **k)
    return call
os.replace, os.rename = killing(os.replace), killing(os.rename)
convert(Path(sys.argv[1]), out, ConvertOptions(verify=False))
"""


@pytest.mark.parametrize("existing", [False, True], ids=["new-out", "existing-out"])
def test_a_kill_while_publishing_is_finished_by_the_same_command(
    tmp_path: Path, ckpt: Path, existing: bool
) -> None:
    out = tmp_path / "out"
    if existing:
        out.mkdir()
    child = subprocess.run(
        [sys.executable, "-c", _KILL_AT, str(ckpt), str(out), "moves" if existing else "rename"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert child.returncode == -9, child.stderr
    if existing:  # some files moved into OUT, the rest still staged
        assert 0 < len([n for n in os.listdir(out) if not n.startswith(".")]) < 6
    else:  # complete, but not yet renamed
        assert (output.staging_of(out) / "config.json").is_file() and not out.exists()
    result = invoke("convert", str(ckpt), str(out), "--no-verify")
    assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "out"]
    assert not [n for n in os.listdir(out) if n.startswith(".")]
    _same_model(ckpt, out)


def _files(out: Path) -> dict[str, object]:
    return {k: v for k, v in snapshot(out, mtimes=True).items() if k != "."}


@pytest.mark.parametrize("when", ["checking-dir", "taking-the-lock"])
@pytest.mark.parametrize("existing", [False, True], ids=["new-out", "existing-out"])
def test_a_convert_that_finds_out_finished_by_another_says_so_and_writes_nothing(
    tmp_path: Path, ckpt: Path, monkeypatch: pytest.MonkeyPatch, existing: bool, when: str
) -> None:
    from qwen_kvprep.convert import run
    from qwen_kvprep.errors import RefusedError

    out = tmp_path / "out"
    if existing:
        out.mkdir()
    real_read, real_write = run.read_source, run.write_weights
    real_acquire = output.filelock.FileLock.acquire
    written: list[int] = []
    finished: list[object] = []

    def another_converts() -> None:  # all of it, while this one checks DIR or waits
        monkeypatch.setattr(run, "read_source", real_read)
        monkeypatch.setattr(output.filelock.FileLock, "acquire", real_acquire)
        convert(ckpt, out, NO_VERIFY)
        finished.append(_files(out))
        monkeypatch.setattr(run, "write_weights", counting)

    def reading(*a: object, **k: object) -> object:
        another_converts()
        return real_read(*a, **k)  # type: ignore[arg-type]

    def locking(self: object, *a: object, **k: object) -> object:
        another_converts()
        return real_acquire(self, *a, **k)  # type: ignore[arg-type]

    def counting(*a: object, **k: object) -> object:
        written.append(1)
        return real_write(*a, **k)  # type: ignore[arg-type]

    if when == "checking-dir":
        monkeypatch.setattr(run, "read_source", reading)
    else:
        monkeypatch.setattr(output.filelock.FileLock, "acquire", locking)
    with pytest.raises(RefusedError, match=r"another convert finished .*nothing was written"):
        convert(ckpt, out, NO_VERIFY)
    assert finished and not written
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "out"]
    assert [_files(out)] == finished  # the other's OUT, untouched
    _same_model(ckpt, out)


@pytest.mark.parametrize("args", [
    ("--context-factor", "nan", "--rope-scaling", "yarn"),
    ("--context-factor", "inf", "--rope-scaling", "yarn"),
    ("--max-shard-size", "nan"),
    ("--max-shard-size", "inf"),
    ("--max-shard-size", "1e400GB"),
    ("--verify-timeout", "nan"),
    ("--verify-timeout", "inf"),
], ids=lambda a: " ".join(a[:2]))
def test_numbers_that_are_not_numbers_are_usage_errors(
    tmp_path: Path, ckpt: Path, args: tuple[str, ...]
) -> None:
    res = invoke("convert", str(ckpt), str(tmp_path / "out"), "--no-verify", *args)
    assert res.returncode == 2, res.stderr
    assert args[0] in res.stderr and "internal error" not in res.stderr, res.stderr
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_a_context_factor_that_is_not_a_number_is_refused_by_the_library(
    tmp_path: Path, ckpt: Path
) -> None:
    for factor in (float("nan"), float("inf")):
        with pytest.raises(UsageError, match="--context-factor"):
            convert(ckpt, tmp_path / "out", ConvertOptions(
                verify=False, context_factor=factor, rope_scaling="yarn"))
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


_KILLED_WITH_A_CHILD = """
import sys
from qwen_kvprep.childproc import run_events_child
run_events_child(lambda fd: [sys.executable, "-c",
                             "import os, signal; os.kill(os.getppid(), signal.SIGKILL)"], 60)
"""
_KILLED_IN_THE_PROOF = """
import os, signal, sys
from pathlib import Path
from qwen_kvprep.convert import verify
def killed(*a, **k):
    os.kill(os.getpid(), signal.SIGKILL)
verify.run_events_child = killed
verify.verify(Path(sys.argv[1]), Path(sys.argv[2]), timeout=60, context_factor=None)
"""
OWNER = ".qwen-kvprep-owner"  # childproc.OWNER_FILE, spelt out: what old leftovers lack
_HOLDING = """
import sys
from qwen_kvprep.childproc import owned_tempdir
with owned_tempdir(sys.argv[1]) as tmp:
    print(tmp, flush=True)
    sys.stdin.read()
"""


def test_what_a_killed_run_left_in_tmpdir_goes_with_the_next_run(
    tmp_path: Path, ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tempfile

    from qwen_kvprep import childproc
    from qwen_kvprep.convert import verify
    from tests.remote_code import transformers_release

    if transformers_release() < (4, 37):  # the proof stops at the release, before its folder
        needs.skip("transformers-4.37", "this transformers has no Qwen2ForCausalLM")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp)}
    for script, args in ((_KILLED_WITH_A_CHILD, []),
                         (_KILLED_IN_THE_PROOF, [str(ckpt), str(tmp_path / "out")])):
        done = subprocess.run([sys.executable, "-c", script, *args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == -9, done.stderr
    left = sorted(os.listdir(tmp))
    assert [n[:18] for n in left] == ["qwen-kvprep-child-", "qwen_kvprep_verify"], left
    assert (tmp / left[1] / "original" / "config.json").is_symlink()  # links to DIR's files
    # what is not ours, or not dead, stays
    (tmp / "qwen-kvprep-child-mine").mkdir()
    (tmp / "qwen-kvprep-child-mine" / "notes").write_text("mine")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / OWNER).write_text("1\n")
    (tmp / "qwen_kvprep_verify_link").symlink_to(elsewhere)
    kept = ["qwen-kvprep-child-mine", "qwen_kvprep_verify_link"]
    if needs.is_root():
        other = tmp / "qwen-kvprep-child-other-user"
        other.mkdir()
        (other / OWNER).write_text("1\n")
        os.chown(other, 4321, 4321)
        kept.append(other.name)
    holder = subprocess.Popen([sys.executable, "-c", _HOLDING, "qwen-kvprep-child-"], cwd=REPO,
                              env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        live = Path(holder.stdout.readline().strip())
        kept.append(live.name)
        before = snapshot(ckpt, mtimes=True)
        monkeypatch.setattr(tempfile, "tempdir", str(tmp))
        ran = childproc.run_events_child(lambda fd: [sys.executable, "-c", "pass"], 60)
        assert ran.returncode == 0
        monkeypatch.setattr(verify, "run_events_child", lambda *a, **k: childproc.ChildOutcome())
        assert not verify.verify(ckpt, tmp_path / "out", timeout=60, context_factor=None).ok
        assert sorted(os.listdir(tmp)) == sorted(kept)
        assert snapshot(ckpt, mtimes=True) == before
        assert (tmp / "qwen-kvprep-child-mine" / "notes").read_text() == "mine"
        assert (elsewhere / OWNER).is_file()
        assert live.is_dir()
    finally:
        holder.communicate("", timeout=60)
    assert not live.exists()


def test_what_a_killed_run_left_is_removed_without_crossing_a_mount(
    tmp_path: Path, ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tempfile

    from qwen_kvprep import childproc

    precious = tmp_path / "precious"
    (precious / "sub").mkdir(parents=True)
    (precious / "data").write_text("mine")
    (precious / "sub" / "more").write_text("mine too")
    tmp = tmp_path / "tmp"
    stale = tmp / "qwen_kvprep_verify_dead"
    stale.mkdir(parents=True)
    (stale / OWNER).write_text("1\n")  # not locked: its run was killed
    (stale / "scratch").write_text("left")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    with _bind(precious, stale / "original" / "view") as view:
        assert childproc.sweep_tempdirs("qwen_kvprep_verify_") == [stale]
        assert (view / "data").read_text() == "mine"  # the mount was not entered
        assert not (stale / "scratch").exists() and not (stale / OWNER).exists()
    # the staging folder a killed convert left, with a mount inside it: refused, not emptied
    out = tmp_path / "out"
    staging = output.staging_of(out)
    output.atomic_write_text(output.Place(out, False).claim, output._CLAIM_HEAD + "\n")
    staging.mkdir()
    (staging / "scratch").write_text("left")
    with _bind(precious, staging / "view"), pytest.raises(
        FileSystemError, match="cannot be removed entirely"
    ):
        convert(ckpt, out, NO_VERIFY)
    assert (precious / "data").read_text() == "mine"
    assert (precious / "sub" / "more").read_text() == "mine too"
    assert not out.exists()


def test_a_kill_right_after_publishing_leaves_no_claim_or_lock_after_the_rerun(
    tmp_path: Path, ckpt: Path
) -> None:
    out = tmp_path / "out"
    child = subprocess.run([sys.executable, "-c", _KILL_AT, str(ckpt), str(out), "renamed"],
                           cwd=REPO, capture_output=True, text=True, timeout=300)
    assert child.returncode == -9, child.stderr
    assert sorted(os.listdir(tmp_path)) == [".out.convert-claim", ".out.convert-lock", "ckpt",
                                            "out"]
    result = invoke("convert", str(ckpt), str(out), "--no-verify")
    assert result.returncode == 0, result.stderr
    assert "kept" in result.stdout
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "out"]
    # inside an existing OUT: every file moved in, then killed
    admins = tmp_path / "admins"
    admins.mkdir()
    child = subprocess.run([sys.executable, "-c", _KILL_AT, str(ckpt), str(admins), "moved"],
                           cwd=REPO, capture_output=True, text=True, timeout=300)
    assert child.returncode == -9, child.stderr
    assert {".qwen-kvprep-convert-claim", ".qwen-kvprep-convert-lock"} <= set(
        os.listdir(admins))
    before = {n: (admins / n).stat().st_ino for n in os.listdir(admins) if n[0] != "."}
    result = invoke("convert", str(ckpt), str(admins), "--no-verify")
    assert result.returncode == 0 and "kept" in result.stdout, result.stderr
    assert {n: (admins / n).stat().st_ino for n in os.listdir(admins)} == before
    # another convert of OUT running: its lock and claim stay
    output.atomic_write_text(output.Place(out, False).claim, output._CLAIM_HEAD + "\n")
    with output.filelock.FileLock(str(output.Place(out, False).lock)):
        assert invoke("convert", str(ckpt), str(out), "--no-verify").returncode == 0
        assert output.Place(out, False).claim.is_file()


def test_the_space_a_killed_run_holds_counts_as_free_for_the_rerun(
    tmp_path: Path, ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    child = _killed_after_first_shard(ckpt, out)
    assert child.returncode == -9, child.stderr
    staging = output.staging_of(out)
    held = sum(p.stat().st_blocks * 512 for p in staging.iterdir() if p.is_file())
    needed = sum(p.stat().st_size for p in ckpt.glob("*.safetensors")) + (32 << 20)
    real = output.shutil.disk_usage

    def disk(path: object) -> object:  # the disk holds the leftover and little more
        return real(path)._replace(free=needed - held + (64 << 10))  # type: ignore[arg-type]

    monkeypatch.setattr(output.shutil, "disk_usage", disk)
    convert(ckpt, out, NO_VERIFY)
    assert not staging.exists()
    _same_model(ckpt, out)
