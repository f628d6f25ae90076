"""What the folder given is decides the advice (checkpoint.identity), a Hub repo id is
found in the local Hub cache wherever a folder is taken, and doctor's exit code says
whether a server started now would run the Int8 cache through the kernel.

Everything runs through the command line on tiny folders; the Hub cache is a layout made
under the test's HF_HOME (tests/hubcache_kit.py), never the network."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from qwen_kvprep.checks.identity import Identity, Kind, identify
from qwen_kvprep.probe.checkpoint import CheckpointFacts
from tests.cli import document, kvprep
from tests.hubcache_kit import COMMIT, cache_repo
from tests.remote_code import shipped_code_runs
from tests.test_doctor_cli import base_env
from tests.treesnap import snapshot

REPO = "Qwen/Qwen-7B-Chat"
OTHER_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"
KV_ON = {"use_cache_quantization": True, "use_cache_kernel": True, "use_flash_attn": False}


# -- identify: one pure function over the probe's facts --------------------------------------


def _cp(**kw: Any) -> CheckpointFacts:
    return dataclasses.replace(CheckpointFacts(path=Path("/m/x"), name="x"), **kw)


@pytest.mark.parametrize(
    ("facts", "expected"),
    [
        (
            _cp(files=("config.json",), config={"model_type": "qwen"}),
            Identity(Kind.QWEN_V1, "qwen"),
        ),
        (
            _cp(files=("config.json",), config={"model_type": "qwen"}, gptq=True),
            Identity(Kind.QWEN_V1_GPTQ, "qwen"),
        ),
        (
            _cp(files=("config.json",), config={"model_type": "qwen2"}),
            Identity(Kind.QWEN2, "qwen2"),
        ),
        (
            _cp(files=("config.json",), config={"model_type": "qwen2_moe"}),
            Identity(Kind.QWEN2, "qwen2_moe"),
        ),
        (
            _cp(files=("config.json",), config={"model_type": "llama"}),
            Identity(Kind.OTHER, "llama"),
        ),
        (_cp(files=("config.json",), config={}), Identity(Kind.OTHER)),
        (_cp(cache_repo=REPO, cache_snapshots=(COMMIT,)), Identity(Kind.HUB_REPO)),
        (_cp(), Identity(Kind.EMPTY)),
        (_cp(files=("model.safetensors",)), Identity(Kind.UNKNOWN)),
        (_cp(files=("config.json",)), Identity(Kind.CONFIG_UNREADABLE)),  # does not parse
        # a Qwen download whose config.json is damaged or missing: the file checks say what
        # to fetch again
        (_cp(files=("modeling_qwen.py",)), Identity(Kind.QWEN_V1)),
        (
            _cp(
                files=("config.json",), config={"model_type": "qwen"}, repo_id=REPO, revision=COMMIT
            ),
            Identity(Kind.QWEN_V1, "qwen", snapshot=True),
        ),
        (_cp(listing_error="Permission denied"), Identity(Kind.UNREADABLE)),
    ],
)
def test_identify(facts: CheckpointFacts, expected: Identity) -> None:
    assert identify(facts) == expected


# -- the advice fix gives for each kind of folder --------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from qwen_kvprep.tiny import generate_checkpoint

    return generate_checkpoint(tmp_path_factory.mktemp("ckpt") / "Qwen-tiny")


def _folder(tmp_path: Path, name: str, config: dict[str, Any]) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    (d / "model.safetensors").write_bytes(b"\0" * 16)
    (d / "tokenizer_config.json").write_text("{}")
    return d


def _fix(
    folder: Path, tmp_path: Path, *extra: str
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    res = kvprep("--json", "fix", str(folder), *extra, env=base_env(tmp_path), cwd=tmp_path)
    assert "Traceback" not in res.stderr, res.stderr
    return res, document(res)


@pytest.mark.parametrize(
    ("model_type", "words"),
    [
        ("llama", ['model_type "llama"', "not a Qwen (v1) checkpoint"]),
        ("qwen2", ['model_type "qwen2"', "Qwen1.5/Qwen2/Qwen2.5", "no Int8 KV cache"]),
        ("qwen2_moe", ['model_type "qwen2_moe"', "transformers' own Qwen2 code"]),
    ],
)
def test_fix_on_another_models_folder_says_what_it_is_and_nothing_harmful(
    tmp_path: Path, model_type: str, words: list[str]
) -> None:
    folder = _folder(tmp_path, "model", {"model_type": model_type, "hidden_size": 64})
    before = snapshot(folder)
    res, doc = _fix(folder, tmp_path)
    assert res.returncode == 1
    # one finding, the folder's identity: no Qwen file to fetch into someone else's model
    (finding,) = doc["findings"]
    assert finding["id"] == "checkpoint.identity" and finding["severity"] == "fail"
    for word in words:
        assert word in finding["message"], finding
    assert doc["error"]["message"] == finding["message"]
    said = json.dumps(doc)
    assert "download" not in said and "configuration_qwen.py" not in said
    assert "--kv-cache-dtype fp8" in finding["fix"] and "QuantizedCache" in finding["fix"]
    assert snapshot(folder) == before


def test_fix_on_an_empty_folder_downloads_the_whole_model(tmp_path: Path) -> None:
    folder = tmp_path / "empty"
    folder.mkdir()
    res, doc = _fix(folder, tmp_path)
    assert res.returncode == 1
    (finding,) = doc["findings"]
    assert finding["id"] == "checkpoint.identity" and "is empty" in finding["message"]
    # the whole repo, weights included: no file list, no --force-download
    assert f"download {REPO} --local-dir {folder}  " in finding["fix"], finding["fix"]
    assert "--force-download" not in finding["fix"] and ".py" not in finding["fix"]
    assert not any(folder.iterdir())


def test_fix_on_a_folder_that_holds_no_checkpoint(tmp_path: Path) -> None:
    folder = tmp_path / "weights-only"
    folder.mkdir()
    (folder / "notes.txt").write_text("hello")
    res, doc = _fix(folder, tmp_path)
    assert res.returncode == 1
    (finding,) = doc["findings"]
    assert "not a model checkpoint folder" in finding["message"]


# -- a Hub repo id, found in the local Hub cache ----------------------------------------------


@pytest.fixture()
def hub(tmp_path: Path, tiny: Path) -> tuple[dict[str, str], Path]:
    """(environment, snapshot folder): tiny cached as Qwen/Qwen-7B-Chat under HF_HOME."""
    env = base_env(tmp_path)
    snap = cache_repo(Path(env["HF_HOME"]) / "hub", REPO, tiny)
    return env, snap


def _doctor(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    res = kvprep("doctor", "--check", "checkpoint.identity", "--json", *args, env=env, cwd=cwd)
    assert "Traceback" not in res.stderr, res.stderr
    return res


def test_a_repo_id_is_its_cached_snapshot(hub: tuple[dict[str, str], Path], tmp_path: Path) -> None:
    env, snap = hub
    res = _doctor(env, tmp_path, REPO)
    assert res.returncode == 0, res.stdout + res.stderr
    (finding,) = document(res)["findings"]
    assert finding["severity"] == "ok" and f"snapshot of {REPO} at {COMMIT}" in finding["message"]
    assert finding["paths"] == [str(snap)]
    # as text, it says which folder it took
    text = kvprep("doctor", "--check", "checkpoint.identity", REPO, env=env, cwd=tmp_path)
    assert f"{REPO} is the Hub cache snapshot {snap}" in text.stderr
    # HF_HUB_CACHE wins over HF_HOME, as in huggingface_hub
    elsewhere = {**env, "HF_HUB_CACHE": str(tmp_path / "other-cache")}
    missing = _doctor(elsewhere, tmp_path, REPO)
    assert missing.returncode == 2
    assert str(tmp_path / "other-cache") in document(missing)["error"]["message"]


def _paths(res: subprocess.CompletedProcess[str]) -> list[str]:
    (finding,) = document(res)["findings"]
    paths: list[str] = finding["paths"]
    return paths


def test_revision_picks_the_snapshot(
    hub: tuple[dict[str, str], Path], tmp_path: Path, tiny: Path
) -> None:
    env, _ = hub
    other = cache_repo(Path(env["HF_HOME"]) / "hub", REPO, tiny, commit=OTHER_COMMIT, ref="v2")
    res = _doctor(env, tmp_path, REPO, "--revision", "v2")
    assert res.returncode == 0 and _paths(res) == [str(other)], res.stdout
    # a commit works too
    res = _doctor(env, tmp_path, REPO, "--revision", OTHER_COMMIT)
    assert res.returncode == 0 and _paths(res) == [str(other)], res.stdout


def test_a_repo_that_is_not_cached_names_the_download(tmp_path: Path) -> None:
    env = base_env(tmp_path)
    res = _doctor(env, tmp_path, "Qwen/Qwen-14B-Chat", "--revision", "v1.0")
    assert res.returncode == 2
    err = document(res)["error"]
    assert "holds no snapshot" in err["message"]
    assert "download Qwen/Qwen-14B-Chat --revision v1.0`" in err["fix"]
    # not a repo id either: the folder it would have been
    res = kvprep("doctor", "no-such-folder", env=env, cwd=tmp_path)
    assert res.returncode == 2 and "no such directory: no-such-folder" in res.stderr


def test_a_local_folder_wins_over_the_repo_id(
    hub: tuple[dict[str, str], Path], tmp_path: Path
) -> None:
    env, _ = hub
    local = tmp_path / "Qwen" / "Qwen-7B-Chat"
    local.parent.mkdir()
    _folder(local.parent, "Qwen-7B-Chat", {"model_type": "llama"})
    res = _doctor(env, tmp_path, REPO)
    (finding,) = document(res)["findings"]
    assert res.returncode == 1 and 'model_type "llama"' in finding["message"]
    assert _paths(res) == [str(local / "config.json")]


def test_revision_with_a_plain_folder_is_refused(tiny: Path, tmp_path: Path) -> None:
    res = kvprep("doctor", str(tiny), "--revision", "main", env=base_env(tmp_path), cwd=tmp_path)
    assert res.returncode == 2 and "--revision picks a snapshot" in res.stderr


def test_the_cache_repo_folder_is_its_snapshot(
    hub: tuple[dict[str, str], Path], tmp_path: Path
) -> None:
    env, snap = hub
    repo_folder = snap.parent.parent
    res = _doctor(env, tmp_path, str(repo_folder))
    assert res.returncode == 0 and _paths(res) == [str(snap)], res.stdout
    # without refs/main it cannot tell which snapshot: identity names the one there
    (repo_folder / "refs" / "main").unlink()
    res = _doctor(env, tmp_path, str(repo_folder))
    (finding,) = document(res)["findings"]
    assert (
        res.returncode == 1
        and "Hugging Face cache folder of Qwen/Qwen-7B-Chat" in finding["message"]
    )
    assert finding["fix"] == f"qwen-kvprep fix {snap}"


def test_other_commands_take_a_repo_id(hub: tuple[dict[str, str], Path], tmp_path: Path) -> None:
    env, snap = hub
    res = kvprep("plan", REPO, "--gpu", "h100", "--json", env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    res = kvprep("revert", REPO, "--dry-run", env=env, cwd=tmp_path)
    assert res.returncode == 0 and str(snap) in res.stderr, res.stdout + res.stderr
    # each names the download when the repo is not in the cache
    for command in ("fix", "smoke", "profile", "prestart", "revert", "plan"):
        res = kvprep(command, "Qwen/Qwen-14B-Chat", env=env, cwd=tmp_path)
        assert res.returncode == 2, (command, res.stdout, res.stderr)
        assert "download Qwen/Qwen-14B-Chat`" in res.stderr, (command, res.stderr)


def _blobs(snap: Path) -> dict[str, str]:
    blobs = snap.parent.parent / "blobs"
    return {b.name: hashlib.sha256(b.read_bytes()).hexdigest() for b in blobs.iterdir()}


def test_fix_in_a_hub_snapshot_never_writes_the_shared_blobs(
    hub: tuple[dict[str, str], Path], tmp_path: Path
) -> None:
    env, snap = hub
    before = snapshot(snap)
    res = kvprep("--json", "fix", REPO, "--no-build", "--no-smoke", env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    # each blob still holds what its name (its sha256) says
    assert all(name == digest for name, digest in _blobs(snap).items())
    # what fix changed became regular files in the snapshot; the rest are still links
    assert not (snap / "config.json").is_symlink()
    assert json.loads((snap / "config.json").read_text())["use_cache_quantization"] is True
    assert (snap / "qwen.tiktoken").is_symlink()
    # and revert brings the links back
    res = kvprep("revert", REPO, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    shutil.rmtree(snap / ".qwen-kvprep", ignore_errors=True)
    assert snapshot(snap) == before


# -- doctor's exit code: would a server started now run the Int8 cache through the kernel? --


def _with_config(tiny: Path, tmp_path: Path, **flags: Any) -> Path:
    copy = tmp_path / "Qwen-tiny"
    shutil.copytree(tiny, copy)
    cfg = json.loads((copy / "config.json").read_text())
    cfg.update(flags)
    (copy / "config.json").write_text(json.dumps(cfg))
    return copy


def _doctor_all(folder: Path, tmp_path: Path) -> tuple[int, dict[str, Any]]:
    res = kvprep("doctor", "--json", str(folder), env=base_env(tmp_path), cwd=tmp_path)
    assert "Traceback" not in res.stderr, res.stderr
    return res.returncode, document(res)


def _failed(doc: dict[str, Any]) -> set[str]:
    return {f["id"] for f in doc["findings"] if f["severity"] == "fail"}


def test_doctor_exits_1_when_the_cache_is_on_and_the_kernel_sources_are_missing(
    tiny: Path, tmp_path: Path
) -> None:
    folder = _with_config(tiny, tmp_path, **KV_ON)
    code, doc = _doctor_all(folder, tmp_path)
    assert code == 1 and "kernels.sources" in _failed(doc), _failed(doc)


def test_doctor_exits_0_when_the_cache_is_simply_off(tiny: Path, tmp_path: Path) -> None:
    folder = _with_config(tiny, tmp_path, use_flash_attn=False)
    code, doc = _doctor_all(folder, tmp_path)
    # the folder adds no failure; the machine may (a CUDA torch whose toolkit does not
    # match this machine's nvcc, as torch 2.0's CUDA 11 beside a CUDA 13 nvcc)
    failed = _failed(doc)
    machine = {i for i in failed if i.startswith("env.")}
    # from 4.54 on (or without transformers_stream_generator), Qwen's code as shipped does
    # not run at all: a failure of the folder whether or not the cache is on (fix adds the
    # compatibility module)
    compat = set() if shipped_code_runs() else {"checkpoint.compat"}
    assert failed == machine | compat and code == (1 if failed else 0), failed
    kv = [f for f in doc["findings"] if f["id"] == "config.kv_cache"]
    assert [f["severity"] for f in kv] == ["warn"]


@pytest.mark.parametrize(
    "flags",
    [
        {"use_cache_quantization": True, "use_cache_kernel": False},  # the pure-torch path
        {"use_cache_quantization": False, "use_cache_kernel": True},  # the kernel does nothing
    ],
)
def test_doctor_exits_1_when_one_flag_is_on_without_the_other(
    tiny: Path, tmp_path: Path, flags: dict[str, bool]
) -> None:
    folder = _with_config(tiny, tmp_path, use_flash_attn=False, **flags)
    code, doc = _doctor_all(folder, tmp_path)
    assert code == 1 and "config.kv_cache" in _failed(doc), _failed(doc)


def test_a_repo_id_without_huggingface_hub_is_a_usage_error(tmp_path: Path) -> None:
    blocker = tmp_path / "blocker" / "huggingface_hub"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('huggingface_hub is blocked')\n")
    env = base_env(tmp_path)
    env["PYTHONPATH"] = f"{blocker.parent}:{env['PYTHONPATH']}"
    res = kvprep("plan", REPO, "--gpu", "h100", env=env, cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "huggingface_hub, which finds a repo id" in res.stderr
