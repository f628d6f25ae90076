"""Int4 GPTQ checkpoints: the tiny generator's packing, and the whole tool on one.

The packing tests need nothing but torch: they unpack what `tiny --gptq` wrote bit by bit,
in plain Python, following the format as GPTQ loaders read it (qwen_kvprep/tiny/gptq.py
describes it), and compare with an independent round-to-nearest quantization.

The rest needs the GPTQ backend of the `gptq` extra (`needs gptq` otherwise; CI installs
it in its pinned stage): `fix` with its smoke, a new process loading the checkpoint as a
server would (quantized linear modules whose outputs match the dequantized reference, the
Int8 cache through the compiled extension in every layer, chat and chat_stream), doctor,
and plan against a measured peak. Everything that loads a model runs in a child process
with its own HF_HOME; the session's build cache is shared.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from qwen_kvprep.tiny import generate_checkpoint
from qwen_kvprep.tiny.gptq import GROUP_SIZE, QUANTIZED_LINEARS, quantize
from tests import needs
from tests.cli import kvprep
from tests.remote_code import with_compat
from tests.toolkit import matching_toolkit

LAYERS = 2
HIDDEN = 256  # 2 heads of 128: two groups of 128 per input row
FF = 256  # intermediate 512, Qwen's convention of twice the MLP width


def _shapes(hidden: int, ff: int) -> dict[str, tuple[int, int]]:
    """(out, in) of each quantized linear of a block."""
    return {
        "attn.c_attn": (3 * hidden, hidden),
        "attn.c_proj": (hidden, hidden),
        "mlp.w1": (ff, hidden),
        "mlp.w2": (ff, hidden),
        "mlp.c_proj": (hidden, ff),
    }


SHAPES = _shapes(HIDDEN, FF)  # the default tiny checkpoint


# -- the format, by hand ------------------------------------------------------------------


def unpack_by_hand(t: dict[str, Any]) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """(codes[in][out], zero points[group][out], g_idx) read bit by bit from the tensors."""
    qweight, qzeros, g_idx = t["qweight"].tolist(), t["qzeros"].tolist(), t["g_idx"].tolist()
    n_in, n_out = len(qweight) * 8, len(qweight[0])
    codes = [
        [((qweight[i // 8][o] & 0xFFFFFFFF) >> (4 * (i % 8))) & 0xF for o in range(n_out)]
        for i in range(n_in)
    ]
    # v1 ("gptq") checkpoints store each zero point minus one
    zeros = [
        [(((row[o // 8] & 0xFFFFFFFF) >> (4 * (o % 8))) & 0xF) + 1 for o in range(n_out)]
        for row in qzeros
    ]
    return codes, zeros, g_idx


def dequantize_by_hand(t: dict[str, Any]) -> Any:
    """W [out, in] as float32: scales[g_idx[i], o] * (code[i][o] - zero[g_idx[i]][o])."""
    import torch

    codes, zeros, g_idx = unpack_by_hand(t)
    scales = t["scales"].float().tolist()
    n_in, n_out = len(codes), len(codes[0])
    w = [
        [scales[g_idx[i]][o] * (codes[i][o] - zeros[g_idx[i]][o]) for i in range(n_in)]
        for o in range(n_out)
    ]
    return torch.tensor(w, dtype=torch.float32)


def test_packing_matches_the_format_read_by_hand() -> None:
    import torch

    gen = torch.Generator().manual_seed(7)
    out_f, in_f = 24, 2 * GROUP_SIZE
    w = torch.randn((out_f, in_f), generator=gen) * 0.05
    w[3] = 0.0  # a row of zeros: any positive scale, codes at the zero point
    w[5, :GROUP_SIZE] *= 40  # groups of very different magnitude in one row
    w[7, 7::8] = w[7].abs().max()  # largest codes in the top nibble: int32's sign bit
    t = quantize(w.to(torch.float16))

    assert t["qweight"].dtype == t["qzeros"].dtype == t["g_idx"].dtype == torch.int32
    assert t["scales"].dtype == torch.float16
    assert tuple(t["qweight"].shape) == (in_f // 8, out_f)
    assert tuple(t["qzeros"].shape) == (2, out_f // 8)
    assert tuple(t["scales"].shape) == (2, out_f)
    assert t["g_idx"].tolist() == [i // GROUP_SIZE for i in range(in_f)]
    assert (t["qweight"] < 0).any(), "the sign bit case was not exercised"
    # symmetric 4-bit: every zero point is 8, stored as 7 in each nibble
    assert set(t["qzeros"].flatten().tolist()) == {0x77777777}

    codes, zeros, _ = unpack_by_hand(t)
    assert {z for row in zeros for z in row} == {8}
    # an independent round-to-nearest quantization gives the same codes and scales
    wf = w.to(torch.float16).float()
    for g in range(2):
        block = wf[:, g * GROUP_SIZE : (g + 1) * GROUP_SIZE]
        amax = block.abs().amax(dim=1)
        scale = torch.where(amax > 0, 2 * amax / 15, torch.ones_like(amax)).half()
        assert torch.equal(t["scales"][g], scale)
        want = torch.clamp(torch.round(block / scale.float()[:, None]) + 8, 0, 15).int()
        got = torch.tensor([codes[i] for i in range(g * GROUP_SIZE, (g + 1) * GROUP_SIZE)])
        assert torch.equal(got.T, want)
    # and what a loader reconstructs is the weight within half a step of its group
    deq = dequantize_by_hand(t)
    step = t["scales"].float()[torch.arange(in_f) // GROUP_SIZE].T  # [out, in]
    # half a step, and a little more where the largest value rounds to the clamped code 16
    assert ((deq - wf).abs() <= 0.51 * step).all()
    assert torch.equal(deq[3], torch.zeros(in_f))


def test_tiny_gptq_checkpoint_is_laid_out_as_qwen_int4(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    d = generate_checkpoint(tmp_path / "Qwen-tiny-Int4", gptq=True)
    config = json.loads((d / "config.json").read_text())
    qc = json.loads((d / "quantize_config.json").read_text())
    assert qc == {
        "bits": 4, "group_size": 128, "damp_percent": 0.01, "desc_act": False,
        "static_groups": False, "sym": True, "true_sequential": True,
        "model_name_or_path": None, "model_file_base_name": "model",
    }  # fmt: skip
    assert config["quantization_config"] == {**qc, "quant_method": "gptq"}
    assert (config["fp16"], config["bf16"], config["fp32"]) == (True, False, False)

    tensors: dict[str, Any] = {}
    for shard in sorted(d.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in tensors.values()
    )
    plain = generate_checkpoint(tmp_path / "plain", dtype="fp16")
    reference: dict[str, Any] = {}
    for shard in sorted(plain.glob("*.safetensors")):
        reference.update(load_file(str(shard)))
    for i in range(LAYERS):
        for name in QUANTIZED_LINEARS:
            p = f"transformer.h.{i}.{name}"
            assert f"{p}.weight" not in tensors
            out_f, in_f = SHAPES[name]
            assert tuple(tensors[f"{p}.qweight"].shape) == (in_f // 8, out_f)
            assert tuple(tensors[f"{p}.qzeros"].shape) == (in_f // GROUP_SIZE, out_f // 8)
            # the same seed: the packed weight is the plain checkpoint's, within a step
            t = {k: tensors[f"{p}.{k}"] for k in ("qweight", "qzeros", "scales", "g_idx")}
            if i == 0 and name == "mlp.c_proj":  # one by hand is enough: it is slow
                deq = dequantize_by_hand(t)
                step = t["scales"].float()[torch.arange(in_f) // GROUP_SIZE].T
                assert ((deq - reference[f"{p}.weight"].float()).abs() <= 0.51 * step).all()
        assert tensors[f"transformer.h.{i}.attn.c_attn.bias"].dtype == torch.float16
    for name in ("transformer.wte.weight", "lm_head.weight", "transformer.ln_f.weight"):
        assert torch.equal(tensors[name], reference[name])  # plain fp16, as in Qwen's Int4


def test_gptq_refusals_and_the_command_line(tmp_path: Path) -> None:
    from qwen_kvprep.errors import UsageError

    with pytest.raises(UsageError, match="runs in fp16"):
        generate_checkpoint(tmp_path / "bf16", gptq=True, dtype="bf16")
    with pytest.raises(UsageError, match="multiple of the group size 128"):
        generate_checkpoint(tmp_path / "narrow", gptq=True, head_dim=32)
    assert not (tmp_path / "narrow").exists()
    done = subprocess.run(
        [sys.executable, "-m", "qwen_kvprep.tiny", str(tmp_path / "cli"), "--gptq"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "cli" / "quantize_config.json").is_file()


def test_smoke_judges_the_gptq_linears() -> None:
    from qwen_kvprep.common import gptq_install
    from qwen_kvprep.findings import Severity
    from qwen_kvprep.smoke.evaluate import _gptq, known_cause

    good = {
        "blocks": 2, "modules": 10, "called": 10, "calls": 160, "plain_linears": [],
        "classes": {"gptqmodel.nn_modules.qlinear.torch.TorchQuantLinear": 10},
    }  # fmt: skip
    assert _gptq(good, "/m").severity is Severity.OK  # type: ignore[arg-type]
    for change, words in (
        ({"modules": 8, "called": 8}, "8 modules hold GPTQ-packed weights where 2 blocks need 10"),
        ({"plain_linears": ["transformer.h.0.mlp.w1"]}, "plain nn.Linear"),
        ({"called": 9}, "only 9 of 10 quantized linear modules ran"),
    ):
        bad = _gptq({**good, **change}, "/m")  # type: ignore[arg-type]
        assert bad.severity is Severity.FAIL and words in bad.message, bad.message
        assert bad.fix is not None and "env.gptq" in bad.fix
    # transformers' own words when the backend is missing name the install command
    for said in (
        "ImportError: Loading a GPTQ quantized model requires optimum (`pip install optimum`)",
        "PackageNotFoundError: No package metadata was found for auto-gptq",  # 4.37
    ):
        assert known_cause(said, "/m") == (
            "this is a GPTQ Int4 checkpoint and its backend is missing: " + gptq_install()
        )


# -- with the backend -----------------------------------------------------------------------

# Loads the checkpoint exactly as a server would, then reports: which modules compute the
# block linears and how far their outputs are from the dequantized reference; the Int8
# cache and its kernel; chat and chat_stream.
PROBE = r"""
import json, sys, warnings
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation import GenerationConfig

warnings.simplefilter("ignore")
d = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True).eval()
tok = AutoTokenizer.from_pretrained(d, trust_remote_code=True)
tensors = {}
for shard in sorted(__import__("pathlib").Path(d).glob("*.safetensors")):
    tensors.update(load_file(str(shard)))

def unpack(words, axis):
    # int32 words -> 4-bit fields along `axis` (0: rows, 1: columns), low nibble first
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    w = words.to(torch.int64) & 0xFFFFFFFF
    if axis == 0:
        return ((w[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(-1, w.shape[1])
    return ((w[:, :, None] >> shifts[None, None, :]) & 0xF).reshape(w.shape[0], -1)

report = {"linears": {}, "dtype": str(model.dtype)}
gen = torch.Generator().manual_seed(0)
with torch.no_grad():
    for name, mod in model.named_modules():
        if not hasattr(mod, "qweight"):
            continue
        t = {k: tensors[f"{name}.{k}"] for k in ("qweight", "qzeros", "scales", "g_idx")}
        codes = unpack(t["qweight"], 0).float()                  # [in, out]
        zeros = unpack(t["qzeros"], 1).float() + 1               # v1: stored zero - 1
        g = t["g_idx"].long()
        w = (t["scales"].float()[g] * (codes - zeros[g])).T      # [out, in]
        x = torch.randn((3, w.shape[1]), generator=gen).half()
        ref = x.float() @ w.T
        bias = tensors.get(f"{name}.bias")
        if bias is not None:
            ref = ref + bias.float()
        got = mod(x).float()
        report["linears"][name] = {
            "class": f"{type(mod).__module__}.{type(mod).__name__}",
            "rel_err": float((got - ref).abs().max() / ref.abs().max()),
        }

attn = [block.attn for block in model.transformer.h]
report["quantized"] = [bool(a.use_cache_quantization) for a in attn]
report["kernel_files"] = [getattr(a.cache_kernels, "__file__", None) for a in attn]
config = GenerationConfig.from_pretrained(d)
config.do_sample = False
config.max_new_tokens = 8
for a in attn:
    a.kernel_calls = 0
answer, history = model.chat(tok, "What is two plus two?", history=None, generation_config=config)
report["chat"] = answer
report["chat_calls"] = [a.kernel_calls for a in attn]
try:
    last = None
    for text in model.chat_stream(tok, "What is two plus two?", history=None,
                                  generation_config=config):
        last = text
    report["chat_stream"] = last
except Exception as exc:  # reported, not raised: the test says what failed
    report["chat_stream_error"] = f"{type(exc).__name__}: {exc}"
report["stream_calls"] = [a.kernel_calls for a in attn]
print("REPORT " + json.dumps(report))
"""


def _env(tmp: Path, cache: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["HF_HOME"] = str(tmp / "hf-home")
    env["HF_MODULES_CACHE"] = str(tmp / "hf-home" / "modules")
    env["QWEN_KVPREP_CACHE"] = str(cache)
    env.update(matching_toolkit())
    env.pop("TRANSFORMERS_CACHE", None)
    return env


def _findings(stdout: str) -> dict[str, dict[str, Any]]:
    return {f["id"]: f for f in json.loads(stdout)["findings"]}


@pytest.fixture(scope="module")
def fixed(tmp_path_factory: pytest.TempPathFactory, shared_build_cache: Path) -> dict[str, Any]:
    needs.gptq_backend()
    tmp = tmp_path_factory.mktemp("gptq")
    ckpt = generate_checkpoint(tmp / "Qwen-tiny-Int4", gptq=True)
    env = _env(tmp, shared_build_cache)
    done = kvprep("fix", str(ckpt), "--json", env=env, cwd=tmp, timeout=1800)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return {"tmp": tmp, "ckpt": ckpt, "env": env, "fix": json.loads(done.stdout)}


@pytest.mark.slow
def test_fix_smoke_proves_gptq_linears_and_the_kernel(fixed: dict[str, Any]) -> None:
    found = {f["id"]: f for f in fixed["fix"]["findings"]}
    for fid in ("smoke.load", "smoke.quantization", "smoke.kernel", "smoke.gptq",
                "smoke.agreement"):  # fmt: skip
        assert found[fid]["severity"] == "ok", found[fid]
    g = found["smoke.gptq"]["details"]
    assert g["modules"] == g["expected"] == 5 * LAYERS and g["called"] == g["modules"]
    assert g["plain_linears"] == [] and g["calls"] > 0
    assert all(c.startswith("gptqmodel.") for c in g["classes"]), g["classes"]
    smoke = fixed["fix"]["smoke"]
    assert smoke["kernel_layers"] == smoke["layers"] == LAYERS
    assert smoke["gptq"]["modules"] == 5 * LAYERS
    assert smoke["model_dtype"] == "float16"


@pytest.mark.slow
def test_server_load_runs_quantized_linears_kernel_and_chat(fixed: dict[str, Any]) -> None:
    tmp, ckpt, env = fixed["tmp"], fixed["ckpt"], fixed["env"]
    elsewhere = tmp / "server-cwd"
    elsewhere.mkdir(exist_ok=True)
    probe = tmp / "probe.py"
    probe.write_text(PROBE)
    done = subprocess.run(
        [sys.executable, str(probe), str(ckpt)],
        env=dict(env, PYTHONPATH=""), cwd=str(elsewhere),
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("REPORT "))
    report = json.loads(line[len("REPORT ") :])
    linears = report["linears"]
    assert sorted(linears) == sorted(
        f"transformer.h.{i}.{n}" for i in range(LAYERS) for n in QUANTIZED_LINEARS
    )
    for name, row in linears.items():
        assert row["class"].startswith("gptqmodel."), (name, row)
        # fp16 activations and an fp16 matmul against the exact float32 reference
        assert row["rel_err"] < 1e-2, (name, row)
    assert report["dtype"] == "torch.float16"
    assert report["quantized"] == [True] * LAYERS
    so = json.loads((ckpt / ".qwen-kvprep" / "state.json").read_text())["build"]["so"]
    assert report["kernel_files"] == [so] * LAYERS
    assert all(n > 0 for n in report["chat_calls"]), report
    assert isinstance(report["chat"], str)
    assert "chat_stream_error" not in report, report["chat_stream_error"]
    # greedy both times: the stream ends with the same answer, through the kernel again
    # (Qwen's chat decodes with errors="replace", its chat_stream with errors="ignore":
    # random tiny weights can end on a token that is not whole UTF-8)
    assert report["chat_stream"] == report["chat"].replace("\ufffd", "")
    assert all(s > c for s, c in zip(report["stream_calls"], report["chat_calls"])), report


@pytest.mark.slow
def test_doctor_gptq_findings_ok_with_the_backend(fixed: dict[str, Any]) -> None:
    done = kvprep(
        "doctor", str(fixed["ckpt"]), "--check", "env.gptq", "--check", "checkpoint.gptq",
        "--json", env=fixed["env"], timeout=300,
    )  # fmt: skip
    found = _findings(done.stdout)
    assert found["env.gptq"]["severity"] == "ok", found["env.gptq"]
    assert "gptqmodel " in found["env.gptq"]["message"]
    assert found["checkpoint.gptq"]["severity"] == "info"


# Peak live tensor bytes (tests/live_tensors.py) of plan's contract run on the GPTQ model,
# and the bytes the loaded model holds. TORCHDYNAMO_DISABLE: gptqmodel compiles its
# dequantization with torch.compile, which a dispatch mode cannot see into; eager, every
# intermediate is counted.
PEAK = r"""
import json, sys
from tests.live_tensors import load, measure
model = load(sys.argv[1], int8=sys.argv[2] == "int8")
# what the checkpoint's tensors became: parameters and persistent buffers (the state dict),
# not the tables the model code computes itself (logn_tensor, a non-persistent buffer)
held = sum(t.numel() * t.element_size() for t in model.state_dict().values())
cases = json.loads(sys.argv[3])
print("REPORT " + json.dumps({"held": held, "peaks": [measure(model, *c) for c in cases]}))
"""


@pytest.mark.slow
def test_plan_predicts_gptq_weights_and_peak(tmp_path: Path) -> None:
    """plan against a measured CPU peak, as tests/test_plan.py does for bf16 checkpoints."""
    needs.gptq_backend()
    from qwen_kvprep.planning.model import model_shape
    from qwen_kvprep.planning.peak import CUBLAS_WORKSPACE_BYTES, MODES, predict_peak_bytes

    d = generate_checkpoint(
        tmp_path / "Qwen-tiny-Int4", gptq=True, heads=4, intermediate=2048
    )  # hidden 512, MLP width 1024
    with_compat(d)  # what fix adds for transformers >= 4.54 (and nothing on older ones)
    shape = model_shape(d)
    # a decode-bound and a prefill-bound run, chunked: short, every dispatched op is tracked
    cases = [(16, 1, 31, None), (8, 256, 2, 64)]
    env = _env(tmp_path, tmp_path / "build-cache")
    env.update(TORCHDYNAMO_DISABLE="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    script = tmp_path / "peak.py"
    script.write_text(PEAK)
    # gptqmodel's torch kernel dequantizes one layer per call: its intermediates (the
    # unpacked int32 and int8 codes, the gathered scales, the fp16 weight) are alive at once
    # for the largest layer, about 6 bytes per weight in eager mode. plan counts the kernels
    # that use the packed weights directly (what a GPU uses), so this is allowed on top.
    largest = max(n_in * n_out for n_out, n_in in _shapes(hidden=512, ff=1024).values())
    transient = 6 * largest
    for mode in MODES:
        done = subprocess.run(
            [sys.executable, str(script), str(d), mode, json.dumps(cases)],
            env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-4000:]
        line = next(x for x in done.stdout.splitlines() if x.startswith("REPORT "))
        report = json.loads(line[len("REPORT ") :])
        # the Int4 weights, counted from the safetensors headers, are what the model holds
        assert report["held"] == shape.weights_bytes
        for (batch, prompt, new, chunk), measured in zip(cases, report["peaks"]):
            predicted = predict_peak_bytes(shape, batch, prompt, new, mode, chunk)
            predicted -= CUBLAS_WORKSPACE_BYTES  # no cuBLAS on CPU
            extra = measured - predicted
            assert -0.05 * measured <= extra <= 0.05 * measured + transient, (
                mode, batch, prompt, new, chunk, measured, predicted,
            )  # fmt: skip



@pytest.mark.slow
def test_profile_and_plan_report_the_int4_weights(fixed: dict[str, Any]) -> None:
    from qwen_kvprep.planning.model import model_shape

    ckpt, env = fixed["ckpt"], fixed["env"]
    weights = model_shape(ckpt).weights_bytes
    dense = model_shape(generate_checkpoint(fixed["tmp"] / "dense", dtype="fp16")).weights_bytes
    # the block linears shrink to about a quarter; embeddings and lm_head stay fp16
    assert weights < dense - 0.7 * 2 * LAYERS * sum(o * i for o, i in SHAPES.values())
    done = kvprep("plan", str(ckpt), "--gpu-memory", "1GiB", "--json", env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)["plan"]
    assert plan["weights_bytes"] == weights
    assert plan["model"]["gptq"] == {"bits": 4, "group_size": 128}
    done = kvprep(
        "profile", str(ckpt), "--device", "cpu", "--batch", "1", "--tokens", "2", "--json",
        env=env, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    profile = json.loads(done.stdout)["profile"]
    assert profile["model"]["weights_bytes"] == weights
    assert profile["model"]["gptq_bits"] == 4
    int8 = [r for r in profile["rows"] if r["mode"] == "int8"]
    assert int8 and all(r["kernel_layers"] == LAYERS for r in int8), int8
    text = kvprep(
        "profile", str(ckpt), "--device", "cpu", "--batch", "1", "--tokens", "1",
        env=env, timeout=900,
    ).stdout  # fmt: skip
    assert "(GPTQ Int4)" in text


@pytest.mark.slow
def test_demo_gptq(tmp_path: Path, shared_build_cache: Path) -> None:
    needs.gptq_backend()
    env = _env(tmp_path, shared_build_cache)
    done = kvprep("demo", str(tmp_path / "demo"), "--gptq", "--json", env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads(done.stdout)
    assert doc["demo"]["model"]["gptq"] is True
    smoke = doc["demo"]["smoke"]
    assert smoke["ok"] and smoke["kernel_layers"] == smoke["layers"] == LAYERS
    assert smoke["gptq"]["called"] == smoke["gptq"]["modules"] == 5 * LAYERS
