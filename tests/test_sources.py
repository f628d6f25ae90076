"""Choosing the kernel sources (`fix --source auto|vendored`), the torch rule for Qwen's
own sources, and the doctor checks kernels.sources / kernels.official_compat."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import pytest

from qwen_kvprep import catalogue, resources
from qwen_kvprep.checks import kernels as kernel_checks
from qwen_kvprep.errors import SourceError, UsageError
from qwen_kvprep.findings import Finding, Severity, as_list
from qwen_kvprep.journal import Journal
from qwen_kvprep.jsontypes import JSON
from qwen_kvprep.probe.checkpoint import CheckpointFacts
from qwen_kvprep.probe.facts import Facts
from qwen_kvprep.steps import sources
from qwen_kvprep.steps.context import FixContext, FixOptions
from tests.cli import invoke

CPP_NAME, CU_NAME = resources.KERNEL_FILES
OFFICIAL = {CPP_NAME: b"// official binding stand-in\n", CU_NAME: b"// official kernel stand-in\n"}
OURS = {CPP_NAME: b"// our binding\n", CU_NAME: b"// our kernels\n"}
NEW_TORCH = ("2.13.0+cpu", None)
OLD_TORCH = ("2.5.1+cu124", "12.4")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(autouse=True)
def swapped_data(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Our kernels/ and the known-good list replaced by small stand-ins."""
    kernels = tmp_path / "pkg-kernels"
    kernels.mkdir()
    for name, body in OURS.items():
        (kernels / name).write_bytes(body)
    monkeypatch.setattr(resources, "kernels_dir", lambda: kernels)
    files = {n: catalogue.KnownFile(n, _sha(b), len(b)) for n, b in OFFICIAL.items()}
    known = catalogue.KnownGood(files, ("Qwen/Qwen-7B-Chat",))
    monkeypatch.setattr(catalogue, "known_good", lambda: known)
    monkeypatch.setattr(sources, "_torch_info", lambda: OLD_TORCH)
    return kernels


@pytest.fixture()
def ckpt(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "qwen"}\n')
    return d


def run(directory: Path, **options: Any) -> FixContext:
    opts = FixOptions(smoke=False, progress=False, **options)
    ctx = FixContext(directory, opts, Journal(directory, dry_run=opts.dry_run))
    sources.run(ctx)
    return ctx


def put(directory: Path, files: dict[str, bytes]) -> None:
    for name, body in files.items():
        (directory / name).write_bytes(body)


def read(directory: Path) -> dict[str, Optional[bytes]]:
    return {
        n: (directory / n).read_bytes() if (directory / n).exists() else None
        for n in resources.KERNEL_FILES
    }


# -- auto / vendored -------------------------------------------------------------------------
def test_vendored_into_an_empty_checkpoint_and_revert(ckpt: Path) -> None:
    ctx = run(ckpt, source="vendored")
    assert read(ckpt) == OURS
    assert (ctx.sources.origin, ctx.sources.kind) == ("vendored", catalogue.OURS)
    assert dict(ctx.sources.files) == OURS
    assert ctx.extra["sources"]["files"] == {n: _sha(b) for n, b in OURS.items()}
    (done,) = ctx.findings
    assert done.id == "kernels.sources" and done.severity is Severity.OK
    assert "wrote" in done.message
    ctx.journal.revert()
    assert read(ckpt) == {n: None for n in resources.KERNEL_FILES}


def test_auto_without_sources_uses_vendored(ckpt: Path) -> None:
    ctx = run(ckpt)
    assert read(ckpt) == OURS
    assert ctx.sources.origin == "vendored"


def test_auto_keeps_ours(ckpt: Path) -> None:
    put(ckpt, OURS)
    ctx = run(ckpt)
    assert (ctx.sources.origin, ctx.sources.kind) == ("checkpoint", catalogue.OURS)
    assert ctx.journal.changed_files == []


def test_auto_keeps_official_when_torch_can_build_them(ckpt: Path) -> None:
    put(ckpt, OFFICIAL)
    ctx = run(ckpt)
    assert (ctx.sources.origin, ctx.sources.kind) == ("checkpoint", catalogue.OFFICIAL)
    assert dict(ctx.sources.files) == OFFICIAL
    assert read(ckpt) == OFFICIAL
    assert ctx.journal.changed_files == []


def test_auto_replaces_official_when_torch_is_too_new(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sources, "_torch_info", lambda: NEW_TORCH)
    put(ckpt, OFFICIAL)
    ctx = run(ckpt)
    assert read(ckpt) == OURS
    assert ctx.sources.origin == "vendored"
    (note,) = [f for f in ctx.findings if f.id == "kernels.official_compat"]
    assert note.severity is Severity.INFO and "2.13.0" in note.message
    ctx.journal.revert()
    assert read(ckpt) == OFFICIAL


def test_auto_replaces_modified_files_and_says_so(ckpt: Path) -> None:
    edited = {CPP_NAME: OURS[CPP_NAME] + b"// local edit\n", CU_NAME: OURS[CU_NAME]}
    put(ckpt, edited)
    ctx = run(ckpt)
    assert read(ckpt) == OURS
    (w,) = [f for f in ctx.findings if f.severity is Severity.WARN]
    assert w.id == "kernels.sources" and CPP_NAME in w.message
    assert w.details["replaced"] == {CPP_NAME: _sha(edited[CPP_NAME])}
    assert "revert" in (w.fix or "")
    ctx.journal.revert()
    assert read(ckpt) == edited


def test_auto_replaces_a_mixed_pair(ckpt: Path) -> None:
    # an official .cpp binds functions our .cu does not define: never keep half a pair
    put(ckpt, {CPP_NAME: OFFICIAL[CPP_NAME], CU_NAME: OURS[CU_NAME]})
    ctx = run(ckpt)
    assert read(ckpt) == OURS
    assert ctx.sources.origin == "vendored"


def test_vendored_replaces_official(ckpt: Path) -> None:
    put(ckpt, OFFICIAL)
    run(ckpt, source="vendored")
    assert read(ckpt) == OURS


def test_symlinked_sources_are_replaced_not_written_through(ckpt: Path, tmp_path: Path) -> None:
    # a huggingface_hub snapshot: the files are links into blobs shared with other snapshots
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for name in resources.KERNEL_FILES:
        (blobs / name).write_bytes(b"something else\n")
        os.symlink(blobs / name, ckpt / name)
    ctx = run(ckpt)
    assert read(ckpt) == OURS
    assert not any((ckpt / n).is_symlink() for n in resources.KERNEL_FILES)
    assert all((blobs / n).read_bytes() == b"something else\n" for n in resources.KERNEL_FILES)
    ctx.journal.revert()
    assert all((ckpt / n).is_symlink() for n in resources.KERNEL_FILES)


def test_dry_run_writes_nothing(ckpt: Path) -> None:
    ctx = run(ckpt, dry_run=True)
    assert read(ckpt) == {n: None for n in resources.KERNEL_FILES}
    assert not (ckpt / ".qwen-kvprep").exists()
    assert sorted(p.path.name for p in ctx.journal.planned) == sorted(resources.KERNEL_FILES)
    assert "would write" in ctx.findings[-1].message


def test_missing_vendored_kernels_is_a_clear_refusal(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(resources, "kernels_dir", lambda: tmp_path / "nowhere")
    with pytest.raises(SourceError) as info:
        run(ckpt, source="vendored")
    (f,) = info.value.findings
    assert f.id == "kernels.sources" and "reinstall" in (f.fix or "")
    assert read(ckpt) == {n: None for n in resources.KERNEL_FILES}


@pytest.mark.parametrize("source", ["auto", "vendored"])
def test_repo_options_need_hub(ckpt: Path, source: str) -> None:
    with pytest.raises(UsageError) as info:
        run(ckpt, source=source, repo_id="Qwen/Qwen-7B-Chat")
    assert "--source hub" in (info.value.fix or "")


def test_unknown_source_value(ckpt: Path) -> None:
    with pytest.raises(UsageError):
        run(ckpt, source="github")


def test_hub_refuses_official_sources_torch_cannot_build(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sources, "_torch_info", lambda: NEW_TORCH)
    # no server anywhere: the refusal must come before any download
    with pytest.raises(SourceError) as info:
        run(ckpt, source="hub", repo_id="Qwen/Qwen-7B-Chat")
    (f,) = info.value.findings
    assert f.id == "kernels.official_compat" and f.severity is Severity.FAIL
    assert "--source vendored" in (f.fix or "") and "--no-build" in (info.value.fix or "")
    assert read(ckpt) == {n: None for n in resources.KERNEL_FILES}


def test_hub_without_build_only_warns_about_torch(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.hf_settings import set_hf_constant

    monkeypatch.setattr(sources, "_torch_info", lambda: NEW_TORCH)
    set_hf_constant(monkeypatch, "HF_HUB_OFFLINE", True)
    set_hf_constant(monkeypatch, "HF_HUB_CACHE", str(ckpt.parent / "empty-cache"))
    opts = FixOptions(source="hub", repo_id="Qwen/Qwen-7B-Chat", build=False, progress=False)
    ctx = FixContext(ckpt, opts, Journal(ckpt))
    with pytest.raises(SourceError) as info:  # offline and nothing cached: stops at the fetch
        sources.run(ctx)
    assert info.value.findings[0].id == "kernels.fetch"
    (w,) = [f for f in ctx.findings if f.id == "kernels.official_compat"]
    assert w.severity is Severity.WARN


# -- the torch rule --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("version", "cuda", "status"),
    [
        ("2.1.2", "12.1", "ok"),
        ("2.5.1+cu124", "12.4", "ok"),
        ("1.13.1", "11.7", "ok"),
        ("2.6.0", "12.4", "no"),
        ("2.6.0a0+gitabcdef", "12.4", "no"),
        ("2.11.0+cu130", "13.0", "no"),
        ("2.13.0+cpu", None, "no"),
        ("2.4.0+cpu", None, "no"),  # old enough, but the sources are CUDA-only
        ("2.4.0", "", "no"),
        (None, None, "unknown"),
        ("not-a-version", "12.1", "unknown"),
    ],
)
def test_official_compat_rule(version: Optional[str], cuda: Optional[str], status: str) -> None:
    assert catalogue.official_compat(version, cuda).status == status


def test_bundled_known_good_list_matches_the_facts() -> None:
    real = catalogue.load_known_good()
    assert real.files[CPP_NAME].size == 8404
    assert real.files[CPP_NAME].sha256.startswith("225066b519e0d47c")
    assert real.files[CU_NAME].size == 51991
    assert real.files[CU_NAME].sha256.startswith("86e976adcc298566")
    assert "Qwen/Qwen-7B-Chat" in real.repos


# -- where --source hub looks --------------------------------------------------------------
def test_resolve_repo(tmp_path: Path) -> None:
    facts = Facts(checkpoint=SimpleNamespace(repo_id="Qwen/Qwen-7B-Chat", revision="c0ffee"))
    assert sources.resolve_repo(tmp_path, facts, None, None) == ("Qwen/Qwen-7B-Chat", "c0ffee")
    assert sources.resolve_repo(tmp_path, facts, None, "v2") == ("Qwen/Qwen-7B-Chat", "v2")
    # another repo than the snapshot's: its commit means nothing there
    assert sources.resolve_repo(tmp_path, facts, "Qwen/Qwen-14B-Chat", None) == (
        "Qwen/Qwen-14B-Chat",
        "main",
    )
    plain = Facts(checkpoint=SimpleNamespace(repo_id=None, revision=None))
    assert sources.resolve_repo(tmp_path, plain, None, None) == (None, "main")
    snap = tmp_path / "hub" / "models--Qwen--Qwen-1_8B-Chat" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    assert sources.resolve_repo(snap, None, None, None) == ("Qwen/Qwen-1_8B-Chat", "abc123")


# -- doctor ----------------------------------------------------------------------------------
def _facts(
    kernel_sources: Optional[dict[str, Optional[str]]] = None,
    torch: Optional[tuple[Optional[str], Optional[str]]] = None,
    module_files: Optional[dict[str, Optional[str]]] = None,
    config: Optional[dict[str, JSON]] = None,
) -> Facts:
    cp = (
        CheckpointFacts(
            path=Path("/models/q"),
            name="q",
            config={"model_type": "qwen", **(config or {})},
            kernel_sources=kernel_sources,
        )
        if kernel_sources is not None
        else None
    )
    env = SimpleNamespace(torch_version=torch[0], torch_cuda=torch[1]) if torch else None
    caches = None
    if module_files is not None:
        folder = SimpleNamespace(
            path="/hf/modules/transformers_modules/q", exists=True, files=module_files
        )
        caches = SimpleNamespace(module_folders=(folder,))
    return Facts(env=env, checkpoint=cp, caches=caches)


def sources_check(facts: Facts) -> list[Finding]:
    return as_list(kernel_checks.kernel_sources(facts))


def compat_check(facts: Facts) -> Finding:
    (f,) = as_list(kernel_checks.official_compat(facts))
    return f


def _hashes(files: dict[str, bytes]) -> dict[str, Optional[str]]:
    return {n: _sha(b) for n, b in files.items()}


NONE: dict[str, Optional[str]] = {n: None for n in resources.KERNEL_FILES}


@pytest.mark.parametrize(
    ("held", "severity", "words"),
    [
        (_hashes(OFFICIAL), Severity.OK, "official"),
        (_hashes(OURS), Severity.OK, "qwen-kvprep's"),
        (NONE, Severity.WARN, "no kernel sources"),
        ({CPP_NAME: _sha(b"x"), CU_NAME: _sha(OURS[CU_NAME])}, Severity.WARN, "modified/unknown"),
        (
            {CPP_NAME: _sha(OFFICIAL[CPP_NAME]), CU_NAME: _sha(OURS[CU_NAME])},
            Severity.WARN,
            "different sets",
        ),
        ({CPP_NAME: _sha(OURS[CPP_NAME]), CU_NAME: None}, Severity.WARN, "missing"),
    ],
)
def test_kernels_sources_check(
    held: dict[str, Optional[str]], severity: Severity, words: str
) -> None:
    (f,) = sources_check(_facts(held))
    assert f.id == "kernels.sources" and f.severity is severity
    assert words in f.message
    if severity is Severity.WARN:
        assert "qwen-kvprep fix /models/q" in (f.fix or "")


KERNEL_ON: dict[str, JSON] = {"use_cache_quantization": True, "use_cache_kernel": True}


@pytest.mark.parametrize("held", [NONE, {CPP_NAME: _sha(b"x"), CU_NAME: None}])
def test_kernels_sources_check_fails_where_the_config_asks_for_the_kernel(
    held: dict[str, Optional[str]],
) -> None:
    # a server started now would silently run the slow path: doctor exits 1
    (f,) = sources_check(_facts(held, config=KERNEL_ON))
    assert f.severity is Severity.FAIL, f
    assert "a server started now silently runs without the kernel" in f.message
    assert f.fix == "qwen-kvprep fix /models/q"
    (good,) = sources_check(_facts(_hashes(OURS), config=KERNEL_ON))
    assert good.severity is Severity.OK


def test_kernels_sources_check_modified_names_the_hash() -> None:
    odd = _sha(b"x")
    (f,) = sources_check(_facts({CPP_NAME: odd, CU_NAME: None}))
    assert odd[:16] in f.message


def test_kernels_sources_check_judges_the_modules_cache_copy() -> None:
    # the first of the four failures: the checkpoint has them, the copy the model runs from does not
    findings = sources_check(_facts(_hashes(OURS), module_files=NONE))
    assert [f.severity for f in findings] == [Severity.OK, Severity.WARN]
    assert "modules cache /hf/modules" in findings[1].message


def test_kernels_sources_check_without_checkpoint() -> None:
    assert [f.severity for f in sources_check(Facts())] == [Severity.SKIP]


def test_official_compat_check() -> None:
    f = compat_check(_facts(_hashes(OFFICIAL), NEW_TORCH))
    assert f.severity is Severity.FAIL
    assert f.fix == "qwen-kvprep fix /models/q --source vendored"
    assert compat_check(_facts(_hashes(OFFICIAL), OLD_TORCH)).severity is (Severity.OK)
    # not holding them: just information
    assert compat_check(_facts(_hashes(OURS), NEW_TORCH)).severity is (Severity.INFO)
    assert compat_check(_facts(None, NEW_TORCH)).severity is Severity.INFO
    # official copy only in the modules cache still counts
    f = compat_check(_facts(NONE, NEW_TORCH, _hashes(OFFICIAL)))
    assert f.severity is Severity.FAIL
    assert compat_check(Facts()).severity is Severity.SKIP
    assert compat_check(_facts(None, (None, None))).severity is Severity.SKIP


def test_checks_are_registered() -> None:
    from qwen_kvprep.checks import load_all

    registry = load_all()
    assert {"kernels.sources", "kernels.official_compat"} <= set(registry)


# -- the command line ------------------------------------------------------------------------
def test_cli_hub_without_repo_lists_known_repos(tmp_path: Path) -> None:
    tiny = pytest.importorskip("qwen_kvprep.tiny")
    d = Path(tiny.generate_checkpoint(tmp_path / "tiny-model", layers=1, shards=1))
    res = invoke("fix", str(d), "--source", "hub", "--no-build", "--no-smoke")
    assert res.returncode == 2
    err = res.stderr
    assert "--repo-id" in err and "Qwen/Qwen-7B-Chat" in err
    assert not (d / CPP_NAME).exists()


def test_cli_rejects_unknown_source(tmp_path: Path) -> None:
    res = invoke("fix", str(tmp_path), "--source", "github")
    assert res.returncode == 2
    assert "github" in res.stderr
