"""End to end on a generated tiny checkpoint: `qwen-kvprep fix DIR`, then a NEW process,
started in ANOTHER working directory, does nothing but
`AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` and must run every
attention layer's quantized cache through our compiled extension (not the pure-torch
fallback), with scores that match the fallback's within fp16 tolerance.

Runs on the CPU, so it needs no GPU: with a CPU torch the extension is the kernels' .cpp
alone; with a CUDA torch and an nvcc of its CUDA major version it is the CUDA build, whose
CPU path runs here; with a CUDA torch and no such nvcc, the CPU-only build (the toolkit is
made explicit: tests/toolkit.py). The build cache is the session's shared one (compiled
once).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from qwen_kvprep.buildcache.builder import plan_build
from qwen_kvprep.common import COMPAT_FILE, KERNEL_FILES, sha256_file
from qwen_kvprep.probe.toolchain import nvcc_info
from qwen_kvprep.resources import kernels_dir
from qwen_kvprep.tiny import generate_checkpoint
from tests.cli import kvprep, python
from tests.remote_code import code_folder
from tests.toolkit import matching_toolkit
from tests.treesnap import snapshot

pytestmark = pytest.mark.slow

# Loads the model exactly as a server would, then reports what every layer uses and the
# scores of the same token stream through the extension and through the fallback.
PROBE = r"""
import json, sys, warnings
import torch
from transformers import AutoModelForCausalLM

warnings.simplefilter("ignore")
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
attn = [block.attn for block in model.transformer.h]
report = {
    "quantized": [bool(a.use_cache_quantization) for a in attn],
    "kernel_files": [getattr(a.cache_kernels, "__file__", None) for a in attn],
}
prompt = torch.tensor([[5, 17, 99, 3, 42, 7, 250, 11, 64]])
tokens = model.generate(prompt, max_new_tokens=12, do_sample=False, top_p=None, top_k=None)

def scores():
    # prefill, then one token at a time through the quantized cache (teacher forcing on
    # the same token stream, so both paths are compared step by step)
    for a in attn:
        a.kernel_calls = 0
    with torch.no_grad():
        out = model(tokens[:, : prompt.size(1)], use_cache=True)
        past, logits = out.past_key_values, [out.logits[:, -1]]
        for t in range(prompt.size(1), tokens.size(1)):
            out = model(tokens[:, t : t + 1], past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits.append(out.logits[:, -1])
    return torch.cat(logits).float(), [a.kernel_calls for a in attn]

kernel, report["kernel_calls"] = scores()
for a in attn:
    a.cache_kernels = None  # the model's own pure-torch dequantize path
fallback, report["fallback_calls"] = scores()
report["max_abs_diff"] = (kernel - fallback).abs().max().item()
report["max_abs_logit"] = fallback.abs().max().item()
report["argmax_agree"] = bool((kernel.argmax(-1) == fallback.argmax(-1)).all())
print("REPORT " + json.dumps(report))
"""


def torch_is_cuda() -> bool:
    import torch

    return torch.version.cuda is not None


def _env(tmp: Path, cache: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["HF_HOME"] = str(tmp / "hf-home")
    env["HF_MODULES_CACHE"] = str(tmp / "hf-home" / "modules")
    env["QWEN_KVPREP_CACHE"] = str(cache)
    env.update(matching_toolkit())
    env.pop("TRANSFORMERS_CACHE", None)
    return env


def _kvprep(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return kvprep(*args, env=env, cwd=cwd, timeout=1800)


def _findings(stdout: str) -> dict[str, dict[str, Any]]:
    doc = json.loads(stdout)
    return {f["id"]: f for f in doc["findings"]}


@pytest.fixture(scope="module")
def fixed(tmp_path_factory: pytest.TempPathFactory, shared_build_cache: Path) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("e2e")
    ckpt = generate_checkpoint(tmp / "tiny", dtype="fp32")
    env = _env(tmp, shared_build_cache)
    workdir = tmp / "fix-cwd"
    workdir.mkdir()
    done = _kvprep(["fix", str(ckpt), "--no-smoke", "--json"], env, workdir)
    assert done.returncode == 0, done.stdout + done.stderr
    return {"tmp": tmp, "ckpt": ckpt, "env": env, "fix": _findings(done.stdout)}


def test_fix_reports_every_step(fixed: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    findings = fixed["fix"]
    for fid in (
        "config.patch",
        "build.mode",
        "build.build",
        "build.loader",
        "modules.plant",
        "checkpoint.state",
    ):
        assert fid in findings, sorted(findings)
    for fid in ("config.patch", "build.build", "build.loader", "modules.plant", "checkpoint.state"):
        assert findings[fid]["severity"] in ("ok", "info"), findings[fid]
    # the build this torch and toolkit call for: CPU-only with a CPU torch (or without
    # nvcc), CUDA with a CUDA torch and a matching nvcc, as the builder itself decides
    monkeypatch.setenv("CUDA_HOME", fixed["env"]["CUDA_HOME"])
    plan = plan_build({n: (kernels_dir() / n).read_bytes() for n in KERNEL_FILES})
    assert findings["build.mode"]["message"] == plan.mode
    expected = "CUDA build" if plan.cuda else "CPU-only build"
    assert findings["build.mode"]["message"].startswith(expected)
    assert plan.cuda == bool(torch_is_cuda() and nvcc_info()[0] is not None)
    # a CUDA torch with a CPU-only build leaves GPU users without the kernel: said loudly
    loud = torch_is_cuda() and not plan.cuda
    mode = findings["build.mode"]
    assert mode["severity"] == ("warn" if loud else "info"), mode


def test_new_process_elsewhere_uses_the_extension_in_every_layer(fixed: dict[str, Any]) -> None:
    tmp, ckpt, env = fixed["tmp"], fixed["ckpt"], fixed["env"]
    elsewhere = tmp / "server-cwd"  # neither the checkpoint nor the modules cache
    elsewhere.mkdir()
    env = dict(env, PYTHONPATH="")  # nothing from the checkout's cwd either
    done = python(PROBE, str(ckpt), env=env, cwd=elsewhere, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("REPORT "))
    report = json.loads(line[len("REPORT ") :])
    state = json.loads((ckpt / ".qwen-kvprep" / "state.json").read_text())
    so = state["build"]["so"]
    assert Path(so).is_relative_to(Path(env["QWEN_KVPREP_CACHE"]) / "builds")
    layers = len(report["quantized"])
    assert layers >= 2 and all(report["quantized"])
    assert report["kernel_files"] == [so] * layers  # our build, not a fallback, every layer
    assert all(n > 0 for n in report["kernel_calls"]), report
    assert report["fallback_calls"] == [0] * layers
    # fp16 inputs to the kernel against the fp32 fallback: well inside 1% of the logit scale
    assert report["max_abs_diff"] <= 1e-2 * max(1.0, report["max_abs_logit"]), report
    assert report["argmax_agree"], report
    assert "Failed to import KV cache kernels" not in done.stderr
    assert "not found" not in done.stderr


def test_modules_cache_holds_sources_and_loader(fixed: dict[str, Any]) -> None:
    ckpt, env = fixed["ckpt"], fixed["env"]
    folder = code_folder(Path(env["HF_MODULES_CACHE"]), ckpt)
    state = json.loads((ckpt / ".qwen-kvprep" / "state.json").read_text())
    assert Path(state["modules"]["folder"]) == folder
    for name in (*KERNEL_FILES, "cpp_kernels.py"):
        assert sha256_file(folder / name) == sha256_file(ckpt / name), name
        assert state["modules"]["files"][name] == sha256_file(folder / name)
    assert (ckpt / "cpp_kernels.py").read_text().startswith("# qwen-kvprep loader")


def test_second_fix_changes_nothing_and_is_quick(fixed: dict[str, Any]) -> None:
    ckpt, env, tmp = fixed["ckpt"], fixed["env"], fixed["tmp"]
    before = snapshot(ckpt)
    start = time.monotonic()
    done = _kvprep(["fix", str(ckpt), "--no-smoke", "--json"], env, tmp)
    took = time.monotonic() - start
    assert done.returncode == 0, done.stderr
    findings = _findings(done.stdout)
    for fid in ("config.patch", "build.build", "build.loader", "modules.plant", "checkpoint.state"):
        assert findings[fid]["severity"] == "ok", findings[fid]
    assert findings["build.build"]["details"]["compiled"] is False
    assert snapshot(ckpt) == before
    assert took < 120  # no compile: imports of torch/transformers dominate


def test_dry_run_lists_every_write_and_writes_nothing(
    tmp_path: Path, shared_build_cache: Path
) -> None:
    ckpt = generate_checkpoint(tmp_path / "fresh", dtype="fp32")
    env = _env(tmp_path, shared_build_cache)
    before = snapshot(ckpt)
    done = _kvprep(["fix", str(ckpt), "--dry-run", "--no-smoke", "--json"], env, tmp_path)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    paths = {Path(p["path"]) for p in doc["would_write"]}
    for name in ("config.json", "cpp_kernels.py", *KERNEL_FILES, COMPAT_FILE):
        assert ckpt / name in paths, name
    planted = {p.parent for p in paths if p.name in KERNEL_FILES and ckpt not in p.parents}
    ids = {f["id"]: f for f in doc["findings"]}
    assert "build.build" in ids and "checkpoint.state" in ids
    assert snapshot(ckpt) == before
    # nothing planted, no remote code copied (importing transformers may create hub/)
    assert not Path(env["HF_MODULES_CACHE"]).exists()
    # the folders the dry run names are those fix then plants into (on transformers 5, a
    # hash of the code as fix leaves it, which the dry run has not written)
    done = _kvprep(["fix", str(ckpt), "--no-smoke", "--json"], env, tmp_path)
    assert done.returncode == 0, done.stderr
    state = json.loads((ckpt / ".qwen-kvprep" / "state.json").read_text())
    modules = code_folder(Path(env["HF_MODULES_CACHE"]), ckpt)
    assert Path(state["modules"]["folder"]) == modules
    assert planted == {modules, *map(Path, state["modules"]["also"])}
    for name in ("cpp_kernels.py", *KERNEL_FILES):
        assert modules / name in paths, name


LOAD_BY_REPO_ID = r"""
import json, sys, warnings
warnings.simplefilter("ignore")
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
print("FILES " + json.dumps([getattr(b.attn.cache_kernels, "__file__", None)
                             for b in model.transformer.h]))
"""


def test_hub_snapshot_loaded_by_repo_id_uses_the_extension(
    tmp_path: Path, shared_build_cache: Path
) -> None:
    """A huggingface_hub cache snapshot is usually loaded by repo id; transformers then runs
    it from transformers_modules/<org>/<name>/<commit>/, which fix plants into too."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    hub = tmp_path / "hf-home" / "hub"
    repo = hub / "models--KvprepTest--Tiny"
    ckpt = generate_checkpoint(repo / "snapshots" / commit, dtype="fp32")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    env = _env(tmp_path, shared_build_cache)
    done = _kvprep(["fix", str(ckpt), "--no-smoke", "--json"], env, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    env = dict(env, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hub))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    loaded = python(LOAD_BY_REPO_ID, "KvprepTest/Tiny", env=env, cwd=elsewhere, timeout=900)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    files = json.loads(next(x for x in loaded.stdout.splitlines() if x.startswith("FILES "))[6:])
    state = json.loads((ckpt / ".qwen-kvprep" / "state.json").read_text())
    assert files == [state["build"]["so"]] * len(files)
    folder = Path(env["HF_MODULES_CACHE"]) / "transformers_modules" / "KvprepTest" / "Tiny"
    assert (folder / commit / "cache_autogptq_cuda_256.cpp").is_file()


def test_no_build_loader_finds_a_matching_build_by_its_manifest(
    fixed: dict[str, Any], tmp_path: Path
) -> None:
    """fix --no-build renders no build key: the loader matches the running torch against
    the manifests in the cache (here: the build the first fix made)."""
    first = json.loads((fixed["ckpt"] / ".qwen-kvprep" / "state.json").read_text())
    built = Path(first["build"]["so"])
    # a cache that holds this build alone: the shared one may also hold other tests' builds
    # for this torch (a CPU-only one beside this CUDA one), and the loader may take any
    cache = tmp_path / "cache"
    shutil.copytree(built.parent, cache / "builds" / built.parent.name)
    ckpt = generate_checkpoint(tmp_path / "nobuild", dtype="fp32")
    env = _env(tmp_path, cache)
    done = _kvprep(["fix", str(ckpt), "--no-build", "--no-smoke", "--json"], env, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _findings(done.stdout)["build.build"]["severity"] == "skip"
    assert "_BUILD_KEY = None" in (ckpt / "cpp_kernels.py").read_text()
    # LOAD_BY_REPO_ID loads whatever path it is given
    loaded = python(LOAD_BY_REPO_ID, str(ckpt), env=env, cwd=tmp_path, timeout=900)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    files = json.loads(next(x for x in loaded.stdout.splitlines() if x.startswith("FILES "))[6:])
    assert files == [str(cache / "builds" / built.parent.name / built.name)] * len(files)
    assert "compiling" not in loaded.stderr  # found, not built
