"""The Int8 cache's fast path in the model's code: which modeling_qwen.py it applies to,
and the lines `fix` appends to it.

The fast path itself is our module `templates/qwen_kvprep_kv.py`, planted as
`qwen_kvprep_kv.py` beside the loader. It replaces `QWenAttention.forward` (for the
quantized cache with our kernels) and `QWenLMHeadModel._reorder_cache` at import, relying on
what Qwen's final revisions of modeling_qwen.py define. `recognise` checks exactly that, on
the file's syntax tree, so a revision the fast path was not written for is left alone. The
change to the user's file is one block at its end, between two marker lines; `revert`
restores the original byte for byte from the journal.
"""

from __future__ import annotations

import ast
from typing import Optional

BEGIN = "# >>> qwen-kvprep: the Int8 KV cache's fast path (qwen_kvprep_kv.py)"
END = "# <<< qwen-kvprep"
# Imported by name at run time, not by a relative import: transformers copies relative
# imports into its modules cache and fails the load when one is missing, while this block
# only warns (the model then runs its own code).
BLOCK = f"""{BEGIN}; `qwen-kvprep revert` removes it
try:
    import importlib as _qwen_kvprep_importlib

    _qwen_kvprep_importlib.import_module(".qwen_kvprep_kv", __package__).install(globals())
except ImportError as _qwen_kvprep_error:
    import warnings as _qwen_kvprep_warnings

    _qwen_kvprep_warnings.warn("qwen-kvprep's fast path is not loaded: %s" % _qwen_kvprep_error)
{END}
"""

# What the fast path calls or replaces, as Qwen's final revisions spell it.
FORWARD_ARGS = (
    "self",
    "hidden_states",
    "rotary_pos_emb_list",
    "layer_past",
    "attention_mask",
    "head_mask",
    "encoder_hidden_states",
    "encoder_attention_mask",
    "output_attentions",
    "use_cache",
)
ATTN_ARGS = ("self", "query", "key", "value", "causal_mask", "attention_mask", "head_mask")
ATTRIBUTES = (
    "c_attn",
    "c_proj",
    "split_size",
    "num_heads",
    "head_dim",
    "seq_length",
    "use_logn_attn",
    "logn_tensor",
    "scale_attn_weights",
    "use_cache_quantization",
    "use_cache_kernel",
    "cache_kernels",
)
FUNCTIONS = ("apply_rotary_pos_emb", "quantize_cache_v")


PER_TOKEN_LINE = b"PER_TOKEN_PREFILL = False\n"


def render_module(template: bytes, per_token_prefill: bool) -> bytes:
    """qwen_kvprep_kv.py as fix plants it: the template, with per-token prompt scales
    switched on when asked."""
    if not per_token_prefill:
        return template
    if template.count(PER_TOKEN_LINE) != 1:
        raise ValueError("templates/qwen_kvprep_kv.py lacks its PER_TOKEN_PREFILL line")
    return template.replace(PER_TOKEN_LINE, b"PER_TOKEN_PREFILL = True\n")


def is_patched(text: str) -> bool:
    return BEGIN in text


def unpatched(text: str) -> str:
    """The file without our block (the text itself when it has none)."""
    return remove_block(text, BEGIN)


def remove_block(text: str, begin: str) -> str:
    """`text` without the block of ours that starts with the line `begin` and ends with
    the next END line (the text itself when it has none, or an unfinished one)."""
    start = text.find("\n" + begin)
    if start == -1:
        return text
    end = text.find(END, start)
    if end == -1:
        return text
    end += len(END)
    if text.startswith("\n", end):
        end += 1
    return text[:start] + text[end:]


def patched(text: str) -> str:
    """The file with our block appended (once)."""
    base = unpatched(text)
    if not base.endswith("\n"):
        base += "\n"
    return base + "\n" + BLOCK


def _args(fn: ast.FunctionDef) -> tuple[str, ...]:
    return tuple(a.arg for a in fn.args.posonlyargs + fn.args.args)


def _assigned(cls: ast.ClassDef) -> set[str]:
    """Attributes the class sets on `self` anywhere (`self.x = ...`, register_buffer)."""
    names: set[str] = set()
    for node in ast.walk(cls):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for target in targets:
            if (
                isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
            ):
                names.add(target.attr)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "register_buffer"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names.add(node.args[0].value)
    return names


def recognise(text: str) -> Optional[str]:
    """None when the fast path applies to this modeling_qwen.py, else why not (one line)."""
    try:
        tree = ast.parse(unpatched(text))
    except (SyntaxError, ValueError) as exc:
        return f"it does not parse as Python ({exc.__class__.__name__})"
    functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    missing = [f for f in FUNCTIONS if f not in functions]
    if missing:
        return f"it defines no {', '.join(missing)}"
    attention, lm_head = classes.get("QWenAttention"), classes.get("QWenLMHeadModel")
    if attention is None or lm_head is None:
        return "it defines no QWenAttention or QWenLMHeadModel"
    methods = {n.name: n for n in attention.body if isinstance(n, ast.FunctionDef)}
    for name, want in (("forward", FORWARD_ARGS), ("_attn", ATTN_ARGS)):
        fn = methods.get(name)
        if fn is None:
            return f"QWenAttention has no {name}"
        if _args(fn) != want:
            return (
                f"QWenAttention.{name} takes ({', '.join(_args(fn))}), not the final "
                f"revisions' ({', '.join(want)})"
            )
    absent = [a for a in ATTRIBUTES if a not in _assigned(attention)]
    if absent:
        return f"QWenAttention sets no {', '.join(absent)} (a revision before the Int8 cache?)"
    if not any(isinstance(n, ast.FunctionDef) and n.name == "_reorder_cache" for n in lm_head.body):
        return "QWenLMHeadModel has no _reorder_cache"
    return None
