"""Child side of convert's proof: `python -m qwen_kvprep.convert.verify_child ...`.

Loads the original through its own remote code (from the prepared view the parent made,
so DIR is never written) and the converted folder natively (Qwen2ForCausalLM, no remote
code), feeds both the same token ids and reports the numbers: the loaded weights tensor by
tensor, the logits of a padded batch, greedy tokens, the tokenizer and chat-template
proofs, and, when asked, the logits past the trained context. The parent judges them.

The original is loaded with its Int8 KV cache off whatever its config.json says (a
folder `fix` prepared has it on): OUT has no quantized cache, and the proof compares the
model, not the cache.

Where both copies do not fit the machine, both are built with the same first K layers
(config num_hidden_layers=K; the other layers' tensors are never kept) and the result says
so. Generation is a plain greedy loop over each model's forward with its cache, as the
smoke's is, so every transformers release runs the same steps.
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from qwen_kvprep.childproc import Events, child_parser, exit_child, offline_child_main
from qwen_kvprep.convert import blockproof, tokproof
from qwen_kvprep.convert import context as ctx
from qwen_kvprep.convert.verify_protocol import (
    PHASE_BLOCKS,
    PHASE_CONTEXT,
    PHASE_FIT,
    PHASE_GREEDY,
    PHASE_HEAD,
    PHASE_LOAD_CONVERTED,
    PHASE_LOAD_ORIGINAL,
    PHASE_LOGITS,
    PHASE_TOKENIZER,
    PHASE_WEIGHTS,
    PROMPTS,
    RESULT_VERSION,
    Fit,
    Greedy,
    LogitDiff,
    Proof,
    VerifyChildResult,
    Weights,
)
from qwen_kvprep.jsontypes import JSONObject
from qwen_kvprep.planning.model import read_model
from qwen_kvprep.runtime import has_accelerate, moved_to_gpu, resolve_device
from qwen_kvprep.untrusted import read_record

if TYPE_CHECKING:
    import torch
    from transformers.configuration_utils import PretrainedConfig
    from transformers.modeling_utils import PreTrainedModel
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

# Both copies at once, plus room for activations and the shard being read.
RESIDENT_FACTOR = 2.2
# of the memory free when the child starts, what the proof allows itself
MEMORY_SHARE = 0.8
_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


# -- sizing ---------------------------------------------------------------------------------


def free_memory(device: str) -> Optional[int]:
    if device == "cuda":
        import torch

        free, _total = torch.cuda.mem_get_info()
        return int(free)
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def layers_that_fit(
    weights: int, layers: int, embeddings: int, available: Optional[int]
) -> tuple[int, Optional[str]]:
    """(K, why K < layers): the most layers whose two copies fit `available` bytes, with
    the embeddings and lm_head of both copies always in."""
    if available is None:
        return layers, None
    budget = int(available * MEMORY_SHARE)
    if weights * RESIDENT_FACTOR <= budget:
        return layers, None
    per_layer = max(1, (weights - embeddings) // layers)
    k = int((budget - embeddings * RESIDENT_FACTOR) // (per_layer * RESIDENT_FACTOR))
    k = max(0, min(layers, k))
    why = (
        f"both copies need about {weights * RESIDENT_FACTOR / 2**30:.1f} GiB and "
        f"{available / 2**30:.1f} GiB are free"
    )
    return k, why


def fit(original: Path, device: str, forced: Optional[int]) -> Fit:
    facts = read_model(original)
    shape = facts.shape
    embeddings = 2 * shape.vocab * shape.hidden * _DTYPE_BYTES.get(facts.dtype, 2)
    available = free_memory(device)
    k, why = layers_that_fit(shape.weights_bytes, shape.layers, embeddings, available)
    if forced is not None and forced < k:
        k, why = forced, f"--layers {forced} asked for"
    if k < 1:
        raise MemoryError(
            f"not even one layer of both copies fits: {why}; free memory or run the proof "
            "on a larger machine"
        )
    return {
        "device": device,
        "layers_total": shape.layers,
        "layers_run": k,
        "weights_bytes": shape.weights_bytes,
        "available_bytes": available,
        "reason": why if k < shape.layers else None,
    }


# -- loading --------------------------------------------------------------------------------


def _dtype_kwarg() -> str:
    """`dtype` from transformers 4.56 on, `torch_dtype` before (5.x still takes both)."""
    import transformers

    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def _truncated(config: PretrainedConfig, layers: int) -> PretrainedConfig:
    if getattr(config, "num_hidden_layers", layers) != layers:
        config.num_hidden_layers = layers
        layer_types = getattr(config, "layer_types", None)
        if isinstance(layer_types, list):
            config.layer_types = layer_types[:layers]
    return config


def load_original(
    path: Path, layers: int, device: str
) -> tuple[PreTrainedTokenizerBase, PreTrainedModel]:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=True)
    config = AutoConfig.from_pretrained(str(path), trust_remote_code=True)
    # the proof compares the model, not the Int8 cache fix may have switched on
    config.use_cache_quantization = False
    config.use_cache_kernel = False
    config = _truncated(config, layers)
    model = AutoModelForCausalLM.from_pretrained(
        str(path), config=config, trust_remote_code=True, **_device_map(device)
    )
    return tokenizer, _placed(model, device)


def load_converted(
    path: Path, layers: int, device: str, config_json: JSONObject, exact: bool
) -> PreTrainedModel:
    """OUT as Qwen2ForCausalLM, no remote code. `exact`: with the rope scaling its
    config.json may declare set aside (YaRN changes the logits within seq_length too), so
    that the proof compares the weights and the architecture; the scaling's effect is
    measured on its own (context.py)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if exact and declared_scaling(config_json) is not None:
        fields = {k: v for k, v in config_json.items() if k not in ("rope_scaling", "auto_map")}
        scaling = config_json.get("rope_scaling")
        original_max = scaling.get("original_max_position_embeddings") if isinstance(
            scaling, dict) else None
        if isinstance(original_max, int):
            fields["max_position_embeddings"] = original_max
        model_type = fields.pop("model_type", None)
        if not isinstance(model_type, str):
            raise ValueError(f"{path / 'config.json'} has no model_type")
        config = AutoConfig.for_model(model_type, **fields)
    else:
        config = AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    config = _truncated(config, layers)
    kwargs: dict[str, object] = {_dtype_kwarg(): "auto", **_device_map(device)}
    model = AutoModelForCausalLM.from_pretrained(
        str(path), config=config, trust_remote_code=False, **kwargs
    )
    return _placed(model, device)


def declared_scaling(config_json: JSONObject) -> Optional[dict[str, object]]:
    scaling = config_json.get("rope_scaling")
    return dict(scaling) if isinstance(scaling, dict) else None


def _device_map(device: str) -> dict[str, object]:
    """Straight onto the GPU where accelerate is there to place it (a 72B then never
    passes through host memory whole), else loaded on the host and moved."""
    return {"device_map": "cuda"} if device == "cuda" and has_accelerate() else {}


def _placed(model: PreTrainedModel, device: str) -> PreTrainedModel:
    if device == "cuda" and not _device_map(device):
        model = moved_to_gpu(model)
    model.eval()  # type: ignore[no-untyped-call, unused-ignore]
    return model


def _dtype_name(model: PreTrainedModel) -> str:
    return str(model.dtype).replace("torch.", "")


# -- weights --------------------------------------------------------------------------------

def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (a NaN equals the same NaN; `==` would call every NaN different)."""
    import torch

    if a.dtype != b.dtype:
        a = a.to(b.dtype)
    if a.is_floating_point() and a.element_size() in _INT_OF_SIZE:
        ints = getattr(torch, _INT_OF_SIZE[a.element_size()])
        return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))
    return torch.equal(a, b)


_INT_OF_SIZE = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}


nan_where = blockproof.nan_where  # the proof's lines name NaN the same way, either path


def compare_weights(original: PreTrainedModel, converted: PreTrainedModel, gptq: bool) -> Weights:
    if gptq:
        return {
            "compared": 0,
            "differ": [],
            "skipped": "GPTQ backends repack the Int4 tensors at load; convert's own "
            "comparison checks them in the files",
        }
    state = dict(original.state_dict())
    nan = [w for w in (nan_where(n, t) for n, t in sorted(state.items())) if w is not None]
    # the same mapping and report as the block-by-block proof's, with NaN-aware equality
    # across a dtype OUT may have been loaded in
    compared, differ = blockproof.compare_tensors(
        blockproof.expected(state), dict(converted.state_dict()), bits_equal
    )
    return {"compared": compared, "differ": differ, "skipped": None, "nan": nan}


# -- logits and tokens ------------------------------------------------------------------------


def _diff(a: torch.Tensor, b: torch.Tensor) -> LogitDiff:
    import torch

    a, b = a.float(), b.float()
    scale = float(a.abs().max()) if a.numel() else 0.0
    max_abs = float((a - b).abs().max()) if a.numel() else 0.0

    def nonfinite(x: torch.Tensor) -> int:
        return int((~torch.isfinite(x)).reshape(x.shape[0], -1).any(dim=1).sum()) if (
            x.numel() and x.dim()) else 0

    return {
        "positions": int(a.shape[0]) if a.dim() else 0,
        "max_abs": max_abs,
        "max_rel": max_abs / scale if scale > 0 else 0.0,
        "scale": scale,
        "nonfinite_original": nonfinite(a),
        "nonfinite_converted": nonfinite(b),
    }


def batch_logits(
    original: PreTrainedModel, converted: PreTrainedModel, rows: list[list[int]], pad: int,
    device: torch.device,
) -> LogitDiff:
    """One right-padded batch through both, every real position compared. No attention
    mask is passed: with the padding after each row, causal attention alone keeps it out
    of the real positions, and Qwen's own code on torch 2 drops its causal mask whenever an
    attention mask comes with a prompt (its masked_fill result is discarded), so a mask
    would compare OUT with that slip instead of with the model."""
    import torch

    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=device)
    real = torch.tensor([[True] * len(r) + [False] * (width - len(r)) for r in rows],
                        device=device)
    with torch.inference_mode():
        a = original(input_ids=ids, use_cache=False).logits
        b = converted(input_ids=ids, use_cache=False).logits
    return _diff(a[real], b[real])


def greedy(
    model: PreTrainedModel, ids: list[int], new_tokens: int, device: torch.device
) -> tuple[list[int], list[torch.Tensor]]:
    """`new_tokens` greedy tokens through the model's forward and cache; each step's
    logits."""
    import torch

    tokens: list[int] = []
    logits: list[torch.Tensor] = []
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids], device=device), use_cache=True)
        for step in range(new_tokens):
            last = out.logits[0, -1].float().cpu()
            logits.append(last)
            tokens.append(int(last.argmax()))
            if step + 1 == new_tokens:
                break
            out = model(
                input_ids=torch.tensor([[tokens[-1]]], device=device),
                past_key_values=out.past_key_values,
                use_cache=True,
            )
    return tokens, logits


def greedy_both(
    original: PreTrainedModel, converted: PreTrainedModel, prompts: list[list[int]],
    new_tokens: int, device: torch.device,
) -> tuple[list[Greedy], LogitDiff]:
    import torch

    runs: list[Greedy] = []
    shared_a: list[torch.Tensor] = []
    shared_b: list[torch.Tensor] = []
    for index, ids in enumerate(prompts):
        ta, la = greedy(original, ids, new_tokens, device)
        tb, lb = greedy(converted, ids, new_tokens, device)
        first = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        margin = None
        if first is not None:
            top = torch.topk(la[first], 2).values
            margin = float(top[0] - top[1])
        # step i read the same tokens in both up to and including the first divergence
        upto = new_tokens if first is None else first + 1
        shared_a += la[:upto]
        shared_b += lb[:upto]
        runs.append(
            {"prompt": index, "original": ta, "converted": tb, "first_divergence": first,
             "margin": margin}
        )
    return runs, _diff(torch.stack(shared_a), torch.stack(shared_b))


# -- tokenizer ------------------------------------------------------------------------------


def _as_proof(result: object) -> Proof:
    """A proof of qwen_kvprep.convert.tokproof (`ok`, `lines()`, `to_json()`) as JSON."""
    ok = bool(getattr(result, "ok", False))
    to_json = getattr(result, "to_json", None)
    details: object = to_json() if callable(to_json) else str(result)
    lines = getattr(result, "lines", None)
    text = lines() if callable(lines) else lines
    said = [str(x) for x in text] if isinstance(text, (list, tuple)) and text else [str(result)]
    return {"status": "ok" if ok else "fail", "message": said[0].strip(), "details": details,
            "lines": said[1:]}


def tokenizer_phase(
    args: argparse.Namespace, ev: Events, original_tok: PreTrainedTokenizerBase, out: Path,
    seconds: dict[str, float],
) -> tuple[Proof, Proof]:
    """The tokenizer phase of either proof: both proofs, or said not asked for."""
    ev.start(PHASE_TOKENIZER)
    t0 = time.perf_counter()
    if args.tokenizer:
        proofs = prove_tokenizers(original_tok, out)
    else:
        skipped: Proof = {
            "status": "unavailable", "message": "not asked for (--no-tokenizer)", "details": None
        }
        proofs = skipped, skipped
    seconds["tokenizer"] = time.perf_counter() - t0
    return proofs


def prove_tokenizers(
    original_tok: PreTrainedTokenizerBase, out: Path
) -> tuple[Proof, Proof]:
    """convert's tokenizer and chat-template proofs (qwen_kvprep.convert.tokproof)."""
    from transformers import AutoTokenizer

    try:
        converted = AutoTokenizer.from_pretrained(str(out), trust_remote_code=False)
    except Exception as exc:  # OUT's tokenizer not loading is the finding itself
        failed: Proof = {
            "status": "error",
            "message": f"OUT's tokenizer does not load: {type(exc).__name__}: {exc}",
            "details": None,
        }
        return failed, failed
    results = []
    for prove in (tokproof.prove_tokenizer, tokproof.prove_chat_template):
        try:
            results.append(_as_proof(prove(original_tok, converted)))
        except Exception as exc:
            results.append(
                {"status": "error", "message": f"{type(exc).__name__}: {exc}", "details": None}
            )
    return results[0], results[1]


# -- the whole run -------------------------------------------------------------------------


def _read_config(path: Path) -> JSONObject:
    data = read_record(str(path / "config.json"))
    return data if isinstance(data, dict) else {}


def run(args: argparse.Namespace, ev: Events) -> VerifyChildResult:
    import torch

    original_path, out_path = Path(args.original), Path(args.out)
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    device = resolve_device(args.device)
    early_config = _read_config(out_path)
    if blockwise(early_config, args.context):
        return run_blockwise(args, ev, device)
    ev.start(PHASE_FIT)
    sized = fit(original_path, device, args.layers)
    layers = sized["layers_run"]

    ev.start(PHASE_LOAD_ORIGINAL)
    tokenizer, original = load_original(original_path, layers, device)
    seconds["load_original"] = time.perf_counter() - t0
    ev.start(PHASE_LOAD_CONVERTED)
    t1 = time.perf_counter()
    out_config = _read_config(out_path)
    scaling = declared_scaling(out_config)
    converted = load_converted(out_path, layers, device, out_config, exact=True)
    seconds["load_converted"] = time.perf_counter() - t1
    gptq = isinstance(out_config.get("quantization_config"), dict)
    where = torch.device(device)

    ev.start(PHASE_WEIGHTS)
    weights = compare_weights(original, converted, gptq)

    ev.start(PHASE_LOGITS)
    t2 = time.perf_counter()
    prompts = [list(tokenizer.encode(p)) for p in PROMPTS]
    eod = getattr(tokenizer, "eod_id", None)
    pad = int(eod) if isinstance(eod, int) else 0
    logits = batch_logits(original, converted, prompts, pad, where)
    ev.start(PHASE_GREEDY)
    runs, steps = greedy_both(original, converted, prompts, args.new_tokens, where)
    seconds["compare"] = time.perf_counter() - t2

    proofs = tokenizer_phase(args, ev, tokenizer, out_path, seconds)
    result = _result(
        device, (_dtype_name(original), _dtype_name(converted)), sized, prompts,
        logits=logits, steps=steps, greedy=runs, weights=weights, proofs=proofs,
        seconds=seconds, gptq=gptq, scaling=scaling,
    )
    if args.context:
        ev.start(PHASE_CONTEXT)
        t4 = time.perf_counter()
        src_config = _read_config(original_path)
        seq_length = src_config.get("seq_length")
        heads = src_config.get("num_attention_heads")
        if not isinstance(seq_length, int) or not isinstance(heads, int):
            raise ValueError("config.json has no integer seq_length / num_attention_heads")
        if scaling is not None:
            # the context is measured on OUT as it serves, scaling and all
            del converted
            gc.collect()
            converted = load_converted(out_path, layers, device, out_config, exact=False)
        free = free_memory(device)
        result["context"] = ctx.measure(
            original,
            converted,
            filler_ids=list(tokenizer.encode(ctx.FILLER)),
            seq_length=seq_length,
            heads=heads,
            budget_bytes=None if free is None else free // 4,
            device=where,
            rope_scaling=scaling,
            original_rules=ctx.original_rules(dict(src_config)),
        )
        seconds["context"] = time.perf_counter() - t4
    return result


def _result(
    device: str, dtypes: tuple[str, str], sized: Fit, prompts: list[list[int]], *,
    logits: LogitDiff, steps: LogitDiff, greedy: list[Greedy], weights: Weights,
    proofs: tuple[Proof, Proof], seconds: dict[str, float], gptq: bool = False,
    scaling: Optional[dict[str, object]] = None,
) -> VerifyChildResult:
    """What either proof reports (the block-by-block one adds its blocks)."""
    import torch
    import transformers

    return {
        "result_version": RESULT_VERSION,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": device,
        "dtype_original": dtypes[0],
        "dtype_converted": dtypes[1],
        "gptq": gptq,
        "scaling_set_aside": scaling,
        "fit": sized,
        "prompt_tokens": [len(p) for p in prompts],
        "logits": logits,
        "steps": steps,
        "greedy": greedy,
        "weights": weights,
        "tokenizer": proofs[0],
        "template": proofs[1],
        "seconds": seconds,
    }


def blockwise(out_config: JSONObject, context: bool) -> bool:
    """Whether the proof runs block by block (blockproof.py): every layer in the memory
    of one block of each. Not for GPTQ (the backend's kernels come with the whole model),
    nor with rope scaling declared or the context measured (both read whole models)."""
    gptq = isinstance(out_config.get("quantization_config"), dict)
    return not gptq and not context and declared_scaling(out_config) is None


def run_blockwise(args: argparse.Namespace, ev: Events, device: str) -> VerifyChildResult:
    """Weights and the prompts block by block; the greedy steps on the whole models
    where both fit, else said not run."""
    import torch
    from transformers import AutoTokenizer

    original_path, out_path = Path(args.original), Path(args.out)
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    ev.start(PHASE_FIT)
    facts = read_model(original_path)
    shape = facts.shape
    embeddings = 2 * shape.vocab * shape.hidden * _DTYPE_BYTES.get(facts.dtype, 2)
    available = free_memory(device)
    whole, why = layers_that_fit(shape.weights_bytes, shape.layers, embeddings, available)
    n = shape.layers if args.layers is None else max(1, min(args.layers, shape.layers))
    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
        str(original_path), trust_remote_code=True
    )
    prompts = [list(tokenizer.encode(p)) for p in PROMPTS]

    ev.start(PHASE_BLOCKS)
    proof = blockproof.prove(
        original_path, out_path, prompts, layers_total=shape.layers, layers=n,
        device=device,
        on_block=lambda done, total: ev.send(
            {"event": "progress", "phase": PHASE_BLOCKS, "done": done, "total": total}),
        on_head=lambda: ev.start(PHASE_HEAD),
    )
    seconds["blocks"] = time.perf_counter() - t0
    sized: Fit = {
        "device": device, "layers_total": shape.layers, "layers_run": proof.layers_run,
        "weights_bytes": shape.weights_bytes, "available_bytes": available,
        "reason": f"--layers {args.layers} asked for" if n < shape.layers else None,
    }
    gc.collect()
    runs: list[Greedy] = []
    steps: LogitDiff = {"positions": 0, "max_abs": 0.0, "max_rel": 0.0, "scale": 0.0}
    skipped: Optional[str] = None
    dtype_original = dtype_converted = proof.stored_dtype
    if whole == shape.layers:
        ev.start(PHASE_LOAD_ORIGINAL)
        t1 = time.perf_counter()
        tokenizer, original = load_original(original_path, n, device)
        ev.start(PHASE_LOAD_CONVERTED)
        out_config = _read_config(out_path)
        converted = load_converted(out_path, n, device, out_config, exact=True)
        dtype_original, dtype_converted = _dtype_name(original), _dtype_name(converted)
        ev.start(PHASE_GREEDY)
        runs, steps = greedy_both(
            original, converted, prompts, args.new_tokens, torch.device(device)
        )
        del original, converted
        gc.collect()
        seconds["greedy"] = time.perf_counter() - t1
    else:
        skipped = f"the greedy steps need both whole models and {why}"

    proofs = tokenizer_phase(args, ev, tokenizer, out_path, seconds)
    result = _result(
        device, (dtype_original, dtype_converted), sized, prompts, logits=proof.logits,
        steps=steps, greedy=runs, weights=proof.weights, proofs=proofs, seconds=seconds,
    )
    result["blocks"] = proof.blocks
    result["compute_dtype"] = proof.compute_dtype
    if skipped is not None:
        result["greedy_skipped"] = skipped
    return result


def parse(argv: list[str]) -> argparse.Namespace:
    p = child_parser("python -m qwen_kvprep.convert.verify_child")
    p.add_argument("--original", required=True, help="the prepared view of DIR")
    p.add_argument("--out", required=True, help="the converted folder")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--layers", type=int, default=None, help="run at most this many layers")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--context", action="store_true", help="measure past seq_length")
    p.add_argument("--no-tokenizer", dest="tokenizer", action="store_false")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    return offline_child_main(argv, parse, run)


if __name__ == "__main__":
    exit_child(main())
