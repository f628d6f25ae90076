"""doctor's exit rule on made-up facts (docs/reference.md, doctor, Exit code): a fix cut
short fails (`modules.complete`), and a toolchain problem fails only when a server started
now must compile the extension, the same before fix (the cache off) and after it."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from qwen_kvprep.checks.kernels import kernel_requested
from qwen_kvprep.common import KERNEL_FILES
from qwen_kvprep.findings import Severity
from qwen_kvprep.jsontypes import JSON
from qwen_kvprep.probe.caches import HUB, CacheFacts
from qwen_kvprep.probe.planned import PlannedFile
from tests.checks.facts import (
    CKPT,
    build,
    caches,
    ckpt,
    env_facts,
    facts,
    folder,
    text,
    usr_local,
    worst,
)

FOLDER = "/hf/modules/transformers_modules/Qwen_hyphen_7B_hyphen_Chat/0123456789abcdef"
KV = "qwen_kvprep_kv.py"
WROTE, BEFORE, OTHER = "1" * 64, "2" * 64, "3" * 64


def planted(name: str, found: Optional[str] = WROTE, **kw: Any) -> PlannedFile:
    return PlannedFile(f"{FOLDER}/{name}", FOLDER, WROTE, found, **kw)


def in_checkpoint(name: str, found: Optional[str] = WROTE, **kw: Any) -> PlannedFile:
    return PlannedFile(str(CKPT / name), None, WROTE, found, **kw)


def prepared(*planned: PlannedFile, fast: Optional[str] = WROTE, **kw: Any) -> CacheFacts:
    """The modules-cache folder of a prepared checkpoint (holding `fast` as the fast path's
    module) and what the journal says fix wrote."""
    mf = folder()
    files = {**mf.files, KV: fast}
    return caches(
        module_folders=(dataclasses.replace(mf, path=FOLDER, files=files, **kw),),
        planned_files=planned,
    )


def fast_ckpt(**kw: Any) -> Any:
    return ckpt(fast_path_imported=True, fast_module_sha256=WROTE, **kw)


# ------------------------------------------------------------------ modules.complete


def test_everything_fix_wrote_in_place_is_ok() -> None:
    done = prepared(planted("cpp_kernels.py"), planted(KV), in_checkpoint("config.json"))
    assert worst("modules.complete", facts(checkpoint=fast_ckpt(), cache=done)) is Severity.OK
    # no journal, and model code without the fast path: nothing to finish
    assert worst("modules.complete", facts(checkpoint=ckpt(), cache=caches())) is Severity.OK


def test_a_planted_file_missing_fails_with_fix_and_revert() -> None:
    cut = prepared(planted("cpp_kernels.py"), planted(KV, None, what="nothing"), fast=None)
    f = facts(checkpoint=fast_ckpt(), cache=cut)
    assert worst("modules.complete", f) is Severity.FAIL
    t = text("modules.complete", f)
    assert f"{FOLDER}/{KV} is missing" in t
    assert "fast path is not loaded" in t
    assert f"`qwen-kvprep fix {CKPT}`" in t and f"`qwen-kvprep revert {CKPT}`" in t


def test_a_planted_source_left_at_its_earlier_version_fails() -> None:
    source = "cache_autogptq_cuda_256.cpp"
    cut = prepared(planted(source, BEFORE, earlier=True))
    f = facts(checkpoint=fast_ckpt(), cache=cut)
    assert worst("modules.complete", f) is Severity.FAIL
    t = text("modules.complete", f)
    assert "still holds what was there before fix wrote it" in t
    assert "KV cache kernel source files (.cpp and .cu) not found." in t


def test_the_fast_path_module_missing_beside_code_that_imports_it_fails() -> None:
    """Cut short before its journal named the file: only the model code's import tells."""
    cut = prepared(planted("cpp_kernels.py"), fast=None)
    f = facts(checkpoint=fast_ckpt(), cache=cut)
    assert worst("modules.complete", f) is Severity.FAIL
    assert f"{FOLDER}/{KV} is missing" in text("modules.complete", f)
    other = prepared(fast=OTHER)
    assert worst("modules.complete", facts(checkpoint=fast_ckpt(), cache=other)) is (
        Severity.FAIL
    )
    # a folder that does not exist yet is modules.folder's to judge
    absent = caches(module_folders=(folder(exists=False),))
    assert worst("modules.complete", facts(checkpoint=fast_ckpt(), cache=absent)) is (
        Severity.OK
    )


def test_a_modules_cache_fix_never_prepared_is_not_a_fix_cut_short() -> None:
    """A fresh HF_HOME: the folder transformers made lacks fix's files, and neither the
    journal nor the state names it. Never revert: the folder's own files are right."""
    fresh = caches(module_folders=(folder(sources=False),))
    # this release's fix: the folder serves it by itself, nothing to do
    served = facts(checkpoint=fast_ckpt(serves_any_modules_cache=True), cache=fresh)
    for check_id in ("modules.complete", "modules.folder"):
        assert worst(check_id, served) is Severity.OK, text(check_id, served)
        assert "revert" not in text(check_id, served)
    assert "no kernel sources, and none needed there" in text("kernels.sources", served)
    # an earlier release's: the load falls back until prestart prepares this cache
    earlier = facts(checkpoint=fast_ckpt(), cache=fresh)
    assert worst("modules.complete", earlier) is Severity.OK
    assert worst("modules.folder", earlier) is Severity.FAIL
    t = text("modules.folder", earlier)
    assert f"`qwen-kvprep prestart {CKPT} -- CMD`" in t and "never prepared" in t
    assert "revert" not in t
    # a folder fix planted in that lost a file is a fix cut short, whatever the release
    cut = prepared(planted("cpp_kernels.py"), planted(KV, None, what="nothing"), fast=None)
    cut_short = facts(checkpoint=fast_ckpt(serves_any_modules_cache=True), cache=cut)
    assert worst("modules.complete", cut_short) is Severity.FAIL
    assert "cut short" in text("modules.complete", cut_short)


def test_in_the_checkpoint_only_what_fix_did_not_finish_fails() -> None:
    missing = prepared(in_checkpoint("qwen_kvprep_compat.py", None, what="nothing"))
    assert worst("modules.complete", facts(checkpoint=fast_ckpt(), cache=missing)) is (
        Severity.FAIL
    )
    original = prepared(in_checkpoint("modeling_qwen.py", BEFORE, earlier=True))
    assert worst("modules.complete", facts(checkpoint=fast_ckpt(), cache=original)) is (
        Severity.FAIL
    )
    # changed since fix wrote it: the user's file (state.journal warns), not a fix cut short
    edited = prepared(in_checkpoint("config.json", OTHER))
    assert worst("modules.complete", facts(checkpoint=fast_ckpt(), cache=edited)) is (
        Severity.OK
    )


def test_a_loader_transformers_replaces_at_every_load_is_the_checkpoint_s() -> None:
    """In a folder loaded by path transformers copies the checkpoint's cpp_kernels.py in at
    every load (another prepared folder of the same name may have planted its own); in the
    repo-id folder it copies only what is absent, so fix's copy must be there."""
    theirs = planted("cpp_kernels.py", OTHER)
    by_path = prepared(theirs)
    assert worst("modules.complete", facts(checkpoint=fast_ckpt(), cache=by_path)) is (
        Severity.OK
    )
    by_repo_id = prepared(theirs, how=HUB)
    assert worst("modules.complete", facts(checkpoint=fast_ckpt(), cache=by_repo_id)) is (
        Severity.FAIL
    )


# ------------------------------------------------------------------ toolchain problems


def _no_ninja() -> Any:
    return env_facts(ninja_path=None, ninja_beside_python=None)


def cache_off(**kw: Any) -> Any:
    cp = ckpt(**kw)
    assert isinstance(cp.config, dict)
    return dataclasses.replace(
        cp, config={**cp.config, "use_cache_quantization": False, "use_cache_kernel": False}
    )


def test_with_the_cache_off_a_toolchain_problem_is_a_warning() -> None:
    """Before fix (Qwen's original loader, the cache off), with or without a cached build: a
    server started now compiles nothing."""
    before_fix = cache_off(loader_is_ours=False)
    assert not kernel_requested(facts(checkpoint=before_fix))
    for cache in (caches(), caches(builds=(build(),))):
        f = facts(_no_ninja(), checkpoint=before_fix, cache=cache)
        assert worst("env.ninja", f) is Severity.WARN
        assert "config.json does not ask for the kernel" in text("env.ninja", f)


def test_usr_local_without_cudart_before_and_after_fix() -> None:
    """`cannot find -lcudart` through /usr/local/bin/nvcc: the failure is the original
    cpp_kernels.py's JIT build, so only where the config asks it to run."""
    built = caches(builds=(build(),))
    before_fix = facts(usr_local(), checkpoint=cache_off(loader_is_ours=False), cache=built)
    after_fix = facts(usr_local(), checkpoint=ckpt(), cache=built)
    assert worst("env.cuda_home", before_fix) is Severity.WARN
    assert worst("env.cuda_home", after_fix) is Severity.WARN
    asked = facts(usr_local(), checkpoint=ckpt(loader_is_ours=False), cache=built)
    assert worst("env.cuda_home", asked) is Severity.FAIL


def test_with_the_cache_on_a_toolchain_problem_fails_when_a_build_is_needed() -> None:
    sources = {n: "a" * 64 for n in KERNEL_FILES}  # the checkpoint's pair (ckpt())
    ours = build()
    inputs = ours.manifest["inputs"]
    assert isinstance(inputs, dict)
    ours_inputs: dict[str, JSON] = {**inputs, "sources": dict(sources)}
    serving = dataclasses.replace(ours, manifest={**ours.manifest, "inputs": ours_inputs})
    other_inputs: dict[str, JSON] = {**inputs, "sources": {n: "b" * 64 for n in sources}}
    other = dataclasses.replace(ours, manifest={**ours.manifest, "inputs": other_inputs})
    cases = [
        (ckpt(), caches(builds=(serving,)), Severity.WARN),  # after fix: the loader's build
        (ckpt(), caches(), Severity.FAIL),  # the loader compiles at the first load
        (ckpt(), caches(builds=(other,)), Severity.FAIL),  # a build of other sources
        (ckpt(loader_is_ours=False), caches(builds=(serving,)), Severity.FAIL),  # Qwen's JIT
        (None, caches(builds=(serving,)), Severity.WARN),  # no DIR: a build is cached
        (None, caches(), Severity.FAIL),
    ]
    for cp, cache, expected in cases:
        assert worst("env.ninja", facts(_no_ninja(), checkpoint=cp, cache=cache)) is expected, (
            cp, cache.builds
        )
