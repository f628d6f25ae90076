"""convert's proof block by block: every layer of both models, in bounded memory.

Both models are built as skeletons of one block (their own classes: the original through
its remote code, OUT as transformers' Qwen2ForCausalLM) with a vocabulary of a few rows, so
building them costs one block each. Then, on the prompts, each alone (no padding: every
position computed is compared):

1. each model's embedding is loaded from its files and the model's own forward runs until
   its first block is called: the hidden states and every other argument the model gives
   its blocks (rotary tables, masks) are taken there, and the embedding is dropped;
2. for each block i: block i of DIR and of OUT are read from their files into the
   skeletons' block (weights compared bit for bit on the way, through the name mapping),
   both run on their own hidden states, the hidden states are compared, the weights are
   dropped;
3. the final norm and the head of each, then the logits compared as the whole models'.

Resident: one block of each model (twice while the next is read), the embedding of one
model at a time, a slice of the head, the activations of the batch. On a CPU the blocks
compute in float32 (bf16 weights widen exactly; a bf16 matmul runs at a fifth of float32's
speed on CPUs without bf16 units), so the comparison is float32's, tighter than the model's
own dtype.

Not accelerate's disk offload: it is not installed everywhere the proof runs, and it runs
one model at a time, so the blocks could not be compared as they go.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from qwen_kvprep.convert.compare import out_weight_map
from qwen_kvprep.convert.verify_protocol import LogitDiff, Weights

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers.configuration_utils import PretrainedConfig
    from transformers.modeling_utils import PreTrainedModel

# Qwen (v1) module -> Qwen2 module, per block and outside; c_attn is split in three.
BLOCK = {
    "ln_1": "input_layernorm",
    "ln_2": "post_attention_layernorm",
    "attn.c_proj": "self_attn.o_proj",
    "mlp.w1": "mlp.up_proj",
    "mlp.w2": "mlp.gate_proj",
    "mlp.c_proj": "mlp.down_proj",
}
TOP = {
    "transformer.wte": "model.embed_tokens",
    "transformer.ln_f": "model.norm",
    "lm_head": "lm_head",
}
QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")

# rows of the skeletons' embedding and head: the real ones are loaded when used
_SKELETON_VOCAB = 16
# rows of the head computed at once (a slice of the head widened to float32)
_HEAD_ROWS = 8192


def expected(original: dict[str, torch.Tensor]) -> dict[str, tuple[str, torch.Tensor]]:
    """Qwen2 tensor name -> (the original's name and part, the tensor OUT must hold),
    from (part of) the original's state dict."""
    out: dict[str, tuple[str, torch.Tensor]] = {}
    for name, tensor in original.items():
        module, _, leaf = name.rpartition(".")
        if module in TOP:
            out[f"{TOP[module]}.{leaf}"] = (name, tensor)
            continue
        parts = module.split(".")
        if len(parts) < 4 or parts[:2] != ["transformer", "h"]:
            out[f"?{name}"] = (name, tensor)  # nothing in OUT can match it
            continue
        block, rest = parts[2], ".".join(parts[3:])
        prefix = f"model.layers.{block}."
        if rest == "attn.c_attn":
            for which, (target, piece) in enumerate(zip(QKV, tensor.chunk(3, dim=0))):
                out[f"{prefix}{target}.{leaf}"] = (f"{name} {'qkv'[which]} third", piece)
        elif rest in BLOCK:
            out[f"{prefix}{BLOCK[rest]}.{leaf}"] = (name, tensor)
        else:
            out[f"?{name}"] = (name, tensor)
    return out


# elements looked at for NaN at once: a mask of the whole embedding is 620 MB at Qwen-7B's
# shape, and summing a bool mask widens it to int64 (5 GB) first
_NAN_CHUNK = 1 << 24


def nan_where(name: str, tensor: torch.Tensor) -> Optional[str]:
    """"name: N NaN values (rows 3, 17)" where `tensor` holds NaN, else None."""
    import torch

    if not tensor.is_floating_point():
        return None
    flat = tensor.reshape(-1)
    count = sum(int(torch.count_nonzero(flat[i:i + _NAN_CHUNK].isnan()))
                for i in range(0, flat.numel(), _NAN_CHUNK))
    if count == 0:
        return None
    mask = tensor.isnan()  # only where there is NaN to place
    where = ""
    if mask.dim() == 2:
        rows = mask.any(dim=1).nonzero().flatten().tolist()
        shown = ", ".join(str(r) for r in rows[:5]) + (
            f" and {len(rows) - 5} more" if len(rows) > 5 else "")
        where = f" (row{'s' if len(rows) > 1 else ''} {shown})"
    return f"{name}: {count:,} NaN value{'s' if count > 1 else ''}{where}"


def compare_tensors(
    want: dict[str, tuple[str, torch.Tensor]],
    have: dict[str, torch.Tensor],
    equal: Optional[Callable[[torch.Tensor, torch.Tensor], bool]] = None,
) -> tuple[int, list[str]]:
    """(compared, differ) for OUT's tensors `have` against what `expected` says they hold;
    `equal` judges two tensors of one shape (by default: the same dtype and the same bits)."""
    same = equal or _same_dtype_and_bits
    differ: list[str] = []
    compared = 0
    for name in sorted(set(want) | set(have)):
        if name not in have:
            differ.append(
                f"{want[name][0]}: no tensor in OUT holds it"
                if name.startswith("?")
                else f"{name}: missing from OUT (the original's {want[name][0]})"
            )
            continue
        if name not in want:
            differ.append(f"{name}: in OUT, with no counterpart in the original")
            continue
        source, tensor = want[name]
        got = have[name]
        compared += 1
        if got.shape != tensor.shape:
            differ.append(
                f"{name}: shape {list(got.shape)}, the original's {source} {list(tensor.shape)}"
            )
        elif not same(got, tensor):
            differ.append(f"{name}: differs from the original's {source}")
    return compared, differ


def _same_dtype_and_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and _same_bits(a, b)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    import torch

    flat_a = a.contiguous().reshape(-1).view(torch.uint8)
    flat_b = b.contiguous().reshape(-1).view(torch.uint8)
    return bool(torch.equal(flat_a, flat_b))


def diff(a: torch.Tensor, b: torch.Tensor) -> LogitDiff:
    a, b = a.float(), b.float()
    scale = float(a.abs().max()) if a.numel() else 0.0
    max_abs = float((a - b).abs().max()) if a.numel() else 0.0
    return {
        "positions": int(a.shape[0]) if a.dim() else 0,
        "max_abs": max_abs,
        "max_rel": max_abs / scale if scale > 0 else 0.0,
        "scale": scale,
    }


# -- reading tensors ------------------------------------------------------------------------


class FolderTensors:
    """A folder's tensors by name, each file opened only while a group is read: a mapped
    file keeps the pages it touched resident as long as it is open."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.where = out_weight_map(folder)

    def names(self) -> set[str]:
        return set(self.where)

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        missing = [n for n in names if n not in self.where]
        if missing:
            raise ValueError(f"{self.folder.name} has no tensor {missing[0]}")
        by_file: dict[str, list[str]] = {}
        for n in names:
            by_file.setdefault(self.where[n], []).append(n)
        out: dict[str, torch.Tensor] = {}
        for fname, group in by_file.items():
            with safe_open(str(self.folder / fname), framework="pt") as fh:
                for n in group:
                    out[n] = fh.get_tensor(n)
        return out


# -- one model as a skeleton ------------------------------------------------------------------


class _Captured(Exception):
    def __init__(self, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        super().__init__("captured")
        self.call = (args, kwargs)


@dataclass
class Side:
    """One model: its skeleton (one block), where its tensors are, what its parts are
    called."""

    model: PreTrainedModel
    files: FolderTensors
    blocks_prefix: str  # "transformer.h." / "model.layers."
    embed: str  # module names
    norm: str
    head: str
    compute: torch.dtype
    layers: int
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # block-relative
    # what the model gave its first block, for each row
    calls: list[tuple[tuple[object, ...], dict[str, object]]] = field(default_factory=list)

    @property
    def block(self) -> nn.Module:
        blocks = self.model.get_submodule(self.blocks_prefix.rstrip("."))
        return blocks.get_submodule("0")

    def block_names(self, i: int) -> list[str]:
        return [f"{self.blocks_prefix}{i}.{k}" for k in self.shapes]

    def start(self, rows: list[torch.Tensor]) -> list[torch.Tensor]:
        """The hidden states the model gives its first block for each row (and the other
        arguments, kept for the blocks)."""
        embed = self.model.get_submodule(self.embed)
        weight_name = f"{self.embed}.weight"
        weight = self.files.read([weight_name])[weight_name]
        stored = weight.dtype
        _put(embed, "weight", weight)
        del weight
        hooks = [
            # the embedding stays in the stored dtype; what it gives is widened
            embed.register_forward_hook(lambda _m, _i, o: o.to(self.compute)),
            self.block.register_forward_pre_hook(_capture, with_kwargs=True),
        ]
        hidden: list[torch.Tensor] = []
        try:
            for ids in rows:
                try:
                    self.model(input_ids=ids, use_cache=False)
                except _Captured as got:
                    self.calls.append(got.call)
                    args, kwargs = got.call
                    hidden.append(_tensor(args[0] if args else kwargs["hidden_states"]))
                else:
                    raise RuntimeError(
                        f"{type(self.model).__name__} never called its first block")
        finally:
            for h in hooks:
                h.remove()
            _put(embed, "weight", _placeholder(stored))
        return hidden

    def run_block(
        self, tensors: dict[str, torch.Tensor], i: int, hidden: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Block i (its tensors loaded, widened, then dropped) on each row's states."""
        import torch

        prefix = f"{self.blocks_prefix}{i}."
        block = self.block
        for rel, shape in self.shapes.items():
            t = tensors[prefix + rel]
            if tuple(t.shape) != shape:
                raise ValueError(f"{prefix + rel} has shape {list(t.shape)}, not {list(shape)}")
            module, _, leaf = rel.rpartition(".")
            _put(block.get_submodule(module) if module else block, leaf, t.to(self.compute))
        out: list[torch.Tensor] = []
        with torch.inference_mode():
            for state, (args, kwargs) in zip(hidden, self.calls):
                if args:
                    args = (state, *args[1:])
                else:
                    kwargs = {**kwargs, "hidden_states": state}
                got = block(*args, **kwargs)
                out.append(_tensor(got[0] if isinstance(got, tuple) else got))
        for rel in self.shapes:
            module, _, leaf = rel.rpartition(".")
            owner = block.get_submodule(module) if module else block
            _put(owner, leaf, _placeholder(self.compute))
        return out

    def logits(
        self, tensors: dict[str, torch.Tensor], hidden: list[torch.Tensor]
    ) -> torch.Tensor:
        """The model's own final norm, then its head (a plain matmul in both) in slices:
        every row's positions, one after another."""
        import torch

        norm = self.model.get_submodule(self.norm)
        w_name = f"{self.norm}.weight"
        _put(norm, "weight", tensors[w_name].to(self.compute))
        head = tensors[f"{self.head}.weight"]
        with torch.inference_mode():
            normed = torch.cat([norm(h)[0] for h in hidden])
            parts = [
                torch.nn.functional.linear(normed, head[r:r + _HEAD_ROWS].to(self.compute))
                for r in range(0, head.shape[0], _HEAD_ROWS)
            ]
        _put(norm, "weight", _placeholder(self.compute))
        logits: torch.Tensor = torch.cat(parts, dim=-1)
        return logits


def _capture(_module: object, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
    raise _Captured(args, kwargs)


def _tensor(x: object) -> torch.Tensor:
    import torch

    if not isinstance(x, torch.Tensor):
        raise TypeError(f"a block gave {type(x).__name__}, not a tensor")
    return x


def _put(module: nn.Module, leaf: str, tensor: torch.Tensor) -> None:
    import torch

    module._parameters[leaf] = torch.nn.Parameter(tensor, requires_grad=False)


def _placeholder(dtype: torch.dtype) -> torch.Tensor:
    import torch

    return torch.empty(0, dtype=dtype)


# -- building the two skeletons -------------------------------------------------------------


def _skeleton_config(config: PretrainedConfig, layers: int) -> None:
    config.num_hidden_layers = 1
    config.vocab_size = _SKELETON_VOCAB
    pad = getattr(config, "pad_token_id", None)
    if isinstance(pad, int) and pad >= _SKELETON_VOCAB:
        config.pad_token_id = None
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, list):
        if len(set(layer_types[:layers])) > 1:
            raise ValueError(f"the layers are not all of one kind ({sorted(set(layer_types))})")
        config.layer_types = layer_types[:1]


def _finish(model: PreTrainedModel, compute: torch.dtype, prefix: str) -> dict[str, tuple[
        int, ...]]:
    model.to(compute)  # type: ignore[arg-type]
    model.eval()  # type: ignore[no-untyped-call, unused-ignore]
    block = model.get_submodule(prefix.rstrip(".")).get_submodule("0")
    return {k: tuple(p.shape) for k, p in block.named_parameters()}


def original_side(path: Path, compute: torch.dtype, layers: int) -> Side:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path), trust_remote_code=True)
    config.use_cache_quantization = False
    config.use_cache_kernel = False
    config.use_flash_attn = False
    # the skeleton is built in float32 and set to `compute`; Qwen's code would otherwise
    # pick bf16 or fp16 for itself
    config.bf16, config.fp16, config.fp32 = False, False, True
    names = ("transformer.h.", "transformer.wte", "transformer.ln_f")
    return _side(path, config, compute, layers, names, remote_code=True)


def converted_side(path: Path, compute: torch.dtype, layers: int) -> Side:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    names = ("model.layers.", "model.embed_tokens", "model.norm")
    return _side(path, config, compute, layers, names, remote_code=False)


def _side(
    path: Path, config: PretrainedConfig, compute: torch.dtype, layers: int,
    names: tuple[str, str, str], remote_code: bool,
) -> Side:
    """One model's skeleton from its `config`; `names`: the prefix of its blocks, its
    embedding and its final norm."""
    from transformers import AutoModelForCausalLM

    _skeleton_config(config, layers)
    model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
        config, trust_remote_code=remote_code
    )
    prefix, embed, norm = names
    shapes = _finish(model, compute, prefix)
    return Side(model, FolderTensors(path), prefix, embed, norm, "lm_head", compute, layers,
                shapes)


# -- the proof -------------------------------------------------------------------------------


@dataclass
class BlockProof:
    layers_total: int
    layers_run: int
    weights: Weights
    blocks: list[LogitDiff]  # the hidden states after each block, the original's against OUT's
    # `logits`: every position of every prompt
    logits: LogitDiff
    compute_dtype: str
    stored_dtype: str
    converted_dtype: str


def _stored_dtype(tensors: dict[str, torch.Tensor]) -> str:
    return str(next(iter(tensors.values())).dtype).replace("torch.", "")


def prove(
    original: Path,
    out: Path,
    rows: list[list[int]],
    *,
    layers_total: int,
    layers: Optional[int] = None,
    device: str = "cpu",
    on_block: Optional[Callable[[int, int], None]] = None,
    on_head: Optional[Callable[[], None]] = None,
) -> BlockProof:
    """Run the prompts `rows` (token ids) through both models block by block (module
    doc), each alone. `on_block(done, n)` after each block, `on_head()` before the heads
    (a 152k-token head is a long step of its own)."""
    import torch

    n = layers_total if layers is None else min(layers, layers_total)
    first = FolderTensors(original).read(["transformer.h.0.ln_1.weight"])
    stored = _stored_dtype(first)
    compute = torch.float32 if device == "cpu" else getattr(torch, stored)
    a = original_side(original, compute, n)
    b = converted_side(out, compute, n)
    where = torch.device(device)
    a.model.to(where)  # type: ignore[arg-type]
    b.model.to(where)  # type: ignore[arg-type]
    # each prompt alone, unpadded: no position is computed that is not compared
    batch = [torch.tensor([r], device=where) for r in rows]
    compared, differ = 0, []
    nan: list[str] = []  # the original's tensors that hold NaN (OUT's then hold the same bits)
    converted_dtype = stored

    def check(names_a: list[str], names_b: list[str]) -> tuple[
            dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Both sides' tensors, OUT's compared bit for bit with what the original's say."""
        nonlocal compared, converted_dtype
        ta, tb = a.files.read(names_a), b.files.read(names_b)
        converted_dtype = _stored_dtype(tb)
        c, d = compare_tensors(expected(ta), tb)
        compared += c
        differ.extend(d)
        nan.extend(w for w in (nan_where(k, t) for k, t in sorted(ta.items())) if w is not None)
        return ta, tb

    embed_a, embed_b = f"{a.embed}.weight", f"{b.embed}.weight"
    check([embed_a], [embed_b])  # dropped: each side reads its own again, one at a time
    ha, hb = a.start(batch), b.start(batch)
    blocks: list[LogitDiff] = []
    for i in range(n):
        ta, tb = check(a.block_names(i), b.block_names(i))
        ha = a.run_block(ta, i, ha)
        hb = b.run_block(tb, i, hb)
        del ta, tb
        blocks.append(diff(torch.cat([h[0] for h in ha]), torch.cat([h[0] for h in hb])))
        if on_block is not None:
            on_block(i + 1, n)
    if on_head is not None:
        on_head()
    tops_a = [f"{a.norm}.weight", f"{a.head}.weight"]
    tops_b = [f"{b.norm}.weight", f"{b.head}.weight"]
    ta, tb = check(tops_a, tops_b)
    logits_a = a.logits(ta, ha)
    logits_b = b.logits(tb, hb)
    del ta, tb
    extra = sorted(
        name for name in b.files.names()
        if not name.startswith(b.blocks_prefix) and name not in (embed_b, *tops_b)
    )
    differ.extend(f"{name}: in OUT, with no counterpart in the original" for name in extra)
    weights: Weights = {"compared": compared, "differ": differ, "skipped": None, "nan": nan}
    return BlockProof(
        layers_total, n, weights, blocks, diff(logits_a, logits_b),
        str(compute).replace("torch.", ""), stored, converted_dtype,
    )


__all__ = ["BlockProof", "compare_tensors", "expected", "prove"]
