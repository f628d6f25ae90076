"""The tiny checkpoint generator and its remote code.

Layout tests run in-process. Everything that loads a model runs in a child process with
its own HF_HOME / HF_MODULES_CACHE (set before transformers is imported), once per
transformers version: the current interpreter's and, when present, .venv453's 4.53.3.
The child runs `_scenario` below (this file doubles as its script) and writes JSON.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests import needs
from tests.remote_code import with_compat

REPO = Path(__file__).resolve().parents[1]
VENV453_PYTHON = REPO / ".venv453" / "bin" / "python"
VENV_CUDA_PYTHON = REPO / ".venv-cuda" / "bin" / "python"  # CUDA build of torch, no GPU
KERNEL_FILES = ("cache_autogptq_cuda_256.cpp", "cache_autogptq_cuda_kernel_256.cu")
# Its greedy continuation keeps the top two scores at least 1.9 apart on every stack
# tried (torch 2.1, 2.13 and 2.14; transformers 4.32 and 4.53): far from a near-tie.
PROMPT = "What is two plus two?"

# Stand-in for the compiled extension: the two functions the model calls, in plain torch,
# asserting the calling convention (fp16 contiguous inputs, uint8 cache, zeroed output).
FAKE_CPP_KERNELS = '''
import types

import torch

CALLS = {"qk": 0, "pv": 0}


def _check(vec, mat, mul, scales, zeros):
    for t in (vec, mul, scales, zeros):
        assert t.dtype == torch.float16, t.dtype
    assert mat.dtype == torch.uint8, mat.dtype
    assert all(t.is_contiguous() for t in (vec, mat, mul, scales, zeros))
    assert not mul.any(), "output must arrive zeroed"


def vecquant8matmul_batched_faster_old(vec, mat, mul, scales, zeros):
    _check(vec, mat, mul, scales, zeros)
    b, h, q, d = vec.shape
    length = mat.shape[-1]
    assert mat.shape == (b, h, d, length) and mul.shape == (b, h, q, length)
    assert scales.shape == zeros.shape == (b, h, length, 1)
    deq = scales.float().transpose(-1, -2) * (mat.float() - zeros.float().transpose(-1, -2))
    mul.copy_(vec.float() @ deq)
    CALLS["qk"] += 1


def vecquant8matmul_batched_column_compression_faster_old(vec, mat, mul, scales, zeros):
    _check(vec, mat, mul, scales, zeros)
    b, h, q, length = vec.shape
    d = mat.shape[-1]
    assert mat.shape == (b, h, length, d) and mul.shape == (b, h, q, d)
    assert scales.shape == zeros.shape == (b, h, length, 1)
    deq = scales.float() * (mat.float() - zeros.float())
    mul.copy_(vec.float() @ deq)
    CALLS["pv"] += 1


cache_autogptq_cuda_256 = types.ModuleType("cache_autogptq_cuda_256")
cache_autogptq_cuda_256.vecquant8matmul_batched_faster_old = vecquant8matmul_batched_faster_old
cache_autogptq_cuda_256.vecquant8matmul_batched_column_compression_faster_old = (
    vecquant8matmul_batched_column_compression_faster_old
)
'''


# --------------------------------------------------------------------------------------
# In-process: what the generator writes
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from qwen_kvprep.tiny import generate_checkpoint

    return generate_checkpoint(tmp_path_factory.mktemp("gen") / "tiny_qwen")


def _tensors(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_layout_matches_a_qwen_v1_checkpoint(ckpt: Path) -> None:
    from qwen_kvprep.tiny import REMOTE_FILES

    names = {p.name for p in ckpt.iterdir()}
    assert names == {
        "config.json",
        *REMOTE_FILES,
        "qwen.tiktoken",
        "tokenizer_config.json",
        "generation_config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    }
    config = json.loads((ckpt / "config.json").read_text())
    assert config["model_type"] == "qwen"
    assert config["architectures"] == ["QWenLMHeadModel"]
    assert config["auto_map"] == {
        "AutoConfig": "configuration_qwen.QWenConfig",
        "AutoModelForCausalLM": "modeling_qwen.QWenLMHeadModel",
    }
    assert (config["bf16"], config["fp16"], config["fp32"]) == (True, False, False)
    assert config["use_flash_attn"] == "auto"
    assert config["kv_channels"] == 128
    assert not [k for k in config if k.startswith("use_cache_")]
    tok_config = json.loads((ckpt / "tokenizer_config.json").read_text())
    assert tok_config["auto_map"]["AutoTokenizer"] == ["tokenization_qwen.QWenTokenizer", None]
    gen = json.loads((ckpt / "generation_config.json").read_text())
    assert gen["chat_format"] == "chatml"
    assert gen["eos_token_id"] == gen["pad_token_id"] == 256 + 256  # first special token
    text = (ckpt / "modeling_qwen.py").read_text()
    assert "use_cache_quantization" in text and "cache_autogptq_cuda_256" in text
    assert sum(p.stat().st_size for p in ckpt.iterdir()) < 5_000_000


def test_index_total_size_and_tensor_names(ckpt: Path) -> None:
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    tensors = _tensors(ckpt)
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in tensors.values()
    )
    for name, fname in index["weight_map"].items():
        assert name in _tensors_of(ckpt / fname)
    expected = {"transformer.wte.weight", "transformer.ln_f.weight", "lm_head.weight"}
    for i in range(2):
        p = f"transformer.h.{i}."
        expected |= {
            p + "ln_1.weight",
            p + "ln_2.weight",
            p + "attn.c_attn.weight",
            p + "attn.c_attn.bias",
            p + "attn.c_proj.weight",
            p + "mlp.w1.weight",
            p + "mlp.w2.weight",
            p + "mlp.c_proj.weight",
        }
    assert set(tensors) == expected
    assert {str(t.dtype) for t in tensors.values()} == {"torch.bfloat16"}
    assert tensors["transformer.h.0.attn.c_attn.weight"].shape == (3 * 256, 256)
    assert tensors["lm_head.weight"].shape[0] % 128 == 0


def _tensors_of(path: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        return set(fh.keys())


def test_vocabulary_is_dense_byte_level_bpe(ckpt: Path) -> None:
    import base64

    lines = (ckpt / "qwen.tiktoken").read_bytes().splitlines()
    ranks = {base64.b64decode(tok): int(rank) for tok, rank in (ln.split() for ln in lines)}
    assert sorted(ranks.values()) == list(range(256 + 256))
    assert all(ranks[bytes([i])] == i for i in range(256))
    config = json.loads((ckpt / "config.json").read_text())
    assert len(ranks) + 208 <= config["vocab_size"] < len(ranks) + 208 + 128


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path, ckpt: Path) -> None:
    from qwen_kvprep.tiny import generate_checkpoint

    again = generate_checkpoint(tmp_path / "again")
    other = generate_checkpoint(tmp_path / "other", seed=1)
    for f in ckpt.iterdir():
        assert (again / f.name).read_bytes() == f.read_bytes(), f.name
    shard = "model-00001-of-00002.safetensors"
    assert (other / shard).read_bytes() != (ckpt / shard).read_bytes()
    assert (other / "qwen.tiktoken").read_bytes() == (ckpt / "qwen.tiktoken").read_bytes()


def test_variants(tmp_path: Path) -> None:
    from qwen_kvprep.tiny import REMOVE, generate_checkpoint

    legacy = generate_checkpoint(tmp_path / "legacy", legacy_bin=True)
    assert (legacy / "pytorch_model.bin").is_file()
    assert not list(legacy.glob("*.safetensors")) and not list(legacy.glob("*.index.json"))

    single = generate_checkpoint(tmp_path / "single", shards=1, layers=1)
    assert sorted(p.name for p in single.glob("*.safetensors")) == ["model.safetensors"]

    sharded = generate_checkpoint(tmp_path / "sharded", shards=5, layers=3)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [
        f"model-0000{i}-of-00005.safetensors" for i in range(1, 6)
    ]

    gptq = generate_checkpoint(tmp_path / "gptq", gptq=True)
    assert json.loads((gptq / "quantize_config.json").read_text())["bits"] == 4
    assert json.loads((gptq / "config.json").read_text())["quantization_config"][
        "quant_method"
    ] == "gptq"

    src = tmp_path / "src"
    src.mkdir()
    for name in KERNEL_FILES:
        (src / name).write_text(f"// {name}\n")
    with_src = generate_checkpoint(tmp_path / "with_src", kernel_sources=src)
    for name in KERNEL_FILES:
        assert (with_src / name).read_text() == f"// {name}\n"

    over = generate_checkpoint(
        tmp_path / "over",
        dtype="auto",
        config_overrides={"use_cache_quantization": True, "kv_channels": REMOVE},
    )
    config = json.loads((over / "config.json").read_text())
    assert config["use_cache_quantization"] is True and "kv_channels" not in config
    assert (config["bf16"], config["fp16"], config["fp32"]) == (False, False, False)


def test_refusals(tmp_path: Path) -> None:
    from qwen_kvprep.errors import UsageError
    from qwen_kvprep.tiny import generate_checkpoint

    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    with pytest.raises(UsageError, match="not an empty directory"):
        generate_checkpoint(busy)
    with pytest.raises(UsageError, match="dtype"):
        generate_checkpoint(tmp_path / "a", dtype="int8")
    with pytest.raises(UsageError, match="vocab_merges"):
        generate_checkpoint(tmp_path / "a", vocab_merges=5000)
    with pytest.raises(UsageError, match="kernel_sources"):
        generate_checkpoint(tmp_path / "b", kernel_sources=tmp_path)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_module_entry_point(tmp_path: Path) -> None:
    dest = tmp_path / "cli_made"
    proc = subprocess.run(
        [sys.executable, "-m", "qwen_kvprep.tiny", str(dest), "--layers", "1", "--shards", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads((dest / "config.json").read_text())["num_hidden_layers"] == 1
    again = subprocess.run(
        [sys.executable, "-m", "qwen_kvprep.tiny", str(dest)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 2 and "not an empty directory" in again.stderr


@pytest.mark.parametrize(
    ("release", "archs"),
    [("10.2", ["70"]), ("11.8", ["70", "80", "90"]), ("12.4", ["70", "80"]),
     ("12.8", ["70", "80", "90"]), ("13.0", ["70", "80"])],
)
def test_cpp_kernels_builds_like_the_original(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, release: str, archs: list[str]
) -> None:
    """nvcc version → arch flags, CWD-relative sources, build dir beside the file."""
    from torch.utils import cpp_extension

    from qwen_kvprep.tiny import REMOTE_CODE_DIR

    cuda = tmp_path / "cuda"
    (cuda / "bin").mkdir(parents=True)
    nvcc = cuda / "bin" / "nvcc"
    nvcc.write_text(
        "#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
        f"echo 'Cuda compilation tools, release {release}, V{release}.99'\n"
    )
    nvcc.chmod(0o755)
    module_dir = tmp_path / "modules" / "tiny_qwen"
    module_dir.mkdir(parents=True)
    script = module_dir / "cpp_kernels.py"
    script.write_bytes((REMOTE_CODE_DIR / "cpp_kernels.py").read_bytes())
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(cuda))
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: calls.append(kw) or "EXT")

    namespace = runpy.run_path(str(script))

    assert namespace["cache_autogptq_cuda_256"] == "EXT"
    (kw,) = calls
    assert kw["name"] == "cache_autogptq_cuda_256"
    assert kw["sources"] == ["./cache_autogptq_cuda_256.cpp", "./cache_autogptq_cuda_kernel_256.cu"]
    assert Path(kw["build_directory"]) == module_dir / "build"
    assert (module_dir / "build").is_dir()
    assert kw["extra_cflags"] == ["-O3"]
    flags = kw["extra_cuda_cflags"]
    assert flags[0] == "-O3" and flags[-1] == "--use_fast_math"
    assert flags[1:-1] == [x for a in archs for x in ("-gencode", f"arch=compute_{a},code=sm_{a}")]


def test_cpp_kernels_without_cuda_home_is_a_type_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.utils import cpp_extension

    from qwen_kvprep.tiny import REMOTE_CODE_DIR

    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    with pytest.raises(TypeError):
        runpy.run_path(str(REMOTE_CODE_DIR / "cpp_kernels.py"))


# --------------------------------------------------------------------------------------
# Child process: load, generate, quantized cache, kernel discovery
# --------------------------------------------------------------------------------------


def _scenario(ckpt: Path, out: Path) -> None:
    """Runs in a child process; HF_HOME and CUDA_HOME are set by the parent."""
    import warnings

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.dynamic_module_utils import (
        get_cached_module_file,
        get_imports,
        get_relative_imports,
    )
    from transformers.utils import HF_MODULES_CACHE

    res: dict[str, Any] = {
        "transformers": transformers.__version__,
        "torch_cuda_build": bool(torch.version.cuda),
    }
    res["imports"] = {
        name: sorted(get_imports(str(ckpt / name)))
        for name in ("modeling_qwen.py", "tokenization_qwen.py", "cpp_kernels.py")
    }
    res["relative"] = sorted(get_relative_imports(str(ckpt / "modeling_qwen.py")))

    tok = AutoTokenizer.from_pretrained(str(ckpt), trust_remote_code=True)
    text = "Hello! How are you today? <|im_start|>ünïcode 2048 \n\n"
    ids = tok(text)["input_ids"]
    tok.save_pretrained(str(out.parent / "saved_tok"))
    tok2 = AutoTokenizer.from_pretrained(str(out.parent / "saved_tok"), trust_remote_code=True)
    res["tok"] = {
        "class": type(tok).__name__,
        "roundtrip": tok.decode(ids) == text,
        "im_start_is_one_token": tok.im_start_id in ids,
        "skip_special": tok.decode(ids, skip_special_tokens=True)
        == text.replace("<|im_start|>", ""),
        "eod_id": tok.eod_id,
        "len": len(tok),
        "reloaded_same": tok2(text)["input_ids"] == ids,
    }

    enc = tok(PROMPT, return_tensors="pt")
    n_prompt = enc["input_ids"].shape[1]

    def load(**kw: Any) -> Any:
        # transformers 5 registers remote code's class at its first load and takes that
        # class again at every later one in the process: forget it, since this scenario
        # changes the code between loads
        extra = getattr(AutoModelForCausalLM._model_mapping, "_extra_content", None)
        if isinstance(extra, dict):
            extra.clear()
        return AutoModelForCausalLM.from_pretrained(str(ckpt), trust_remote_code=True, **kw).eval()

    def greedy(model: Any) -> list[int]:
        return model.generate(**enc, max_new_tokens=12, do_sample=False)[0, n_prompt:].tolist()

    def margins(model: Any) -> list[float]:
        """How far apart the top two scores of each greedy step are."""
        out = model.generate(**enc, max_new_tokens=12, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
        top = torch.stack(out.scores)[:, 0].float().topk(2, dim=-1).values
        return (top[:, 0] - top[:, 1]).tolist()

    def kv_warnings(caught: list[Any]) -> list[str]:
        return sorted({str(w.message) for w in caught if "KV cache" in str(w.message)})

    def attn_state(model: Any) -> dict[str, Any]:
        layers = [block.attn for block in model.transformer.h]
        return {
            "quant": [a.use_cache_quantization for a in layers],
            "kernel": [a.use_cache_kernel for a in layers],
            "cache_kernels": [
                None if a.cache_kernels is None else a.cache_kernels.__name__ for a in layers
            ],
            "calls": [a.kernel_calls for a in layers],
        }

    with torch.no_grad():
        plain = load()
        res["plain"] = {
            "dtype": str(plain.dtype),
            "use_flash_attn": plain.config.use_flash_attn,
            "tokens": greedy(plain),
            **attn_state(plain),
        }
        past = plain(**enc, use_cache=True).past_key_values
        res["plain"]["past"] = [[str(t.dtype), list(t.shape)] for t in past[0]]
        res["plain"]["margins"] = margins(plain)
        response, history = plain.chat(tok, "Hello!", history=None, max_new_tokens=6)
        res["chat"] = {"response_is_str": isinstance(response, str), "history": len(history)}
        res["chat_stream"] = list(plain.chat_stream(tok, "Hello!", max_new_tokens=6))

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fallback = load(
                use_cache_quantization=True, use_cache_kernel=True, use_flash_attn=False
            )
        res["fallback"] = {"warnings": kv_warnings(caught), "tokens": greedy(fallback)}
        first = fallback(**enc, use_cache=True)
        fallback_logits = first.logits.float()
        nxt = first.logits[:, -1:].argmax(-1)
        second = fallback(input_ids=nxt, past_key_values=first.past_key_values, use_cache=True)
        res["fallback"]["past"] = [
            [[str(t.dtype), list(t.shape)] for t in part] for part in first.past_key_values[0]
        ]
        res["fallback"]["past_after_step"] = [list(t.shape) for t in second.past_key_values[0][0]]
        _, scale, zero = first.past_key_values[0][0]
        res["fallback"]["scale_zero_constant_per_head"] = bool(
            (scale == scale[:, :, :1]).all() and (zero == zero[:, :, :1]).all()
        )
        res["fallback"].update(attn_state(fallback))

        def plant_placeholders() -> None:
            """The model looks for the sources beside its modules-cache copy (transformers
            5: a folder per content of the code, so again after each change of it)."""
            rel = get_cached_module_file(str(ckpt), "modeling_qwen.py")
            folder = Path(HF_MODULES_CACHE) / Path(rel).parent
            for name in KERNEL_FILES:
                (folder / name).write_text("// placeholder\n")

        plant_placeholders()
        try:
            load(use_cache_quantization=True, use_cache_kernel=True, use_flash_attn=False)
            res["official"] = "loaded"
        except Exception as exc:  # the point: which error the original loader raises
            res["official"] = f"{type(exc).__name__}: {exc}"

        (ckpt / "cpp_kernels.py").write_text("raise ImportError('no kernels in this test')\n")
        plant_placeholders()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            broken = load(use_cache_quantization=True, use_cache_kernel=True, use_flash_attn=False)
        res["importerror"] = {"warnings": kv_warnings(caught), **attn_state(broken)}

        (ckpt / "cpp_kernels.py").write_text(FAKE_CPP_KERNELS)
        plant_placeholders()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            kernel = load(use_cache_quantization=True, use_cache_kernel=True, use_flash_attn=False)
        res["kernel"] = {"warnings": kv_warnings(caught)}
        kernel_logits = kernel(**enc, use_cache=True).logits.float()
        res["kernel"]["calls_after_prefill"] = attn_state(kernel)["calls"]
        res["kernel"]["logits_max_diff"] = (kernel_logits - fallback_logits).abs().max().item()
        res["kernel"]["logits_scale"] = fallback_logits.abs().max().item()
        res["kernel"]["tokens"] = greedy(kernel)
        res["kernel"].update(attn_state(kernel))
        ext = sys.modules[type(kernel).__module__.rsplit(".", 1)[0] + ".cpp_kernels"]
        res["kernel"]["fake_calls"] = dict(ext.CALLS)

        # left-padded batch: the unpadded row decodes as it does alone
        tok.pad_token = "<|endoftext|>"
        tok.padding_side = "left"
        batch = tok(
            [PROMPT, "Hello"],
            return_tensors="pt",
            padding=True,
        )
        rows = kernel.generate(**batch, max_new_tokens=12, do_sample=False)
        res["kernel"]["batch_row0"] = rows[0, batch["input_ids"].shape[1] :].tolist()
        try:
            kernel.generate(**enc, max_new_tokens=2, num_beams=2, do_sample=False)
            res["beam_quantized"] = "ok"
        except AttributeError as exc:
            res["beam_quantized"] = f"AttributeError: {exc}"

        # Last, because flash_attn then stays importable in this process: a (fake)
        # flash-attn makes "auto" true in bf16 even with the quantized cache on, and
        # the flash path cannot take the quantized tuples.
        fake = out.parent / "fake_site" / "flash_attn"
        fake.mkdir(parents=True)
        (fake / "__init__.py").write_text("def flash_attn_func(*a, **kw):\n    raise OSError\n")
        sys.path.insert(0, str(fake.parent))
        flash = load(use_cache_quantization=True)
        attn = flash.transformer.h[0].attn
        res["flash"] = {"config": flash.config.use_flash_attn, "attn": attn.use_flash_attn}
        query = torch.zeros((1, n_prompt, 2, 128), dtype=torch.bfloat16)
        try:
            attn._flash(query, first.past_key_values[0][0], first.past_key_values[0][1])
        except AttributeError as exc:
            res["flash"]["with_quantized_cache"] = str(exc)

    out.write_text(json.dumps(res))


def _shipped_code_runs_in(python: Path) -> bool:
    """tests.remote_code.shipped_code_runs, asked of another interpreter."""
    out = subprocess.run(
        [str(python), "-c", "from tests.remote_code import shipped_code_runs as r; print(r())"],
        capture_output=True, text=True, check=True, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    ).stdout.strip()
    return out == "True"


def _run_scenario(python: Path, tmp: Path) -> dict[str, Any]:
    from qwen_kvprep.tiny import generate_checkpoint

    ckpt = generate_checkpoint(tmp / "tiny_qwen")
    # where the code as shipped cannot load, the compatibility lines fix adds (only those)
    compat_lines = not _shipped_code_runs_in(python)
    if compat_lines:
        with_compat(ckpt)
    cuda = tmp / "fake-cuda"
    (cuda / "bin").mkdir(parents=True)
    nvcc = cuda / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.4, V12.4.131'\n")
    nvcc.chmod(0o755)
    work = tmp / "cwd"
    work.mkdir()
    env = dict(os.environ)
    env.update(
        HF_HOME=str(tmp / "hf-home"),
        HF_MODULES_CACHE=str(tmp / "hf-home" / "modules"),
        CUDA_HOME=str(cuda),
        PYTHONPATH=str(REPO),
        TOKENIZERS_PARALLELISM="false",
    )
    out = tmp / "result.json"
    proc = subprocess.run(
        [str(python), str(Path(__file__).resolve()), "--scenario", str(ckpt), str(out)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result: dict[str, Any] = json.loads(out.read_text())
    result["stderr"] = proc.stderr
    result["compat_lines"] = compat_lines
    return result


@pytest.fixture(
    scope="module",
    params=[pytest.param(p, marks=pytest.mark.slow) for p in ("current", "4.53", "cuda-torch")],
)
def scenario(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    pythons = {"current": Path(sys.executable), "4.53": VENV453_PYTHON,
               "cuda-torch": VENV_CUDA_PYTHON}
    python = pythons[request.param]
    if not python.exists():
        kind = {"4.53": "venv-4.53", "cuda-torch": "venv-cuda"}[request.param]
        needs.skip(kind, f"{python} is not installed (.ci/run makes it)")
    res = _run_scenario(python, tmp_path_factory.mktemp(f"scenario-{request.param}"))
    if request.param == "4.53":
        assert res["transformers"] == "4.53.3"
    if request.param == "cuda-torch":
        assert res["torch_cuda_build"]
    return res


def test_transformers_import_checks_see_what_they_see_in_qwen(scenario: Any) -> None:
    imports = set(scenario["imports"]["modeling_qwen.py"])
    assert {"einops", "torch", "transformers"} <= imports
    # the compatibility lines take chat_stream's import out of transformers' check
    assert ("transformers_stream_generator" in imports) is not scenario["compat_lines"]
    assert "flash_attn" not in scenario["imports"]["modeling_qwen.py"]
    assert "tiktoken" in scenario["imports"]["tokenization_qwen.py"]
    assert set(scenario["relative"]) >= {
        "configuration_qwen",
        "qwen_generation_utils",
        "cpp_kernels",
    }


def test_tokenizer(scenario: Any) -> None:
    tok = scenario["tok"]
    assert tok["class"] == "QWenTokenizer"
    assert tok["roundtrip"] and tok["im_start_is_one_token"] and tok["skip_special"]
    assert tok["reloaded_same"]
    assert tok["eod_id"] == 512 and tok["len"] == 512 + 208


def test_plain_cache_generates_greedily(scenario: Any) -> None:
    plain = scenario["plain"]
    assert plain["dtype"] == "torch.bfloat16"
    assert plain["use_flash_attn"] is False  # "auto" without flash_attn installed
    assert len(plain["tokens"]) == 12
    assert plain["quant"] == [False, False] and plain["cache_kernels"] == [None, None]
    assert plain["calls"] == [0, 0]
    n = plain["past"][0][1][1]
    assert plain["past"] == [["torch.bfloat16", [1, n, 2, 128]]] * 2
    assert scenario["chat"] == {"response_is_str": True, "history": 1}
    assert all(isinstance(s, str) for s in scenario["chat_stream"])


def test_quantized_cache_falls_back_without_sources(scenario: Any) -> None:
    fb = scenario["fallback"]
    assert fb["warnings"] == ["KV cache kernel source files (.cpp and .cu) not found."]
    assert fb["quant"] == [True, True] and fb["kernel"] == [True, True]
    assert fb["cache_kernels"] == [None, None] and fb["calls"] == [0, 0]
    n = fb["past"][0][0][1][2]
    triple = [["torch.uint8", [1, 2, n, 128]], ["torch.bfloat16", [1, 2, n, 1]],
              ["torch.bfloat16", [1, 2, n, 1]]]
    assert fb["past"] == [triple, triple]
    assert fb["past_after_step"] == [[1, 2, n + 1, 128], [1, 2, n + 1, 1], [1, 2, n + 1, 1]]
    assert fb["scale_zero_constant_per_head"]
    # the tiny model is built so that the 8-bit cache does not change greedy decoding: it
    # moves the scores by ~0.13 at most (qwen_kvprep/tiny), and PROMPT keeps clear of the
    # rare near-ties (some prompts meet one within 12 tokens, on some torch releases)
    assert min(scenario["plain"]["margins"]) >= 0.25, scenario["plain"]["margins"]
    assert fb["tokens"] == scenario["plain"]["tokens"]


def test_original_loader_error_propagates(scenario: Any) -> None:
    """Sources planted, original cpp_kernels.py: from_pretrained itself fails."""
    if scenario["torch_cuda_build"]:
        # nvcc runs (a fake one here), then the CWD-relative source path is missing
        assert scenario["official"].startswith("FileNotFoundError")
        assert "cache_autogptq_cuda_256.cpp" in scenario["official"]
    else:
        # a CPU build of torch has CUDA_HOME None: None + "/bin/nvcc"
        assert scenario["official"].startswith("TypeError")


def test_import_error_in_cpp_kernels_falls_back(scenario: Any) -> None:
    ie = scenario["importerror"]
    assert ie["warnings"] == ["Failed to import KV cache kernels."]
    assert ie["cache_kernels"] == [None, None]


def test_kernel_path_is_taken_and_matches_the_fallback(scenario: Any) -> None:
    k = scenario["kernel"]
    assert k["warnings"] == []
    assert k["cache_kernels"] == ["cache_autogptq_cuda_256"] * 2
    assert k["calls_after_prefill"] == [2, 2]  # Q.K and P.V once per layer
    assert k["calls"] == [2 + 2 * 12, 2 + 2 * 12]  # then the 12-token generation
    assert k["fake_calls"] == {"qk": 2 * 13, "pv": 2 * 13}
    assert k["logits_max_diff"] <= 0.02 * k["logits_scale"]
    assert k["tokens"] == scenario["fallback"]["tokens"]
    assert k["batch_row0"] == k["tokens"]


def test_beam_search_does_not_handle_the_quantized_cache(scenario: Any) -> None:
    assert scenario["beam_quantized"] == (
        "AttributeError: 'tuple' object has no attribute 'index_select'"
    )


def test_flash_attention_is_not_switched_off_by_quantization(scenario: Any) -> None:
    flash = scenario["flash"]
    assert flash["config"] is True and flash["attn"] is True
    assert flash["with_quantized_cache"] == "'tuple' object has no attribute 'dtype'"


if __name__ == "__main__" and sys.argv[1:2] == ["--scenario"]:
    _scenario(Path(sys.argv[2]), Path(sys.argv[3]))
