"""Checkpoint validation: probe/checkpoint.py, checks/checkpoint.py, checks/config.py.

Each broken-checkpoint case starts from a generated tiny checkpoint, breaks one thing,
and asserts the finding id and severity through `doctor DIR --json`, plus that neither
`doctor` nor `fix --dry-run` changed a single byte, link, mode or mtime in the tree.
"""

from __future__ import annotations

import builtins
import dataclasses
import hashlib
import importlib.util
import io
import json
import os
import shutil
import struct
import time
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

from qwen_kvprep import hubcli
from qwen_kvprep.checks import load_all, run_one
from qwen_kvprep.checks.checkpoint import PLACEHOLDER_REPO, redownload, refetch
from qwen_kvprep.findings import Finding, Severity
from qwen_kvprep.probe import checkpoint as probe_mod
from qwen_kvprep.probe.checkpoint import (
    CheckpointFacts,
    probe_checkpoint,
    probe_shard,
    unsafe_member,
)
from qwen_kvprep.probe.env import package_info
from qwen_kvprep.probe.facts import Facts
from qwen_kvprep.tiny import generate_checkpoint
from tests import treesnap
from tests.cli import document, invoke, kvprep
from tests.remote_code import transformers_release
from tests.treesnap import Snapshot

# the command the fix hints name for this huggingface_hub
DOWNLOAD = hubcli.download()
VALIDATED_AREAS = ("checkpoint", "config")
# What fix's own steps repair (Qwen's code as shipped, which may not load here: on 4.54 and
# later, or without transformers_stream_generator): fix's validation leaves these out.
FIX_OWNS = ("checkpoint.fast_path", "checkpoint.compat")
FIX_DRY = ["fix", "--dry-run", "--no-build", "--no-smoke", "--json"]
LFS_POINTER = (
    b"version https://git-lfs.github.com/spec/v1\n"
    b"oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\n"
    b"size 1964065176\n"
)
HTML_PAGE = b"<!DOCTYPE html>\n<html><head><title>Sign in</title></head><body></body></html>\n"


# -- fixtures and helpers ------------------------------------------------------------------


@pytest.fixture(scope="session")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One generated tiny checkpoint (2 shards); each test works on a copy."""
    return generate_checkpoint(tmp_path_factory.mktemp("tpl") / "Qwen-tiny", shards=2)


@pytest.fixture()
def work(tmp_path: Path, isolated_hf: Path) -> Path:
    """Everything a test may touch lives under here (HF_HOME is elsewhere, per test)."""
    w = tmp_path / "work"
    w.mkdir()
    return w


@pytest.fixture()
def ckpt(template: Path, work: Path) -> Path:
    dest = work / "Qwen-tiny"
    shutil.copytree(template, dest, symlinks=True)
    return dest


def snapshot(root: Path) -> Snapshot:
    """Modification times too, and files by hash: the shards are the bulk of a checkpoint."""
    return treesnap.snapshot(root, digest=True, mtimes=True)


def run_cli(args: list[str]) -> tuple[int, dict[str, Any]]:
    res = invoke(*args)
    return res.returncode, document(res)


def by_id(doc: dict[str, Any], id: str) -> list[dict[str, Any]]:
    return [f for f in doc["findings"] if f["id"] == id]


def direct(directory: Path) -> list[Finding]:
    """The checkpoint and config checks on freshly probed facts, without the CLI."""
    facts = Facts(checkpoint=probe_checkpoint(directory))
    out: list[Finding] = []
    for chk in load_all().values():
        if chk.area in VALIDATED_AREAS:
            out.extend(run_one(chk, facts))
    return out


def assert_case(
    directory: Path,
    root: Path,
    id: str,
    severity: str,
) -> list[dict[str, Any]]:
    """doctor reports `id` at `severity`; neither doctor nor fix --dry-run changes `root`.

    Returns doctor's findings with that id."""
    before = snapshot(root)
    _, doc = run_cli(["doctor", str(directory), "--json"])
    assert snapshot(root) == before, "doctor changed the tree"
    found = by_id(doc, id)
    assert found, f"no {id} finding in {[f['id'] for f in doc['findings']]}"
    assert severity in {f["severity"] for f in found}, found
    for f in doc["findings"]:
        assert "crashed" not in f["message"], f
    # A failing checkpoint check must also stop `fix` at its first step.
    code, fixdoc = run_cli(
        ["fix", str(directory), "--dry-run", "--no-build", "--no-smoke", "--json"]
    )
    assert snapshot(root) == before, "fix --dry-run changed the tree"
    if severity == "fail" and id.startswith("checkpoint."):
        assert code == 1
        assert fixdoc["ok"] is False
        assert id in {f["id"] for f in fixdoc["findings"]}
    return found


# -- healthy ---------------------------------------------------------------------------------


def test_healthy_checkpoint_has_no_failure(ckpt: Path, work: Path) -> None:
    findings = direct(ckpt)
    ids = {f.id for f in findings}
    mine = {c.id for c in load_all().values() if c.area in VALIDATED_AREAS}
    assert ids == mine  # every check spoke
    # Qwen's code as shipped needs fix's compatibility module to run at all from 4.54 on,
    # and wherever transformers_stream_generator cannot be imported (chat_stream imports it)
    stream_ok = package_info("transformers_stream_generator").found
    needs_fix = (
        {"checkpoint.compat"} if transformers_release() >= (4, 54) or not stream_ok else set()
    )
    bad = [f for f in findings if f.severity in (Severity.FAIL, Severity.SKIP)]
    assert {f.id for f in bad} == (needs_fix if not stream_ok else set()), bad
    before = snapshot(work)
    _, doc = run_cli(["doctor", str(ckpt), "--json"])
    assert {
        f["id"]
        for f in doc["findings"]
        if f["id"].split(".")[0] in VALIDATED_AREAS and f["severity"] == "fail"
    } == needs_fix
    assert snapshot(work) == before
    facts = probe_checkpoint(ckpt)
    # The kernel sources are missing in a fresh checkpoint: a fact, not a checkpoint failure.
    assert facts.kernel_sources == dict.fromkeys(facts.kernel_sources)
    assert facts.loader_sha256 == hashlib.sha256((ckpt / "cpp_kernels.py").read_bytes()).hexdigest()
    assert facts.weights_layout == "safetensors-sharded"
    assert facts.modeling_text_supports_kv is True
    assert facts.fixed_missing == ()
    assert facts.missing_requirements == (() if stream_ok else ("transformers_stream_generator",))
    assert {"tiktoken", "einops", "transformers_stream_generator"} <= set(facts.requirements)
    assert {"tiktoken", "einops"} <= set(facts.fixed_requirements)
    assert "transformers_stream_generator" not in facts.fixed_requirements


def test_fix_validate_step_passes_a_healthy_checkpoint(ckpt: Path, work: Path) -> None:
    before = snapshot(work)
    _, doc = run_cli(["fix", str(ckpt), "--dry-run", "--no-build", "--no-smoke", "--json"])
    assert snapshot(work) == before
    assert not [f for f in doc["findings"] if f["id"].startswith("checkpoint.")
                and f["severity"] == "fail"]
    assert doc.get("error") is None or "not a usable" not in doc["error"]["message"]


def test_probe_never_raises_for_a_missing_directory(tmp_path: Path) -> None:
    facts = probe_checkpoint(tmp_path / "nope")
    assert facts.listing_error
    findings = direct(tmp_path / "nope")
    assert [f.severity for f in findings if f.id == "checkpoint.files"] == [Severity.FAIL]


# -- weights ---------------------------------------------------------------------------------


def _shards(d: Path) -> list[Path]:
    return sorted(d.glob("model-*.safetensors"))


def test_truncated_shard(ckpt: Path, work: Path) -> None:
    shard = _shards(ckpt)[1]
    with open(shard, "r+b") as fh:
        fh.truncate(shard.stat().st_size // 2)
    found = assert_case(ckpt, work, "checkpoint.shards", "fail")
    f = next(x for x in found if x["severity"] == "fail")
    assert f["paths"] == [str(shard)]
    assert "cut short" in f["message"] and "MetadataIncompleteBuffer" in f["message"]
    assert f["details"]["truncated"] is True
    assert f"{DOWNLOAD} {PLACEHOLDER_REPO} {shard.name} --local-dir {ckpt}" in f["fix"]
    assert "--force-download" in f["fix"]


def test_lfs_pointer_shard(ckpt: Path, work: Path) -> None:
    shard = _shards(ckpt)[0]
    shard.write_bytes(LFS_POINTER)
    found = assert_case(ckpt, work, "checkpoint.content", "fail")
    assert found[0]["paths"] == [str(shard)]
    assert found[0]["details"]["kind"] == "lfs-pointer"
    assert "1,964,065,176" in found[0]["message"]
    # Reported once, as content: the shard check does not add header noise about it.
    shards = [f for f in direct(ckpt) if f.id == "checkpoint.shards"]
    assert Severity.FAIL not in {f.severity for f in shards}


def test_lfs_pointer_in_a_git_clone_suggests_git_lfs_pull(ckpt: Path) -> None:
    (ckpt / ".git").mkdir()
    _shards(ckpt)[0].write_bytes(LFS_POINTER)
    f = next(f for f in direct(ckpt) if f.id == "checkpoint.content")
    assert f.fix is not None and f.fix.startswith(f"git -C {ckpt} lfs pull --include=")


def test_lfs_pointer_in_a_folder_of_a_git_clone_pulls_from_its_top(tmp_path: Path) -> None:
    top = tmp_path / "repo"
    (top / ".git").mkdir(parents=True)
    model = generate_checkpoint(top / "models" / "tiny", layers=1, shards=2)
    shard = sorted(model.glob("model-*.safetensors"))[0]
    shard.write_bytes(LFS_POINTER)
    res = kvprep("doctor", str(model), "--check", "checkpoint.content", "--json")
    (f,) = json.loads(res.stdout)["findings"]
    assert f["fix"].startswith(f"git -C {top} lfs pull --include=models/tiny/{shard.name} ")
    assert "git lfs install" in f["fix"]


def test_lfs_pointer_outside_a_git_clone_gets_both_ways(tmp_path: Path) -> None:
    model = generate_checkpoint(tmp_path / "tiny", layers=1, shards=2)
    shard = sorted(model.glob("model-*.safetensors"))[0]
    shard.write_bytes(LFS_POINTER)
    res = kvprep("doctor", str(model), "--check", "checkpoint.content", "--json")
    (f,) = json.loads(res.stdout)["findings"]
    assert f"git lfs pull --include={shard.name}" in f["fix"]
    assert f"{DOWNLOAD} {PLACEHOLDER_REPO} {shard.name}" in f["fix"]
    # profile, which needs the weights, says the same
    res = kvprep("profile", str(model), "--json")
    doc = json.loads(res.stdout)
    assert res.returncode == 1 and "git lfs pull" in doc["error"]["fix"]
    assert "--random-weights" in doc["error"]["fix"]


def test_missing_shard(ckpt: Path, work: Path) -> None:
    shard = _shards(ckpt)[0]
    shard.unlink()
    found = assert_case(ckpt, work, "checkpoint.index", "fail")
    f = next(x for x in found if x["severity"] == "fail")
    assert f["paths"] == [str(shard)]
    assert f"{DOWNLOAD} {PLACEHOLDER_REPO} {shard.name} --local-dir" in f["fix"]
    assert "huggingface_hub.hf_hub_download" in f["details"]["python"]


def _edit_index(d: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    path = d / "model.safetensors.index.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=2))


class Touched(Exception):
    """Raised by the file-system guard: deliberately not an OSError, so nothing swallows it."""


@pytest.fixture()
def guard(monkeypatch: pytest.MonkeyPatch) -> Callable[[Path], list[str]]:
    """guard(path) -> list that records any open/stat of `path`, which also raises Touched."""
    forbidden: list[str] = []
    touched: list[str] = []

    def check(p: Any) -> None:
        try:
            name = os.path.abspath(os.fsdecode(os.fspath(p)))
        except TypeError:  # a file descriptor, a DirEntry's own stat: not a path given to us
            return
        if name in forbidden:
            touched.append(name)
            raise Touched(name)

    def wrap(real: Callable[..., Any]) -> Callable[..., Any]:
        def guarded(*a: Any, **k: Any) -> Any:
            if a:
                check(a[0])
            return real(*a, **k)

        return guarded

    monkeypatch.setattr(builtins, "open", wrap(builtins.open))
    monkeypatch.setattr(io, "open", wrap(io.open))
    for fn in ("open", "stat", "lstat", "readlink", "scandir"):
        monkeypatch.setattr(os, fn, wrap(getattr(os, fn)))

    def add(path: Path) -> list[str]:
        forbidden.append(os.path.abspath(path))
        return touched

    return add


def test_index_escaping_the_directory_is_refused_and_never_opened(
    ckpt: Path, work: Path, guard: Callable[[Path], list[str]]
) -> None:
    outside = work / "outside.safetensors"
    os.mkfifo(outside)  # reading it would block forever: proof by hanging, guarded below
    touched = guard(outside)
    victim = _shards(ckpt)[0].name
    _edit_index(ckpt, lambda d: d["weight_map"].update(
        {k: "../outside.safetensors" for k, v in d["weight_map"].items() if v == victim}
    ))
    found = assert_case(ckpt, work, "checkpoint.index", "fail")
    f = next(x for x in found if x["severity"] == "fail")
    assert "../outside.safetensors" in f["message"] and "never opens" in f["message"]
    assert f["details"]["refused"] == {
        "../outside.safetensors": "climbs out of the checkpoint with `..`"
    }
    assert touched == []


def test_absolute_path_in_index_is_refused_and_never_opened(
    ckpt: Path, work: Path, guard: Callable[[Path], list[str]]
) -> None:
    outside = work / "abs.safetensors"
    shutil.copy(_shards(ckpt)[0], outside)  # a valid shard: only the name gives it away
    touched = guard(outside)
    victim = _shards(ckpt)[0].name
    _edit_index(ckpt, lambda d: d["weight_map"].update(
        {k: str(outside) for k, v in d["weight_map"].items() if v == victim}
    ))
    found = assert_case(ckpt, work, "checkpoint.index", "fail")
    f = next(x for x in found if x["severity"] == "fail")
    assert f["details"]["refused"] == {str(outside): "is an absolute path"}
    assert touched == []


@pytest.mark.parametrize(
    ("name", "unsafe"),
    [
        ("model-00001-of-00002.safetensors", False),
        ("sub/model.safetensors", False),
        ("../x.safetensors", True),
        ("sub/../../x.safetensors", True),
        ("..\\x.safetensors", True),
        ("/etc/passwd", True),
        ("C:\\x.safetensors", True),
        ("C:x.safetensors", True),
        ("\\\\server\\share\\x", True),
        ("", True),
        ("a\x00b", True),
        (7, True),
    ],
)
def test_unsafe_member(name: Any, unsafe: bool) -> None:
    assert (unsafe_member(name) is not None) is unsafe


def test_index_total_size_and_misplaced_tensors(ckpt: Path) -> None:
    _edit_index(ckpt, lambda d: d["metadata"].update(total_size=d["metadata"]["total_size"] + 2))
    f = [f for f in direct(ckpt) if f.id == "checkpoint.index"]
    assert [x.severity for x in f] == [Severity.WARN]
    assert "total_size" in f[0].message
    a, b = (s.name for s in _shards(ckpt))

    def swap(d: dict[str, Any]) -> None:
        wm = d["weight_map"]
        first = next(k for k, v in wm.items() if v == a)
        wm[first] = b

    _edit_index(ckpt, swap)
    f = [f for f in direct(ckpt) if f.id == "checkpoint.index"]
    assert Severity.FAIL in {x.severity for x in f}


# -- remote code, tokenizer, config ----------------------------------------------------------


def test_html_instead_of_python(ckpt: Path, work: Path) -> None:
    (ckpt / "modeling_qwen.py").write_bytes(HTML_PAGE)
    found = assert_case(ckpt, work, "checkpoint.content", "fail")
    assert found[0]["details"]["kind"] == "html"
    assert found[0]["paths"] == [str(ckpt / "modeling_qwen.py")]
    assert "modeling_qwen.py" in found[0]["fix"]
    remote = [f for f in direct(ckpt) if f.id == "checkpoint.remote_code"]
    assert [f.severity for f in remote] == [Severity.SKIP]


def test_remote_code_too_old(ckpt: Path, work: Path) -> None:
    # The shape of the August-2023 modeling file: the model, but no quantized cache at all.
    (ckpt / "modeling_qwen.py").write_text(
        "import torch\nfrom transformers import PreTrainedModel\n\n"
        "class QWenLMHeadModel(PreTrainedModel):\n    pass\n"
    )
    found = assert_case(ckpt, work, "checkpoint.remote_code", "fail")
    assert "silently ignored" in found[0]["message"]
    assert "update the remote code" in found[0]["fix"]
    assert "modeling_qwen.py" in found[0]["fix"]


def test_invalid_config_names_the_line(ckpt: Path, work: Path) -> None:
    lines = (ckpt / "config.json").read_text().splitlines()
    lines[4] = lines[4].rstrip(",") + ",,"  # line 5: a doubled comma
    (ckpt / "config.json").write_text("\n".join(lines) + "\n")
    found = assert_case(ckpt, work, "config.parse", "fail")
    assert "line 5" in found[0]["message"]
    assert "repair line 5" in found[0]["fix"]
    # fix --dry-run refuses with the same line, from the config patch step.
    code, doc = run_cli([*FIX_DRY, str(ckpt)])
    assert code == 1 and "line 5" in doc["error"]["message"]


def test_lfs_tiktoken(ckpt: Path, work: Path) -> None:
    (ckpt / "qwen.tiktoken").write_bytes(LFS_POINTER)
    found = assert_case(ckpt, work, "checkpoint.content", "fail")
    assert found[0]["paths"] == [str(ckpt / "qwen.tiktoken")]
    tok = [f for f in direct(ckpt) if f.id == "checkpoint.tokenizer"]
    assert [f.severity for f in tok] == [Severity.SKIP]


def test_bad_tiktoken_line_is_named(ckpt: Path, work: Path) -> None:
    path = ckpt / "qwen.tiktoken"
    lines = path.read_bytes().splitlines()
    lines[6] = b"not*base64 7"
    path.write_bytes(b"\n".join(lines) + b"\n")
    found = assert_case(ckpt, work, "checkpoint.tokenizer", "fail")
    assert "line 7" in found[0]["message"]
    assert found[0]["details"]["line"] == 7


def test_dotted_directory(ckpt: Path, work: Path) -> None:
    dotted = work / "qwen-7b-v1.0"
    ckpt.rename(dotted)
    found = assert_case(dotted, work, "checkpoint.dirname", "fail")
    assert "transformers_modules.qwen-7b-v1'" in found[0]["message"]
    assert "ln -s" in found[0]["fix"] and "qwen-7b-v1_0" in found[0]["fix"]


def _as_hub_snapshot(src: Path, hub: Path, repo: str, rev: str) -> Path:
    """Lay `src` out like a huggingface_hub cache: blobs by hash, snapshot of symlinks."""
    repo_dir = hub / ("models--" + repo.replace("/", "--"))
    blobs = repo_dir / "blobs"
    snap = repo_dir / "snapshots" / rev
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(rev)
    for f in sorted(src.iterdir()):
        data = f.read_bytes()
        blob = hashlib.sha256(data).hexdigest()
        (blobs / blob).write_bytes(data)
        os.symlink(f"../../blobs/{blob}", snap / f.name)
    return snap


def test_symlinked_config_in_a_hub_snapshot(template: Path, work: Path) -> None:
    rev = "a" * 40
    snap = _as_hub_snapshot(template, work / "hub", "Qwen/Qwen-7B-Chat", rev)
    found = assert_case(snap, work, "config.symlink", "info")
    assert "never write the blob" in found[0]["message"]
    facts = probe_checkpoint(snap)
    assert facts.config_is_symlink
    assert facts.config_link_target is not None
    assert facts.config_link_target.startswith("../../blobs/")
    assert (facts.repo_id, facts.revision) == ("Qwen/Qwen-7B-Chat", rev)
    assert facts.hub_cache_dir == work / "hub"
    assert not [f for f in direct(snap) if f.severity is Severity.FAIL and f.id not in FIX_OWNS]
    # A fix for a snapshot re-fetches into the cache, at the snapshot's revision.
    cmd = redownload(facts, ["config.json"])
    assert cmd == (
        f"{DOWNLOAD} Qwen/Qwen-7B-Chat config.json --revision {rev} "
        f"--cache-dir {work / 'hub'} --force-download"
    )


def test_truncated_blob_in_a_hub_snapshot(template: Path, work: Path) -> None:
    rev = "b" * 40
    snap = _as_hub_snapshot(template, work / "hub", "Qwen/Qwen-1_8B-Chat", rev)
    shard = _shards(snap)[0]
    blob = shard.resolve()
    with open(blob, "r+b") as fh:
        fh.truncate(100)
    found = assert_case(snap, work, "checkpoint.shards", "fail")
    assert found[0]["fix"] == (
        f"{DOWNLOAD} Qwen/Qwen-1_8B-Chat {shard.name} --revision {rev} "
        f"--cache-dir {work / 'hub'} --force-download"
    )


def test_dangling_snapshot_symlink(template: Path, work: Path) -> None:
    snap = _as_hub_snapshot(template, work / "hub", "Qwen/Qwen-7B-Chat", "c" * 40)
    (snap / "tokenization_qwen.py").resolve().unlink()
    f = [f for f in direct(snap) if f.id == "checkpoint.files" and f.severity is Severity.FAIL]
    assert f and "tokenization_qwen.py" in f[0].message and "blob" in f[0].message


def test_legacy_pytorch_bin(work: Path) -> None:
    d = generate_checkpoint(work / "Qwen-7B-Chat", legacy_bin=True)
    found = assert_case(d, work, "checkpoint.files", "info")
    f = next(x for x in found if x["severity"] == "info")
    assert "August-2023" in f["message"]
    assert f["paths"] == [str(d / "pytorch_model.bin")]
    # The directory's name is a known Qwen repo: the fix uses it, and says it assumed so.
    assert f"{DOWNLOAD} Qwen/Qwen-7B-Chat --local-dir" in f["fix"]
    assert "assumed from the directory name" in f["fix"]
    assert probe_checkpoint(d).weights_layout == "pytorch-bin"


def test_gptq_recognised(work: Path) -> None:
    d = generate_checkpoint(work / "Qwen-tiny-Int4", gptq=True)
    found = assert_case(d, work, "checkpoint.gptq", "info")
    assert "gptqmodel" in found[0]["fix"] and "optimum" in found[0]["fix"]
    assert probe_checkpoint(d).gptq is True
    # Recognised from config.json's quantization_config alone too.
    (d / "quantize_config.json").unlink()
    facts = probe_checkpoint(d)
    assert facts.gptq and facts.gptq_source == "config.json quantization_config"


def test_missing_requirement(ckpt: Path, work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec

    def fake(name: str, *a: Any, **k: Any) -> Any:
        return None if name == "einops" else real(name, *a, **k)

    monkeypatch.setattr(importlib.util, "find_spec", fake)
    found = assert_case(ckpt, work, "checkpoint.requirements", "fail")
    assert found[0]["fix"] == "pip install einops"
    assert "not found in your environment: einops" in found[0]["message"]


def test_requirements_follow_transformers_rules(tmp_path: Path) -> None:
    (tmp_path / "modeling_qwen.py").write_text(
        "import os\n"
        "from .helper import x\n"
        "try:\n    import optional_pkg\nexcept ImportError:\n    optional_pkg = None\n"
        "def f():\n    from needed_in_function.sub import y\n"
    )
    (tmp_path / "helper.py").write_text("import needed_by_helper\n")
    got = probe_mod.scan_requirements(tmp_path, ["modeling_qwen"])
    assert got == ("needed_by_helper", "needed_in_function", "os")


# -- config flags ----------------------------------------------------------------------------


def _config_findings(d: Path, **overrides: Any) -> dict[str, Finding]:
    path = d / "config.json"
    cfg = json.loads(path.read_text())
    for k, v in overrides.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    path.write_text(json.dumps(cfg, indent=2))
    return {f.id: f for f in direct(d) if f.id.startswith("config.")}


@pytest.mark.parametrize(
    ("quant", "kernel", "flash", "kv", "fa"),
    [
        (None, None, None, Severity.WARN, Severity.INFO),  # the original config: all absent
        # one flag without the other: a server would not run the Int8 cache through the
        # kernel although the config asks for it (doctor exits 1)
        (False, True, False, Severity.FAIL, Severity.OK),  # kernel without quantization
        (True, False, False, Severity.FAIL, Severity.OK),  # slow fallback
        (True, True, None, Severity.OK, Severity.FAIL),  # flash absent = "auto"
        (True, True, "auto", Severity.OK, Severity.FAIL),
        (True, True, True, Severity.OK, Severity.FAIL),
        (True, True, False, Severity.OK, Severity.OK),  # what fix writes
    ],
)
def test_kv_flags(
    ckpt: Path, quant: Any, kernel: Any, flash: Any, kv: Severity, fa: Severity
) -> None:
    f = _config_findings(
        ckpt, use_cache_quantization=quant, use_cache_kernel=kernel, use_flash_attn=flash
    )
    assert f["config.kv_cache"].severity is kv, f["config.kv_cache"]
    assert f["config.flash_attn"].severity is fa, f["config.flash_attn"]
    if fa is Severity.FAIL:
        assert "'tuple' object has no attribute 'dtype'" in f["config.flash_attn"].message
    if kv is not Severity.OK:
        assert f["config.kv_cache"].fix == f"qwen-kvprep fix {ckpt}"


def test_not_a_qwen_v1_config(ckpt: Path) -> None:
    # checkpoint.identity says what it is; the config checks have nothing to add
    f = _config_findings(ckpt, model_type="qwen2")
    assert f["config.parse"].severity is Severity.SKIP
    (identity,) = [x for x in direct(ckpt) if x.id == "checkpoint.identity"]
    assert identity.severity is Severity.FAIL and '"qwen2"' in identity.message


# -- safetensors headers, unit level ---------------------------------------------------------


def _st(tensors: dict[str, tuple[str, list[int], int]], extra: int = 0, cut: int = 0) -> bytes:
    """A safetensors file: name -> (dtype, shape, itemsize); zero-filled data."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    pos = 0
    for name, (dtype, shape, itemsize) in tensors.items():
        n = itemsize
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(header).encode()
    data = struct.pack("<Q", len(raw)) + raw + b"\0" * (pos + extra)
    return data[: len(data) - cut] if cut else data


@pytest.mark.parametrize(
    ("blob", "expect"),
    [
        (_st({"a": ("BF16", [4, 4], 2), "b": ("F32", [3], 4)}), None),
        (_st({"a": ("BF16", [4, 4], 2)}, cut=1), "cut short"),
        (_st({"a": ("BF16", [4, 4], 2)}, extra=3), "extra bytes"),
        (b"\x01\x02", "too short"),
        (struct.pack("<Q", 0) + b"{}", "header length of 0"),
        (struct.pack("<Q", 10**12) + b"{}", "HeaderTooLarge"),
        (struct.pack("<Q", 100) + b"{}", "header alone needs"),
        (struct.pack("<Q", 4) + b"{{{{", "not valid JSON"),
        (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
    ],
)
def test_probe_shard(tmp_path: Path, blob: bytes, expect: Optional[str]) -> None:
    p = tmp_path / "x.safetensors"
    p.write_bytes(blob)
    got = probe_shard(p, p.name)
    if expect is None:
        assert got.error is None and got.tensor_bytes == 4 * 4 * 2 + 3 * 4
    else:
        assert got.error is not None and expect in got.error, got.error


@pytest.mark.parametrize(
    ("meta", "expect"),
    [
        ({"dtype": "Q9", "shape": [1], "data_offsets": [0, 1]}, "unknown dtype"),
        ({"dtype": "F16", "shape": [-1], "data_offsets": [0, 2]}, "invalid shape"),
        ({"dtype": "F16", "shape": [2], "data_offsets": [0, 2]}, "needs 4"),
        ({"dtype": "F16", "shape": [1], "data_offsets": [2, 0]}, "invalid data_offsets"),
        ({"dtype": "F16", "shape": [1], "data_offsets": [2, 4]}, "non-contiguous"),
    ],
)
def test_probe_shard_rejects_bad_tensor_entries(
    tmp_path: Path, meta: dict[str, Any], expect: str
) -> None:
    raw = json.dumps({"t": meta}).encode()
    p = tmp_path / "x.safetensors"
    p.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 4)
    got = probe_shard(p, p.name)
    assert got.error is not None and expect in got.error, got.error


# -- reading headers only --------------------------------------------------------------------

SHARD_BYTES = 400 * 1024 * 1024


def _sparse_shard(path: Path, layer: int) -> tuple[dict[str, str], int]:
    """A ~400 MB shard whose data is a hole: valid header, nothing written after it."""
    n = SHARD_BYTES // 2 // 2  # two BF16 tensors filling the shard
    names = [f"transformer.h.{layer}.mlp.w1.weight", f"transformer.h.{layer}.mlp.w2.weight"]
    header = {
        names[0]: {"dtype": "BF16", "shape": [n], "data_offsets": [0, 2 * n]},
        names[1]: {"dtype": "BF16", "shape": [n], "data_offsets": [2 * n, 4 * n]},
    }
    raw = json.dumps(header).encode()
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        fh.truncate(8 + len(raw) + 4 * n)
    return dict.fromkeys(names, path.name), 4 * n


def test_eight_big_shards_are_judged_from_headers_only(
    template: Path, work: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = work / "Qwen-big"
    shutil.copytree(template, d, ignore=shutil.ignore_patterns("*.safetensors*"))
    weight_map: dict[str, str] = {}
    total = 0
    for i in range(8):
        wm, size = _sparse_shard(d / f"model-{i + 1:05d}-of-00008.safetensors", i)
        weight_map.update(wm)
        total += size
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    on_disk = sum(p.stat().st_blocks * 512 for p in _shards(d))
    assert on_disk < 8 * 1024 * 1024, "the file system does not keep the shards sparse"

    read_from_shards = 0
    real_open = builtins.open

    def counting_open(file: Any, mode: str = "r", *a: Any, **k: Any) -> Any:
        fh = real_open(file, mode, *a, **k)
        if not str(file).endswith(".safetensors"):
            return fh

        class Wrapper:
            def __init__(self, inner: Any) -> None:
                self._inner = inner

            def read(self, size: int = -1) -> bytes:
                nonlocal read_from_shards
                data: bytes = self._inner.read(size)
                read_from_shards += len(data)
                return data

            def __enter__(self) -> Wrapper:
                return self

            def __exit__(self, *exc: Any) -> None:
                self._inner.close()

            def __getattr__(self, name: str) -> Any:
                return getattr(self._inner, name)

        return Wrapper(fh)

    with monkeypatch.context() as m:
        m.setattr(builtins, "open", counting_open)
        start = time.perf_counter()
        findings = direct(d)
        elapsed = time.perf_counter() - start

    assert not [f for f in findings if f.severity is Severity.FAIL and f.id not in FIX_OWNS]
    shards = next(f for f in findings if f.id == "checkpoint.shards")
    assert shards.severity is Severity.OK and "8 safetensors" in shards.message
    index = next(f for f in findings if f.id == "checkpoint.index")
    assert index.severity is Severity.OK  # total_size agrees with the headers
    # headers (+ 1 KB sniff) only; how fast that is, is for bench/, not an assertion
    assert read_from_shards < 8 * 4096, read_from_shards
    print(f"8 x {SHARD_BYTES / 2**20:.0f} MiB shards validated in {elapsed * 1000:.1f} ms, "
          f"{read_from_shards} bytes read from them")


# -- facts contract --------------------------------------------------------------------------


def test_facts_carry_the_agreed_fields(ckpt: Path) -> None:
    facts = probe_checkpoint(ckpt)
    names = {f.name for f in dataclasses.fields(CheckpointFacts)}
    assert {
        "path", "name", "config", "config_error", "config_is_symlink",
        "modeling_text_supports_kv", "gptq", "weights_layout", "kernel_sources",
        "loader_sha256", "repo_id", "revision", "missing_requirements",
    } <= names
    assert set(facts.kernel_sources) == {
        "cache_autogptq_cuda_256.cpp", "cache_autogptq_cuda_kernel_256.cu"
    }
    assert facts.repo_id is None and facts.revision is None


def test_refetch_without_a_known_repo_says_so(ckpt: Path) -> None:
    facts = probe_checkpoint(ckpt)
    cmd = refetch(facts, ["a b.json"])
    assert cmd.startswith(f"{DOWNLOAD} {PLACEHOLDER_REPO} 'a b.json' --local-dir {ckpt}")
    assert "replace Qwen/Qwen-7B-Chat with the repo this checkpoint came from" in cmd


def test_hostile_nesting_never_crashes_the_probe(ckpt: Path) -> None:
    deep = "[" * 200_000
    (ckpt / "model.safetensors.index.json").write_text(deep)
    (ckpt / "config.json").write_text(deep)
    (ckpt / "tokenizer_config.json").write_text(deep)
    raw = deep.encode()
    shard = _shards(ckpt)[0]
    shard.write_bytes(struct.pack("<Q", len(raw)) + raw)
    findings = {(f.id, f.severity) for f in direct(ckpt)}
    assert ("checkpoint.index", Severity.FAIL) in findings
    assert ("config.parse", Severity.FAIL) in findings
    assert ("checkpoint.content", Severity.FAIL) in findings  # tokenizer_config.json
    assert probe_shard(shard, shard.name).error is not None
    assert not [f for f in direct(ckpt) if "crashed" in f.message]


def test_lfs_pointers_of_one_kind_are_one_finding_with_one_fix(ckpt: Path) -> None:
    for shard in _shards(ckpt):
        shard.write_bytes(LFS_POINTER)
    (ckpt / "qwen.tiktoken").write_bytes(LFS_POINTER)
    content = [f for f in direct(ckpt) if f.id == "checkpoint.content"]
    assert len(content) == 2  # the shards, and the tokenizer file
    shards = next(f for f in content if "safetensors" in f.message)
    names = [s.name for s in _shards(ckpt)]
    assert shards.paths == tuple(str(ckpt / n) for n in names)
    assert shards.fix is not None and " ".join(names) in shards.fix
    assert "HeaderTooLarge" in shards.message


@pytest.mark.parametrize("dry_run", [True, False])
def test_model_code_that_is_not_utf8_is_refused_before_the_first_write(
    ckpt: Path, work: Path, dry_run: bool
) -> None:
    """transformers reads modeling_qwen.py as UTF-8: fix refuses it before writing
    anything (config.json and cpp_kernels.py stay as they were), naming the file."""
    path = ckpt / "modeling_qwen.py"
    path.write_bytes(path.read_bytes().replace(b"import", b"imp\xffort", 1))
    before = snapshot(work)
    code, doc = run_cli(["fix", str(ckpt), "--json", "--no-build", "--no-smoke",
                         *(["--dry-run"] if dry_run else [])])
    assert code == 1, doc
    (refusal,) = [f for f in doc["findings"] if f["severity"] == "fail"]
    assert f"{path} is not UTF-8 (byte 0xff at line" in refusal["message"]
    assert snapshot(work) == before
