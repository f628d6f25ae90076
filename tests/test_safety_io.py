"""The inputs and the outputs: a tampered state.json, FIFOs, read-only and full
file systems, permissions, leftover temporary files, invalid config.json, prestart's CMD,
secrets in output, quoting, and huge files. Each case: a clear error or the right thing,
nothing outside DIR and the modules cache touched, no traceback."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from qwen_kvprep import hubcli
from qwen_kvprep.quickstart import Request, state_mismatch
from qwen_kvprep.resources import KERNEL_FILES
from tests import needs
from tests.cli import ENTRY, invoke, kvprep
from tests.safety_kit import MODULE_FILES, prepare, sha
from tests.treesnap import snapshot

ROOT_ONLY = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root: mounts a tmpfs (read-only or full file system)"
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from qwen_kvprep.tiny import generate_checkpoint

    return generate_checkpoint(tmp_path_factory.mktemp("tiny") / "Tiny-Chat")


@pytest.fixture()
def env(tmp_path: Path, shared_build_cache: Path) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith("QWEN_KVPREP_")}
    out.update(HF_HOME=str(tmp_path / "hf"), HF_MODULES_CACHE=str(tmp_path / "hf" / "modules"),
               QWEN_KVPREP_CACHE=str(shared_build_cache), HF_HUB_OFFLINE="1")
    return out


def copy_of(template: Path, where: Path) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    dest = where / template.name
    shutil.copytree(template, dest, symlinks=True)
    return dest


def no_traceback(res: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in res.stderr, res.stderr
    assert "internal error" not in res.stderr, res.stderr


# ------------------------------------------------------------------ 6. a tampered state.json


@pytest.mark.parametrize(
    "tamper",
    ["folder-outside", "hub-outside", "name-dotdot", "name-absolute", "root-relative",
     "folder-link-out"],
)
def test_a_tampered_state_never_makes_prestart_write_outside_the_modules_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tamper: str
) -> None:
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    p = prepare(tmp_path, build=True)
    for name in MODULE_FILES:  # a fresh container: nothing planted yet
        (p.folder / name).unlink()
    state = json.loads((p.directory / ".qwen-kvprep" / "state.json").read_text())
    modules = state["modules"]
    target = p.outside / "planted-here"
    if tamper == "folder-outside":
        modules["folder"] = str(target)
    elif tamper == "hub-outside":
        modules["hub_folder"] = str(p.modules / ".." / "outside" / "planted-here")
    elif tamper == "name-dotdot":
        modules["files"]["../../../outside/x.cpp"] = modules["files"][KERNEL_FILES[0]]
    elif tamper == "name-absolute":
        modules["files"][str(p.outside / "x.cpp")] = modules["files"][KERNEL_FILES[0]]
    elif tamper == "root-relative":
        modules["root"] = "modules"
    elif tamper == "folder-link-out":  # the state is sound; the folder is a link out
        shutil.rmtree(p.folder)
        p.folder.symlink_to(p.outside / "dir")
    (p.directory / ".qwen-kvprep" / "state.json").write_text(json.dumps(state))
    outside = snapshot(p.outside)
    reason = state_mismatch(Request(str(p.directory)))
    assert reason is not None
    assert snapshot(p.outside) == outside
    res = kvprep("prestart", str(p.directory), "--allow-fallback", "--", "true",
                 env=dict(os.environ))
    no_traceback(res)
    assert snapshot(p.outside) == outside


def test_a_sound_state_plants_into_a_fresh_modules_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The confinement does not stop the fast path's real job (and registers the user)."""
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    p = prepare(tmp_path, build=True)
    fresh = tmp_path / "fresh-modules"
    monkeypatch.setenv("HF_MODULES_CACHE", str(fresh))
    assert state_mismatch(Request(str(p.directory))) is None
    folder = fresh / "transformers_modules" / "Tiny-Chat"
    for name, data in MODULE_FILES.items():
        assert sha((folder / name).read_bytes()) == sha(data)
    assert [p.name for p in (folder / ".qwen-kvprep-users").iterdir()]
    assert not [n for n in os.listdir(folder) if n.endswith(".tmp")]


# ------------------------------------------------------------------ 8. FIFOs


@pytest.mark.parametrize("name", ["config.json", "cpp_kernels.py", KERNEL_FILES[1]])
def test_a_fifo_never_makes_prestart_doctor_or_fix_hang(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    p = prepare(tmp_path, build=True)
    (p.directory / name).unlink()
    os.mkfifo(p.directory / name)
    assert "changed" in (state_mismatch(Request(str(p.directory))) or "")
    for args in (["prestart", str(p.directory), "--", "true"],
                 ["doctor", str(p.directory)],
                 ["fix", str(p.directory), "--no-build", "--no-smoke"]):
        start = time.monotonic()
        res = kvprep(*args, env=dict(os.environ), timeout=60)  # a hang fails here
        assert time.monotonic() - start < 60
        no_traceback(res)
        assert res.returncode == 1, (args, res.stdout, res.stderr)
        text = res.stdout + res.stderr
        assert f"{name} is a FIFO (named pipe), not a regular file" in text, text
    assert (p.directory / name).is_fifo()


def test_regular_file_reads_refuse_without_blocking(tmp_path: Path) -> None:
    from qwen_kvprep.common import sha256_file, sha256_small
    from qwen_kvprep.untrusted import NotRegularFile, read_regular

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert sha256_small(str(fifo)) is None
    with pytest.raises(NotRegularFile):
        read_regular(fifo)
    with pytest.raises(NotRegularFile):
        sha256_file(fifo)
    with pytest.raises(NotRegularFile):
        read_regular(tmp_path)


# ------------------------------------------------------------------ 9. OS errors


@contextlib.contextmanager
def tmpfs(where: Path, size: str, ro: bool = False) -> Iterator[Path]:
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True, text=True)
    if done.returncode != 0:  # root without CAP_SYS_ADMIN (an unprivileged container)
        needs.skip("root", f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(mnt: Path) -> None:
    """Take every byte left on the file system."""
    fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"\0" * 4096)
    finally:
        os.close(fd)


@ROOT_ONLY
def test_a_read_only_dir_names_output(tiny: Path, tmp_path: Path, env: dict[str, str]) -> None:
    with tmpfs(tmp_path / "ro", "64m") as mnt:
        ckpt = copy_of(tiny, mnt)
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        before = snapshot(ckpt)
        res = kvprep("fix", str(ckpt), "--no-build", "--no-smoke", env=env, timeout=300)
        no_traceback(res)
        assert res.returncode == 1
        assert "read-only file system" in res.stderr and "--output" in res.stderr
        res = kvprep("prestart", str(ckpt), "--", "true", env=env, timeout=300)
        no_traceback(res)
        assert res.returncode == 1 and "--output" in res.stderr
        assert snapshot(ckpt) == before
        # and --output works: the way out the message names
        out = tmp_path / "view" / "Tiny-Chat"
        res = kvprep("fix", str(ckpt), "--output", str(out), "--no-build", "--no-smoke",
                     env=env, timeout=300)
        assert res.returncode == 0, res.stderr
        assert snapshot(ckpt) == before


@ROOT_ONLY
def test_a_full_disk_says_so_and_leaves_no_empty_state_folder(
    tiny: Path, tmp_path: Path, env: dict[str, str]
) -> None:
    size = sum(f.stat().st_size for f in tiny.iterdir()) // 1024 + 1024
    with tmpfs(tmp_path / "full", f"{size}k") as mnt:
        ckpt = copy_of(tiny, mnt)
        fill(mnt)
        before = snapshot(ckpt)
        res = kvprep("fix", str(ckpt), "--no-build", "--no-smoke", env=env, timeout=300)
        no_traceback(res)
        assert res.returncode == 1
        assert "no space left" in res.stderr and str(mnt) in res.stderr, res.stderr
        assert snapshot(ckpt) == before  # no empty .qwen-kvprep/, no temporary file
        # space again: the same fix now works, and revert is exact
        (mnt / "filler").unlink()
        res = kvprep("fix", str(ckpt), "--no-build", "--no-smoke", env=env, timeout=300)
        assert res.returncode == 0, res.stderr
        assert kvprep("revert", str(ckpt), env=env).returncode == 0
        assert snapshot(ckpt) == before


@ROOT_ONLY
def test_a_full_disk_during_revert_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with tmpfs(tmp_path / "full", "1m") as mnt:
        monkeypatch.setenv("HF_MODULES_CACHE", str(mnt / "modules"))
        p = prepare(mnt)
        big = b'{"model_type": "qwen", "pad": "' + b"x" * 200_000 + b'"}\n'
        (p.directory / "config.json").unlink()
        (p.directory / "config.json").write_bytes(big)  # the user's file, now the original
        from qwen_kvprep.journal.writer import Journal

        Journal(p.directory).write("config.json", b'{"patched": true}\n')
        fill(mnt)
        res = kvprep("revert", str(p.directory), env=dict(os.environ))
        no_traceback(res)
        assert res.returncode == 1 and "no space left" in res.stderr
        assert (p.directory / ".qwen-kvprep" / "journal.json").exists()  # still recoverable
        (mnt / "filler").unlink()
        res = kvprep("revert", str(p.directory), env=dict(os.environ))
        assert res.returncode == 0, res.stderr
        assert (p.directory / "config.json").read_bytes() == big


def _without_root_powers() -> tuple[str, ...]:
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        needs.skip("root", "runs as root and setpriv without CAP_DAC_OVERRIDE")
    return (setpriv, "--bounding-set=-dac_override,-dac_read_search,-fowner")


def test_permission_denied_names_the_path_and_the_user(
    tiny: Path, tmp_path: Path, env: dict[str, str]
) -> None:
    prefix = _without_root_powers()
    ckpt = copy_of(tiny, tmp_path / "models")
    os.chmod(ckpt, 0o555)
    try:
        before = snapshot(ckpt)
        res = kvprep("fix", str(ckpt), "--no-build", "--no-smoke", env=env, timeout=300,
                     entry=(*prefix, *ENTRY))
        no_traceback(res)
        assert res.returncode == 1
        assert "permission denied" in res.stderr and str(ckpt) in res.stderr
        assert "root (uid 0)" in res.stderr
        assert snapshot(ckpt) == before
    finally:
        os.chmod(ckpt, 0o755)


def test_an_unreadable_file_gets_a_permission_hint_not_a_download(
    tiny: Path, tmp_path: Path, env: dict[str, str]
) -> None:
    prefix = _without_root_powers()
    ckpt = copy_of(tiny, tmp_path / "models")
    os.chmod(ckpt / "qwen.tiktoken", 0o000)
    res = kvprep("doctor", str(ckpt), "--json", env=env, entry=(*prefix, *ENTRY))
    no_traceback(res)
    doc = json.loads(res.stdout)
    (content,) = [f for f in doc["findings"] if f["id"] == "checkpoint.content"]
    assert content["severity"] == "fail"
    assert "cannot be read by user root" in content["message"]
    assert "chmod" in content["fix"] and hubcli.download() not in content["fix"]


def test_leftover_temporary_files_of_ours_are_removed_on_the_next_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    p = prepare(tmp_path)
    ours = [p.directory / ".config.json.k3j_9x0a.tmp", p.directory / ".cpp_kernels.py.12345.lnk",
            p.directory / ".qwen-kvprep" / ".journal.json.abcd1234.tmp"]
    for f in ours:
        f.write_text("half-written")
    theirs = [p.directory / ".config.json.backup", p.directory / "notes.tmp"]
    for f in theirs:
        f.write_text("the user's")
    res = kvprep("revert", str(p.directory), env=dict(os.environ))
    assert res.returncode == 0, res.stderr
    assert "removed leftover temporary files" in res.stdout
    assert not any(f.exists() for f in ours)
    assert all(f.read_text() == "the user's" for f in theirs)


# ------------------------------------------------------------------ 10. validate before writing


@pytest.mark.parametrize(
    "config",
    [b'{\n  "model_type": "qwen",\n  oops\n}\n',
     b'{"model_type": "qwen", "name": "caf\xe9"}\n',
     b'{"model_type": "qwen", "use_cache_kernel": false, "use_cache_kernel": true}\n',
     b"[" * 100_000],
    ids=["invalid-json", "not-utf8", "duplicate-key", "deep"],
)
def test_a_refused_fix_leaves_the_folder_byte_identical_and_doctor_agrees(
    tiny: Path, tmp_path: Path, env: dict[str, str], config: bytes
) -> None:
    ckpt = copy_of(tiny, tmp_path / "models")
    (ckpt / "config.json").write_bytes(config)
    before = snapshot(ckpt)
    res = kvprep("fix", str(ckpt), "--no-build", "--no-smoke", env=env, timeout=300)
    no_traceback(res)
    assert res.returncode == 1
    assert snapshot(ckpt) == before  # no kernel source, no .qwen-kvprep/, nothing
    assert not (tmp_path / "hf" / "modules").exists()
    doc = json.loads(kvprep("doctor", str(ckpt), "--json", "--check", "config.parse",
                            env=env).stdout)
    (parse,) = doc["findings"]
    assert parse["severity"] == "fail", parse
    out = tmp_path / "view" / "Tiny-Chat"
    res = kvprep("fix", str(ckpt), "--output", str(out), "--no-build", "--no-smoke", env=env,
                 timeout=300)
    assert res.returncode == 1 and not (tmp_path / "view").exists()  # no new folder


def test_fix_refuses_a_damaged_journal_and_rewrites_a_damaged_state(
    tiny: Path, tmp_path: Path, env: dict[str, str]
) -> None:
    ckpt = copy_of(tiny, tmp_path / "models")
    assert kvprep("fix", str(ckpt), "--no-build", "--no-smoke", env=env,
                  timeout=300).returncode == 0
    journal = ckpt / ".qwen-kvprep" / "journal.json"
    good = journal.read_bytes()
    journal.write_bytes(good[: len(good) // 3])
    before = snapshot(ckpt)
    res = kvprep("fix", str(ckpt), "--no-build", "--no-smoke", env=env, timeout=300)
    no_traceback(res)
    assert res.returncode == 1 and "journal" in res.stderr and "by hand" in res.stderr
    assert snapshot(ckpt) == before
    journal.write_bytes(good)
    (ckpt / ".qwen-kvprep" / "state.json").write_text("[" * 50_000)
    res = kvprep("fix", str(ckpt), "--no-build", "--no-smoke", "--json", env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    ids = {f["id"] for f in json.loads(res.stdout)["findings"]}
    assert "state.record" in ids
    from qwen_kvprep.state.reader import read_state

    assert read_state(str(ckpt))[1] is None


def test_a_refused_prestart_output_leaves_no_new_folder(tmp_path: Path) -> None:
    bad = tmp_path / "Not-A-Model"
    bad.mkdir()
    (bad / "README.md").write_text("nothing here")
    out = tmp_path / "prepared" / "Not-A-Model"
    res = kvprep("prestart", str(bad), "--output", str(out), "--", "true")
    no_traceback(res)
    assert res.returncode == 1
    assert not (tmp_path / "prepared").exists()
    assert sorted(os.listdir(bad)) == ["README.md"]


def test_allow_fallback_with_output_still_gives_cmd_a_folder(tiny: Path, tmp_path: Path,
                                                              env: dict[str, str]) -> None:
    """--allow-fallback is for availability: CMD serves from OUT, so a refused preparation
    leaves OUT as a plain view (links only) instead of no folder at all."""
    ckpt = copy_of(tiny, tmp_path / "models")
    (ckpt / "config.json").write_bytes(b'{"model_type": "qwen", "a": 1, "a": 2}\n')
    out = tmp_path / "prepared" / "Tiny-Chat"
    res = kvprep("prestart", str(ckpt), "--output", str(out), "--allow-fallback", "--",
                 sys.executable, "-c", "import os,sys; print(os.path.isdir(sys.argv[1]))",
                 str(out), env=env, timeout=300)
    no_traceback(res)
    assert res.returncode == 0 and res.stdout == "True\n", res.stderr
    assert (out / "config.json").is_symlink() and "--allow-fallback" in res.stderr


# ------------------------------------------------------------------ 11. prestart's CMD


@pytest.mark.parametrize(
    ("cmd", "code", "said"),
    [(("",), 127, "command not found"), (("   ",), 127, "command not found"),
     (("no-such-command-qwen-kvprep",), 127, "command not found"),
     (("/",), 126, "permission denied"), (("{noexec}",), 126, "permission denied"),
     (("{noshebang}",), 126, "no #! line")],
)
def test_cmd_that_cannot_run_exits_like_a_shell_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cmd: tuple[str, ...], code: int, said: str
) -> None:
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    p = prepare(tmp_path, build=True)
    noexec = tmp_path / "noexec.sh"
    noexec.write_text("#!/bin/sh\necho hi\n")
    noshebang = tmp_path / "noshebang"
    noshebang.write_bytes(b"\x00\x01binary")
    os.chmod(noshebang, 0o755)
    args = [c.format(noexec=noexec, noshebang=noshebang) for c in cmd]
    res = kvprep("prestart", str(p.directory), "-q", "--", *args, env=dict(os.environ))
    assert res.returncode == code, res.stderr
    no_traceback(res)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0], res.stderr


def test_cmd_options_are_cmds_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    p = prepare(tmp_path, build=True)
    res = kvprep("prestart", str(p.directory), "-q", "--", "echo", "--json", "--debug",
                 env=dict(os.environ))
    assert res.returncode == 0 and res.stdout == "--json --debug\n", res.stderr
    # on the slow path too: a failure is reported as text, not as a JSON document
    bad = tmp_path / "Not-A-Model"
    bad.mkdir()
    res = kvprep("prestart", str(bad), "--", "echo", "--json", "--debug")
    no_traceback(res)
    assert res.returncode == 1 and res.stdout == ""  # no JSON document anywhere
    assert "\nerror: " in res.stderr and '"schema_version"' not in res.stderr, res.stderr


def test_own_options_stop_at_the_double_dash(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope")
    out = invoke("prestart", missing, "--", "x", "--json", "--debug")
    assert out.returncode == 2 and out.stdout == ""  # CMD's --json: no JSON document
    assert f"error: no such directory: {missing}" in out.stderr and "Traceback" not in out.stderr
    out = invoke("fix", missing, "--json")
    assert out.returncode == 2
    assert json.loads(out.stdout)["error"]["message"] == f"no such directory: {missing}"


# ------------------------------------------------------------------ 12. secrets


SECRET_URL = "https://mirroruser:s3cr3t-passw0rd@127.0.0.1:9"


def test_doctor_report_hides_url_credentials(tmp_path: Path) -> None:
    env = {**os.environ, "HF_ENDPOINT": SECRET_URL, "HTTPS_PROXY": "http://u:pr0xy-pw@proxy:3128"}
    res = kvprep("doctor", "--report", env=env, cwd=tmp_path)
    no_traceback(res)
    assert "s3cr3t-passw0rd" not in res.stdout + res.stderr
    assert "mirroruser" not in res.stdout
    assert "https://***@127.0.0.1:9" in res.stdout


class _NotFound(http.server.BaseHTTPRequestHandler):
    """A mirror that knows no repo (what the Hub answers an anonymous client)."""

    def _answer(self) -> None:
        self.send_response(401)
        self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = do_GET = _answer

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture()
def mirror() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotFound)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://mirroruser:s3cr3t-passw0rd@127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_fix_source_hub_errors_hide_url_credentials(
    tiny: Path, tmp_path: Path, env: dict[str, str], mirror: str
) -> None:
    ckpt = copy_of(tiny, tmp_path / "models")
    env = {**env, "HF_ENDPOINT": mirror}
    env.pop("HF_HUB_OFFLINE")
    for extra in ([], ["--json"]):
        res = kvprep("fix", str(ckpt), "--source", "hub", "--repo-id", "Qwen/Qwen-7B-Chat",
                     "--no-build", "--no-smoke", *extra, env=env, timeout=300)
        no_traceback(res)
        assert res.returncode == 1
        assert "s3cr3t-passw0rd" not in res.stdout + res.stderr, res.stdout + res.stderr
        assert "127.0.0.1" in res.stdout + res.stderr  # the mirror is named, not its password


def test_what_libraries_log_is_redacted(tmp_path: Path) -> None:
    """huggingface_hub's retry warnings print the request URL with HF_ENDPOINT's userinfo."""
    code = (
        "from qwen_kvprep.redact import install_log_filter\n"
        "from huggingface_hub.utils import logging as hf_logging\n"
        "log = hf_logging.get_logger('huggingface_hub.utils._http')\n"
        "install_log_filter()\n"
        "log.warning('Retrying in 1s: HEAD %s', 'https://u:l0gged-pw@mirror/x')\n"
        "import logging; logging.getLogger('x').warning('Authorization: Bearer abcdefgh1234')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "HF_HUB_VERBOSITY": "warning"})
    assert "Retrying" in res.stderr and "Bearer ***" in res.stderr, res.stderr
    assert "l0gged-pw" not in res.stderr and "abcdefgh1234" not in res.stderr


def test_a_failed_build_log_excerpt_is_redacted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from qwen_kvprep.buildcache import CacheLayout
    from qwen_kvprep.buildcache.builder import _failure
    from qwen_kvprep.render import report_error

    monkeypatch.setenv("HF_TOKEN", "hf_" + "Q" * 34)
    log = tmp_path / "build.log"
    log.write_text(
        "fetching https://builder:l0g-passw0rd@mirror.example/x\n"
        "error: Authorization: Bearer sk-abcdefghijklmnop failed\n"
        f"error: token {'hf_' + 'Q' * 34} rejected\n"
    )
    plan = type("Plan", (), {"key": "k" * 64, "mode": "CPU-only build"})()
    layout = CacheLayout(tmp_path / "cache")
    layout.logs.mkdir(parents=True)
    err = _failure(plan, layout, log, {"ok": False, "stage": "build"})  # type: ignore[arg-type]
    for as_json in (False, True):
        report_error(err, as_json=as_json)
        out = capsys.readouterr()
        text = out.out + out.err
        for secret in ("l0g-passw0rd", "sk-abcdefghijklmnop", "Q" * 34):
            assert secret not in text, text
        assert "error:" in text


def test_scrub_masks_userinfo_authorization_and_tokens() -> None:
    from qwen_kvprep.redact import scrub

    environ = {"HF_ENDPOINT": "https://u:p%40ss-word@m.example", "HF_TOKEN": "hf_" + "a" * 34}
    text = scrub(
        "GET https://u:p%40ss-word@m.example/api; pw p@ss-word; {'authorization': "
        f"'Bearer abcdefgh12345'}}; Authorization: token zzzzzzzz; {'hf_' + 'a' * 34}",
        environ,
    )
    for secret in ("p%40ss-word", "p@ss-word", "abcdefgh12345", "zzzzzzzz", "a" * 34):
        assert secret not in text, text
    assert "https://***@m.example/api" in text


# ------------------------------------------------------------------ 13. quoting, huge files


def test_hints_quote_paths_with_spaces(tiny: Path, tmp_path: Path, env: dict[str, str]) -> None:
    ckpt = copy_of(tiny, tmp_path / "my models")
    (ckpt / "generation_config.json").unlink()
    (ckpt / "config.json").write_text('{"model_type": "qwen", "use_cache_kernel": true}\n')
    res = kvprep("doctor", str(ckpt), "--json", env=env)
    doc = json.loads(res.stdout)
    fixes = [f["fix"] for f in doc["findings"] if f["fix"] and str(ckpt) in f["fix"]]
    assert fixes
    for fix in fixes:
        assert f"'{ckpt}'" in fix, fix


def test_a_huge_tiktoken_is_checked_on_a_bounded_prefix(
    tiny: Path, tmp_path: Path, env: dict[str, str]
) -> None:
    ckpt = copy_of(tiny, tmp_path / "models")
    tik = ckpt / "qwen.tiktoken"
    with open(tik, "r+b") as fh:  # 2 GB, sparse: its real lines, then zeros
        fh.truncate(2 << 30)
    code = (
        "import resource, sys, time\n"
        "from pathlib import Path\n"
        "from qwen_kvprep.probe.checkpoint import probe_tiktoken\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "t = time.monotonic(); r = probe_tiktoken(Path(sys.argv[1]))\n"
        "print(r[0], r[1], time.monotonic() - t,"
        " resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)\n"
    )
    res = subprocess.run([sys.executable, "-c", code, str(tik)], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    ranks, error, took, grew_kib = res.stdout.split()
    assert error == "None" and int(ranks) > 0
    assert float(took) < 5 and int(grew_kib) < 200_000  # 2.3 GB and 15 s before
    start = time.monotonic()
    res = kvprep("doctor", str(ckpt), "--check", "checkpoint.tokenizer", env=env)
    assert res.returncode == 0 and time.monotonic() - start < 30, res.stdout + res.stderr


def test_hub_snapshot_layout_fix_tamper_revert(
    tiny: Path, tmp_path: Path, env: dict[str, str]
) -> None:
    """A real Qwen download's layout (a huggingface_hub snapshot: every file a link into
    blobs/): fix replaces links, never writes a blob; a tampered journal is refused; revert
    brings every link back."""
    commit = "a" * 40
    repo = tmp_path / "hub" / "models--Qwen--Qwen-7B-Chat"
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in sorted(tiny.iterdir()):
        blob = repo / "blobs" / sha(f.read_bytes())
        shutil.copy(f, blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    blobs = snapshot(repo / "blobs")
    before = snapshot(snap)
    res = kvprep("fix", str(snap), "--no-build", "--no-smoke", env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    assert not (snap / "config.json").is_symlink()
    assert snapshot(repo / "blobs") == blobs
    journal = json.loads((snap / ".qwen-kvprep" / "journal.json").read_text())
    assert journal["files"]["config.json"]["kind"] == "symlink"
    good = json.loads(json.dumps(journal))
    journal["files"]["config.json"]["target"] = "../../blobs/x"  # allowed: a link in DIR
    journal["files"]["../../refs/main"] = {"kind": "absent", "written": None}
    (snap / ".qwen-kvprep" / "journal.json").write_text(json.dumps(journal))
    res = kvprep("revert", str(snap), env=env)
    assert res.returncode == 1 and "climbs out" in res.stderr, res.stderr
    (snap / ".qwen-kvprep" / "journal.json").write_text(json.dumps(good))
    res = kvprep("revert", str(snap), env=env)
    assert res.returncode == 0, res.stderr
    assert snapshot(snap) == before and snapshot(repo / "blobs") == blobs


def test_state_written_by_fix_passes_its_own_schema(
    tiny: Path, tmp_path: Path, env: dict[str, str]
) -> None:
    from qwen_kvprep.state.reader import read_state

    ckpt = copy_of(tiny, tmp_path / "models")
    res = kvprep("fix", str(ckpt), "--no-build", "--no-smoke", env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    state, problem = read_state(str(ckpt))
    assert problem is None and state is not None


@pytest.mark.slow
def test_replicas_making_one_new_output_view_together(
    tiny: Path, tmp_path: Path, env: dict[str, str]
) -> None:
    """Three fixes of one read-only DIR into the same new OUT at once: they take turns on
    OUT's lock; none removes what another made, and the view is complete."""
    ckpt = copy_of(tiny, tmp_path / "models")
    before = snapshot(ckpt)
    out = tmp_path / "prepared" / "Tiny-Chat"
    procs = [
        subprocess.Popen([sys.executable, "-m", "qwen_kvprep", "fix", str(ckpt), "--output",
                          str(out), "--no-build", "--no-smoke"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
    assert snapshot(ckpt) == before
    journal = json.loads((out / ".qwen-kvprep" / "journal.json").read_text())
    assert journal["files"]["config.json"]["kind"] == "symlink"  # the original kept once
    assert json.loads((out / "config.json").read_text())["use_cache_kernel"] is True
    assert kvprep("revert", str(out), env=env).returncode == 0
    assert (out / "config.json").is_symlink()


def test_a_file_system_refusal_names_the_file_written_and_the_folder_to_act_on(
    tmp_path: Path,
) -> None:
    import errno

    from qwen_kvprep.errors import os_failure

    model, cache = tmp_path / "model", tmp_path / "cache"
    model.mkdir()
    cache.mkdir()
    # a copy into DIR: the destination (filename2) is what was written, not the source
    copy = OSError(errno.ENOSPC, "No space left on device", str(cache / "x.so"),
                   None, str(model / "x.so"))
    err = os_failure(copy, model)
    assert f"writing {model / 'x.so'}" in err.message and f"df -h {model}" in str(err.fix)
    # a write outside DIR (the build cache): that folder is the one to free or remount,
    # a temporary folder already gone is named by the nearest that exists, and a view of
    # DIR (--output) would not help
    full = OSError(errno.ENOSPC, "No space left on device", str(cache / "tmp.1" / "x.so"))
    err = os_failure(full, model)
    assert f"holding {cache} " in err.message and f"df -h {cache}" in str(err.fix)
    ro = OSError(errno.EROFS, "Read-only file system", str(cache / "x.so"))
    assert "--output" not in str(os_failure(ro, model).fix)
    assert "--output" in str(os_failure(OSError(errno.EROFS, "x", str(model / "c")), model).fix)


def test_a_fix_stopped_by_a_full_disk_before_any_change_is_not_taken_for_a_revert(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The journal (small) was saved, the first file was refused: nothing changed, so
    nothing is left that doctor would read as a revert cut short."""
    import errno

    import qwen_kvprep.journal.writer as writer

    ckpt = copy_of(tiny, tmp_path / "disk")
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setenv("QWEN_KVPREP_CACHE", str(tmp_path / "cache"))
    before = snapshot(ckpt)

    def full(path: Any, data: bytes, mode: Any = None) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(writer, "atomic_write_bytes", full)
    res = invoke("fix", str(ckpt), "--no-build", "--no-smoke")
    assert res.returncode == 1 and "no space left" in res.stderr, res.stderr
    monkeypatch.undo()
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    doc = json.loads(invoke("doctor", str(ckpt), "--json").stdout)
    record = [f for f in doc["findings"] if f["id"] == "state.record"]
    assert record and record[0]["severity"] == "skip", record
    assert "cut short" not in json.dumps(doc["findings"])
    assert snapshot(ckpt) == before
