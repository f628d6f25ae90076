"""Prebuilt kernels: `build --export DIR` on one machine, `fix --prebuilt SOURCE` on another
whose PATH holds only the Python interpreter (no compiler, nvcc or ninja), from a folder,
from a Hub repo through a loopback Hub, and offline from the Hub cache; refusals of a
tampered file and of a source without this machine's variant; the lock; prestart on a
fresh cache."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from qwen_kvprep.buildcache.builder import build_key
from qwen_kvprep.buildcache.variant import METADATA, SO_FILE, list_variants
from qwen_kvprep.common import KERNEL_FILES, sha256_file
from tests.advice import check_advice
from tests.cli import document, invoke, kvprep
from tests.test_hub import (
    COMMIT,
    REPO,
    FakeHub,
    fake_hub,  # noqa: F401  (the loopback Hub fixture)
)
from tests.treesnap import snapshot

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def exported(tmp_path: Path, isolated_hf: Path, shared_build_cache: Path) -> Path:
    """This machine's build exported as a variant folder (compiled once per session)."""
    dest = tmp_path / "export"
    res = invoke("build", "--export", str(dest), "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    return dest


@pytest.fixture()
def tiny(tmp_path: Path) -> Path:
    from qwen_kvprep.tiny import generate_checkpoint

    return Path(generate_checkpoint(tmp_path / "tiny-qwen", layers=2, shards=1))


def python_only_path(tmp_path: Path) -> str:
    """A folder holding only a `python` link, to be all of PATH. In a virtual environment
    its pyvenv.cfg and lib/ sit beside, as a venv's own bin/ has them."""
    root = tmp_path / "python-only"
    (root / "bin").mkdir(parents=True)
    os.symlink(sys.executable, root / "bin" / "python")
    if sys.prefix != sys.base_prefix:
        shutil.copyfile(Path(sys.prefix) / "pyvenv.cfg", root / "pyvenv.cfg")
        os.symlink(Path(sys.prefix) / "lib", root / "lib")
    folder = str(root / "bin")
    for tool in ("c++", "g++", "gcc", "cc", "nvcc", "ninja"):
        assert shutil.which(tool, path=folder) is None
    return folder


def child_env(tmp_path: Path, name: str, **more: str) -> dict[str, str]:
    """A machine of its own: no compiler on PATH, an empty build cache and HF home."""
    env = {
        "PATH": python_only_path(tmp_path / name),
        "HOME": str(tmp_path / name / "home"),
        "PYTHONPATH": str(ROOT),
        "QWEN_KVPREP_CACHE": str(tmp_path / name / "cache"),
        "HF_HOME": str(tmp_path / name / "hf"),
        "HF_ENDPOINT": "http://127.0.0.1:9",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "CUDA_HOME": str(tmp_path / name / "no-cuda"),
    }
    env.update(more)
    return env


def fix(directory: Path, env: dict[str, str], *args: str) -> tuple[int, dict[str, Any]]:
    res = kvprep("fix", str(directory), "--json", *args, env=env, timeout=600, cwd=ROOT)
    return res.returncode, document(res)


def finding(doc: dict[str, Any], fid: str) -> dict[str, Any]:
    found = [f for f in doc["findings"] if f["id"] == fid]
    assert found, f"no {fid} among {[f['id'] for f in doc['findings']]}"
    return dict(found[-1])


def the_variant(folder: Path) -> Path:
    (variant,) = list_variants(folder)[0]
    return variant.folder


def prebuilt_key(metadata: dict[str, Any]) -> str:
    text = f"prebuilt\0{metadata['key']}\0{metadata['manifest']['so_sha256']}"
    return hashlib.sha256(text.encode()).hexdigest()


def assert_prebuilt_ok(doc: dict[str, Any], variant: Path, cache: Path, layers: int) -> None:
    build = finding(doc, "build.build")
    assert build["severity"] == "ok" and "nothing compiled" in build["message"]
    assert doc["build"]["compiled"] is False
    metadata = json.loads((variant / METADATA).read_text())
    # installed under a key of its own (the ABI key and the library's sha256), never the
    # key a local compile of the same inputs uses
    key = prebuilt_key(metadata)
    assert doc["build"]["key"] == key != metadata["key"]
    assert (cache / "builds" / key / SO_FILE).is_file()
    manifest = json.loads((cache / "builds" / key / "manifest.json").read_text())
    assert manifest["origin"] == "prebuilt" and manifest["abi_key"] == metadata["key"]
    assert not (cache / "builds" / metadata["key"]).exists()
    assert not list(cache.glob("logs/*"))  # no failed compile either
    if layers:
        kernel = finding(doc, "smoke.kernel")
        assert kernel["severity"] == "ok", kernel
        assert f"in all {layers} layers" in kernel["message"]


# -- export -------------------------------------------------------------------------------
def test_export_layout_names_the_abi_and_hashes_every_file(exported: Path) -> None:
    import torch

    variant = the_variant(exported)
    name = variant.name
    abi = "cxx11" if torch._C._GLIBCXX_USE_CXX11_ABI else "cxx98"  # torch 2.0 wheels: cxx98
    assert name.startswith(f"torch{torch.__version__.split('+')[0]}-{abi}-")
    assert f"-cp{sys.version_info[0]}{sys.version_info[1]}-" in name and name.endswith("-linux")
    metadata = json.loads((variant / METADATA).read_text())
    assert set(metadata["files"]) == {SO_FILE, *KERNEL_FILES}
    for rel, digest in metadata["files"].items():
        assert sha256_file(variant / rel) == digest
    assert metadata["key"] == build_key(metadata["manifest"]["inputs"])
    assert metadata["sources"] == metadata["manifest"]["inputs"]["sources"]
    assert sorted(p.name for p in variant.iterdir()) == sorted([METADATA, *metadata["files"]])


def test_export_again_keeps_other_machines_variants(exported: Path) -> None:
    other = exported / "build" / "torch2.4.0-cxx11-cu121-sm80-cp310-x86_64-linux"
    shutil.copytree(the_variant(exported), other)
    res = invoke("build", "--export", str(exported), "--json")
    assert res.returncode == 0
    doc = document(res)
    assert "replaced the variant" in finding(doc, "prebuilt.export")["message"]
    assert other.is_dir() and sorted(os.listdir(exported / "build")) == sorted(
        [other.name, doc["variant"]]
    )


# -- fix --prebuilt DIR -------------------------------------------------------------------
def test_fix_from_folder_without_a_compiler_then_prestart_on_fresh_caches(
    exported: Path, tiny: Path, tmp_path: Path
) -> None:
    env = child_env(tmp_path, "server")
    code, doc = fix(tiny, env, "--prebuilt", str(exported))
    assert code == 0, doc
    variant = the_variant(exported)
    assert_prebuilt_ok(doc, variant, Path(env["QWEN_KVPREP_CACHE"]), layers=2)
    for name in KERNEL_FILES:  # the sources planted are those the variant was built from
        assert (tiny / name).read_bytes() == (variant / name).read_bytes()
    state = json.loads((tiny / ".qwen-kvprep" / "state.json").read_text())
    assert state["sources"]["origin"] == "prebuilt"
    assert state["sources"]["prebuilt"] == str(exported)

    # a new pod: empty build cache and modules cache; prestart installs the variant again
    shutil.rmtree(env["QWEN_KVPREP_CACHE"])
    shutil.rmtree(Path(env["HF_HOME"]) / "modules", ignore_errors=True)
    res = kvprep("prestart", str(tiny), "--", "python", "-c", "print('served')",
                 env=env, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert "served" in res.stdout
    metadata = json.loads((variant / METADATA).read_text())
    assert (Path(env["QWEN_KVPREP_CACHE"]) / "builds" / prebuilt_key(metadata) / SO_FILE).is_file()


def test_tampered_so_is_refused_with_its_sha256(
    exported: Path, tiny: Path, tmp_path: Path
) -> None:
    so = the_variant(exported) / SO_FILE
    with open(so, "ab") as fh:
        fh.write(b"\0")
    got = sha256_file(so)
    env = child_env(tmp_path, "server")
    before = snapshot(tiny, digest=True)
    code, doc = fix(tiny, env, "--prebuilt", str(exported), "--no-smoke")
    assert code == 1
    bad = finding(doc, "prebuilt.verify")
    assert SO_FILE in bad["message"] and got in bad["message"]
    assert bad["details"]["files"] == {SO_FILE: got}
    assert snapshot(tiny, digest=True) == before
    assert not (Path(env["QWEN_KVPREP_CACHE"]) / "builds").exists()


def _retarget(variant: Path, torch_version: str) -> Path:
    """The variant rewritten as if built with another torch (a consistent variant that
    is not this machine's)."""
    from qwen_kvprep.buildcache.variant import variant_name

    metadata = json.loads((variant / METADATA).read_text())
    inputs = metadata["manifest"]["inputs"]
    inputs["torch"] = torch_version
    metadata["key"] = metadata["manifest"]["key"] = build_key(inputs)
    name = variant_name(inputs, metadata["manifest"]["cuda"])
    metadata["variant"] = name
    target = variant.parent / name
    variant.rename(target)
    (target / METADATA).write_text(json.dumps(metadata))
    return target


def test_missing_variant_names_what_is_needed(exported: Path, tiny: Path, tmp_path: Path) -> None:
    mine = the_variant(exported).name
    other = _retarget(the_variant(exported), "1.0.0+cpu")
    env = child_env(tmp_path, "server")
    before = snapshot(tiny, digest=True)
    code, doc = fix(tiny, env, "--prebuilt", str(exported), "--no-smoke")
    assert code == 1
    missing = finding(doc, "prebuilt.variant")
    assert mine in missing["message"] and other.name in missing["message"]
    assert "'1.0.0+cpu'" in missing["message"]  # why the one it has does not fit
    assert f"qwen-kvprep build --export {exported}" in missing["fix"]
    assert missing["details"]["needed"] == mine
    assert snapshot(tiny, digest=True) == before
    assert not Path(env["QWEN_KVPREP_CACHE"]).exists()


def test_a_model_folder_as_source_is_never_advised_as_the_export_folder(
    tiny: Path, tmp_path: Path
) -> None:
    """`fix --prebuilt DIR` with a model folder (no build/ in it): the advice exports beside
    it, never into it (build --export would write build/ among the model's files)."""
    env = child_env(tmp_path, "server")
    before = snapshot(tiny, digest=True)
    code, doc = fix(tiny, env, "--prebuilt", str(tiny), "--no-smoke")
    assert code == 1
    missing = finding(doc, "prebuilt.variant")
    (export,) = [c for c in check_advice(missing["fix"], models=[tiny]) if "--export" in c]
    assert f"--export {tiny.parent / 'qwen-kvprep-variants'}" in export
    assert snapshot(tiny, digest=True) == before


def test_variant_of_other_sources_is_refused_where_sources_are_asked_for(
    exported: Path, tiny: Path, tmp_path: Path
) -> None:
    variant = the_variant(exported)
    source = variant / KERNEL_FILES[0]
    source.write_bytes(source.read_bytes() + b"\n// changed\n")
    metadata = json.loads((variant / METADATA).read_text())
    digest = sha256_file(source)
    inputs = metadata["manifest"]["inputs"]
    inputs["sources"][KERNEL_FILES[0]] = digest
    metadata["sources"] = inputs["sources"]
    metadata["files"][KERNEL_FILES[0]] = digest
    metadata["key"] = metadata["manifest"]["key"] = build_key(inputs)
    (variant / METADATA).write_text(json.dumps(metadata))
    before = snapshot(tiny, digest=True)
    res = invoke("fix", str(tiny), "--prebuilt", str(exported), "--source", "vendored",
                 "--no-smoke", "--json", "--cache-dir", str(tmp_path / "cache"))
    assert res.returncode == 1
    refused = finding(document(res), "prebuilt.variant")
    assert "built from other kernel sources than qwen-kvprep's own" in refused["message"]
    assert snapshot(tiny, digest=True) == before and not (tmp_path / "cache").exists()


def test_a_variant_of_other_sources_sits_beside_ours_and_auto_prefers_ours(
    exported: Path, tiny: Path, tmp_path: Path
) -> None:
    """Exporting a build of other sources for the same ABI replaced ours (one folder name
    per ABI); now each set of sources has its own, and --source picks among them."""
    import hashlib

    from qwen_kvprep.buildcache.variant import variant_name

    ours = the_variant(exported)
    other = exported / "build" / ".staged"
    shutil.copytree(ours, other)
    cpp = (other / KERNEL_FILES[0]).read_bytes() + b"\n// patched\n"
    (other / KERNEL_FILES[0]).write_bytes(cpp)
    metadata = json.loads((other / METADATA).read_text())
    inputs = metadata["manifest"]["inputs"]
    inputs["sources"][KERNEL_FILES[0]] = hashlib.sha256(cpp).hexdigest()
    metadata["sources"] = inputs["sources"]
    metadata["files"][KERNEL_FILES[0]] = inputs["sources"][KERNEL_FILES[0]]
    metadata["key"] = metadata["manifest"]["key"] = build_key(inputs)
    name = metadata["variant"] = variant_name(inputs, metadata["manifest"]["cuda"])
    assert name.startswith(f"{ours.name}-src") and len(name) == len(ours.name) + 12
    (other / METADATA).write_text(json.dumps(metadata))
    other.rename(exported / "build" / name)
    assert sorted(v.name for v in list_variants(exported)[0]) == [ours.name, name]
    for policy in ("auto", "vendored"):
        cache = tmp_path / f"cache-{policy}"
        res = invoke("fix", str(tiny), "--prebuilt", str(exported), "--source", policy,
                     "--no-smoke", "--json", "--cache-dir", str(cache), "--dry-run")
        assert res.returncode == 0, res.stdout
        assert json.loads(res.stdout)["prebuilt"]["variant"] == ours.name


@pytest.mark.parametrize("how", ["key", "no-sources"])
def test_inconsistent_metadata_makes_a_variant_unusable(
    exported: Path, tiny: Path, how: str
) -> None:
    variant = the_variant(exported)
    metadata = json.loads((variant / METADATA).read_text())
    if how == "key":
        metadata["key"] = "0" * 64
        said = "metadata.json's key does not match"
    else:  # consistent, but no kernel sources: it installed and planted none in DIR
        inputs = metadata["manifest"]["inputs"]
        inputs["sources"] = metadata["sources"] = {}
        metadata["files"] = {SO_FILE: metadata["files"][SO_FILE]}
        metadata["key"] = metadata["manifest"]["key"] = build_key(inputs)
        said = "metadata.json records no kernel sources"
    (variant / METADATA).write_text(json.dumps(metadata))
    before = snapshot(tiny, digest=True)
    res = invoke("fix", str(tiny), "--prebuilt", str(exported), "--no-smoke", "--json")
    assert res.returncode == 1
    refused = finding(document(res), "prebuilt.variant")
    assert f"{variant.name} ({said}" in refused["message"]
    assert snapshot(tiny, digest=True) == before


def test_not_a_source_is_a_usage_error(tiny: Path, tmp_path: Path) -> None:
    res = invoke("fix", str(tiny), "--prebuilt", "no such thing", "--no-smoke")
    assert res.returncode == 2 and "neither a folder, a lock file nor a Hub repo id" in res.stderr


def test_a_folder_inside_an_export_is_refused_naming_the_export(
    exported: Path, tiny: Path
) -> None:
    # the advice was to export into it, which nests a second export inside the first
    for inner in (the_variant(exported), exported / "build"):
        res = invoke("fix", str(tiny), "--prebuilt", str(inner), "--no-smoke")
        assert res.returncode == 2, res.stderr
        assert "inside an export" in res.stderr and f"--prebuilt {exported}" in res.stderr


# -- the Hub ------------------------------------------------------------------------------
def _serve(hub: FakeHub, exported: Path) -> Path:
    """The export as a Hub repo, with a second variant (another torch) beside ours."""
    decoy = exported.parent / "decoy"
    shutil.copytree(exported, decoy)
    decoy_variant = _retarget(the_variant(decoy), "1.0.0+cpu")
    shutil.copytree(decoy_variant, exported / "build" / decoy_variant.name)
    files = {
        str(p.relative_to(exported)): p.read_bytes() for p in exported.rglob("*") if p.is_file()
    }
    hub.serve_repo(files)
    return exported / "build" / decoy_variant.name


def test_fix_from_the_hub_then_offline_from_its_cache(
    fake_hub: FakeHub, exported: Path, tiny: Path, tmp_path: Path  # noqa: F811
) -> None:
    decoy = _serve(fake_hub, exported)
    variant = exported / "build" / the_variant_name(exported, decoy)
    env = child_env(tmp_path, "server", HF_ENDPOINT=fake_hub.endpoint)
    code, doc = fix(tiny, env, "--prebuilt", REPO, "--no-smoke")
    assert code == 0, doc
    assert_prebuilt_ok(doc, variant, Path(env["QWEN_KVPREP_CACHE"]), layers=0)
    assert doc["prebuilt"]["revision"] == COMMIT
    fetched = [path for _, path in fake_hub.requests]
    assert any(p.endswith(f"{variant.name}/{SO_FILE}") for p in fetched)
    assert not any(f"{decoy.name}/{SO_FILE}" in p for p in fetched)  # only our variant

    # offline: a new checkpoint and build cache, the same Hub cache, no request at all
    fake_hub.requests.clear()
    from qwen_kvprep.tiny import generate_checkpoint

    second = Path(generate_checkpoint(tmp_path / "second", layers=2, shards=1))
    offline = dict(env, HF_HUB_OFFLINE="1", QWEN_KVPREP_CACHE=str(tmp_path / "cache2"))
    code, doc = fix(second, offline, "--prebuilt", REPO)
    assert code == 0, doc
    assert_prebuilt_ok(doc, variant, tmp_path / "cache2", layers=2)
    assert fake_hub.requests == []


def test_a_damaged_copy_in_the_hub_cache_is_named_and_fetch_repairs_it(
    fake_hub: FakeHub, exported: Path, tiny: Path, tmp_path: Path  # noqa: F811
) -> None:
    decoy = _serve(fake_hub, exported)
    name = the_variant_name(exported, decoy)
    res = invoke("build", "--fetch", REPO, "--json")
    assert res.returncode == 0, res.stdout
    # the blob the snapshot links to, damaged (a disk error, a hand edit)
    snapshot_so = Path(document(res)["root"]) / "build" / name / SO_FILE
    blob = Path(os.path.realpath(snapshot_so))
    assert blob != snapshot_so and "blobs" in blob.parts
    blob.write_bytes(blob.read_bytes() + b"x")
    env = child_env(tmp_path, "server", HF_HUB_OFFLINE="1",
                    HF_HUB_CACHE=str(tmp_path / "hf-cache"))
    code, doc = fix(tiny, env, "--prebuilt", REPO, "--no-smoke")
    assert code == 1
    refused = finding(doc, "prebuilt.verify")
    assert f"qwen-kvprep build --fetch {REPO}" in refused["fix"], refused
    # removing the snapshot's link and fetching again linked the same damaged blob: fetch
    # now downloads what fails verification anew
    res = invoke("build", "--fetch", REPO, "--json")
    assert res.returncode == 0, res.stdout
    assert ": downloaded damaged files anew" in res.stdout  # (the decoy shares the blob)
    assert sha256_file(snapshot_so) == sha256_file(exported / "build" / name / SO_FILE)
    code, doc = fix(tiny, env, "--prebuilt", REPO, "--no-smoke")
    assert code == 0, doc


def the_variant_name(exported: Path, decoy: Path) -> str:
    (name,) = [p.name for p in (exported / "build").iterdir() if p.name != decoy.name]
    return name


def test_offline_without_the_cache_says_to_fetch(tiny: Path, tmp_path: Path) -> None:
    env = child_env(tmp_path, "server", HF_HUB_OFFLINE="1")
    code, doc = fix(tiny, env, "--prebuilt", REPO, "--no-smoke")
    assert code == 1
    fetch = finding(doc, "prebuilt.fetch")
    assert "HF_HUB_OFFLINE" in fetch["message"]
    assert f"qwen-kvprep build --fetch {REPO}" in fetch["fix"]


def test_lock_pins_the_digests_and_fetch_fills_the_cache_for_offline_use(
    fake_hub: FakeHub, exported: Path, tiny: Path, tmp_path: Path  # noqa: F811
) -> None:
    _serve(fake_hub, exported)
    lock = tmp_path / "kvprep.lock.json"
    lock.symlink_to(tmp_path / "elsewhere.json")
    res = invoke("build", "--lock", REPO, "--lock-file", str(lock), "--json")
    assert res.returncode == 2 and "a symlink, not a regular file" in res.stdout
    assert lock.is_symlink() and not (tmp_path / "elsewhere.json").exists()
    lock.unlink()
    res = invoke("build", "--lock", REPO, "--lock-file", str(lock), "--json")
    assert res.returncode == 0, res.stdout
    pinned = json.loads(lock.read_text())
    assert pinned["source"] == REPO and pinned["revision"] == COMMIT
    assert len(pinned["variants"]) == 2

    # the image build: every variant into the Hub cache the server will use offline
    hf_cache = tmp_path / "hf-cache"  # the fake_hub fixture's HF_HUB_CACHE
    res = invoke("build", "--fetch", str(lock), "--json")
    assert res.returncode == 0, res.stdout
    assert len(document(res)["variants"]) == 2
    env = child_env(tmp_path, "server", HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hf_cache))
    code, doc = fix(tiny, env, "--prebuilt", str(lock), "--no-smoke")
    assert code == 0, doc

    # the repo changes under the lock: refused, nothing installed
    for key in list(fake_hub.routes):
        if key[2].endswith(METADATA) and key[1] == "main":
            reply = fake_hub.routes[key]
            fake_hub.serve({key[2]: reply.body + b"\n"}, revision="main")
            fake_hub.serve({key[2]: reply.body + b"\n"}, revision=COMMIT)
    online = child_env(tmp_path, "other", HF_ENDPOINT=fake_hub.endpoint)
    from qwen_kvprep.tiny import generate_checkpoint

    other = Path(generate_checkpoint(tmp_path / "other-ckpt", layers=1, shards=1))
    before = snapshot(other, digest=True)
    code, doc = fix(other, online, "--prebuilt", str(lock), "--no-smoke")
    assert code == 1
    assert "pins" in finding(doc, "prebuilt.lock")["message"]
    assert snapshot(other, digest=True) == before


def test_a_tampered_lock_is_refused_with_the_command_that_writes_it_anew(
    tmp_path: Path,
) -> None:
    from qwen_kvprep.errors import UsageError
    from qwen_kvprep.steps.prebuilt import parse_source

    folder = tmp_path / "export"
    folder.mkdir()
    pinned = {"key": "0" * 64, "metadata_sha256": "1" * 64, "files": {}}
    good = {"lock_version": 1, "source": str(folder), "revision": None,
            "variants": {"v": pinned}}
    lock = tmp_path / "kvprep.lock.json"

    def refusal(data: Any) -> str:
        if isinstance(data, bytes):
            lock.write_bytes(data)
        else:
            lock.write_text(json.dumps(data))
        with pytest.raises(UsageError) as err:
            parse_source(str(lock))
        assert "build --lock SOURCE --lock-file FILE" in str(err.value.fix)
        return err.value.message

    lock.write_text(json.dumps(good))
    assert parse_source(str(lock)).folder == folder
    hub = {**good, "source": "org/kernels", "revision": "a" * 40}
    lock.write_text(json.dumps(hub))
    assert parse_source(str(lock)).revision == "a" * 40
    # a source that is itself, or any file: refused, not followed (it recursed until
    # Python's limit and said the lock "nests more than 16 levels deep")
    assert "neither a folder nor a Hub repo id" in refusal({**good, "source": str(lock)})
    assert "neither a folder nor a Hub repo id" in refusal({**good, "source": "/etc/passwd"})
    # a Hub source pins a commit, not a branch that moves or a path out of the refs
    for rev in ("main", "../../../../tmp/evil", "A" * 40):
        assert "is not a commit" in refusal({**hub, "revision": rev}), rev
    assert "pins no commit" in refusal({**hub, "revision": None})
    assert "is not UTF-8" in refusal(b'{"lock_version": 1, "source": "\xc0"}')
    assert "is not valid JSON" in refusal(b"{")
    with pytest.raises(UsageError, match="is not a branch, tag or commit"):
        parse_source("org/kernels@../../../tmp/evil")


# -- doctor -------------------------------------------------------------------------------
def test_doctor_reports_the_source_the_needed_variant_and_whether_it_is_there(
    exported: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mine = the_variant(exported).name
    monkeypatch.setenv("QWEN_KVPREP_PREBUILT", str(exported))
    doc = document(invoke("doctor", "--json"))
    assert str(exported) in finding(doc, "prebuilt.source")["message"]
    assert mine in finding(doc, "prebuilt.needed")["message"]
    there = finding(doc, "prebuilt.variant")
    assert there["severity"] == "ok" and mine in there["message"]

    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("QWEN_KVPREP_PREBUILT", str(empty))
    missing = finding(document(invoke("doctor", "--json")), "prebuilt.variant")
    assert missing["severity"] == "warn" and mine in missing["message"]
    assert "build --export" in missing["fix"]


# -- templates ----------------------------------------------------------------------------
def test_docker_template_prebuilt_has_no_compiler_and_fetches_at_build() -> None:
    from qwen_kvprep.templating import render

    text = render("docker", prebuilt="kvprep.lock.json")
    assert "devel" not in text and "g++" not in text and "--arch" not in text
    assert "COPY kvprep.lock.json /opt/qwen-kvprep/kvprep.lock.json" in text
    assert "RUN qwen-kvprep build --fetch /opt/qwen-kvprep/kvprep.lock.json" in text
    assert "HF_HUB_OFFLINE=1" in text
    assert "QWEN_KVPREP_PREBUILT=/opt/qwen-kvprep/kvprep.lock.json" in text
    assert 'ENTRYPOINT ["qwen-kvprep", "prestart", "--"]' in text


def test_k8s_template_prebuilt_shares_no_build_cache() -> None:
    from qwen_kvprep.templating import render

    text = render("k8s", prebuilt="Org/kernels@v1")
    assert "ReadWriteMany" not in text and "PersistentVolumeClaim\n" not in text
    assert "name: build-cache" not in text
    assert "- --prebuilt\n            - Org/kernels@v1\n" in text
    assert text.count("/prepared/kvprep-cache") == 2  # fix installs where prestart looks


@pytest.mark.parametrize("value", ["Org/x; rm -rf /", "../lock.json", "a b/c"])
def test_template_refuses_unsafe_prebuilt_values(value: str) -> None:
    res = invoke("template", "docker", "--prebuilt", value)
    assert res.returncode == 2 and "--prebuilt" in res.stderr


def test_entrypoint_template_has_no_prebuilt_option() -> None:
    res = invoke("template", "entrypoint", "--prebuilt", "Org/kernels")
    assert res.returncode == 2 and "QWEN_KVPREP_PREBUILT" in res.stderr


def test_an_unwritable_export_or_lock_file_is_named_with_advice_that_fits(
    exported: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    from qwen_kvprep.errors import FileSystemError
    from qwen_kvprep.steps import prebuilt

    dest = tmp_path / "exp"

    def read_only(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EROFS, "Read-only file system", str(dest / "build" / ".v.tmp"))

    monkeypatch.setattr(prebuilt, "export", read_only)
    monkeypatch.setattr(prebuilt, "vendored_sources", lambda: {})
    with pytest.raises(FileSystemError) as err:
        prebuilt.export_build(dest, prebuilt.Outcome([], {}), None, None)  # type: ignore[arg-type]
    assert "--output" not in str(err.value.fix)  # fix's advice for a read-only DIR

    lock = tmp_path / "kvprep.lock.json"
    monkeypatch.setattr(prebuilt, "atomic_write_text", read_only)
    with pytest.raises(FileSystemError) as err:
        prebuilt.write_lock(str(exported), lock)
    # the lock file, not the temporary file written first
    assert err.value.message == f"{lock} is on a read-only file system"
    assert "--output" not in str(err.value.fix)
