"""The Int8 cache's fast path in the model's code: which modeling_qwen.py it applies to,
and the lines `fix` appends to it.

The fast path itself is our module `templates/qwen_kvprep_kv.py`, planted as
`qwen_kvprep_kv.py` beside the loader. It replaces `QWenAttention.forward` (for the
quantized cache with our kernels) and `QWenLMHeadModel._reorder_cache` at import, relying on
what Qwen's final revisions of modeling_qwen.py define. `recognise` checks exactly that, on
the file's syntax tree, and that the code it stands in for is, piece by piece, that of a
revision it reproduces exactly (digests of the syntax tree: a comment or a blank line
changes nothing, a changed line of code does), so any other code is left alone. The
change to the user's file is one block at its end, between two marker lines; `revert`
restores the original byte for byte from the journal.
"""

from __future__ import annotations

import ast
import hashlib
from typing import Optional

from qwen_kvprep.common import FAST_FILE
from qwen_kvprep.resources import templates_dir

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
# Functions of the module that the fast path calls (the rotary embedding, on queries and
# keys at once), reproduces in its extension (the quantization) or stands in for (the
# dequantization of the model's own attention), digested with QWenAttention and
# QWenLMHeadModel._reorder_cache (`_pieces`).
MODULE_PIECES = (
    "apply_rotary_pos_emb",
    "_rotate_half",
    "quantize_cache_v",
    "dequantize_cache_torch",
)
QWEN_FINAL = "Qwen-7B-Chat's final revision"
TINY = "qwen-kvprep's tiny model"
# The revisions the fast path reproduces exactly (greedy tokens and logits bit for bit
# those of the model's own Int8 code, in the tests): each piece's digest (`digests`).
KNOWN: dict[str, dict[str, str]] = {
    # Qwen's own code as its model repos end (Qwen-7B-Chat's modeling_qwen.py)
    QWEN_FINAL: {
        "QWenAttention": "8b5bb308279b678dedc537473af48095",
        "QWenAttention.__init__": "5bac0978537999ea9647be01cddfbfb3",
        "QWenAttention._attn": "b6a1a90fcd7cc83cfbaec7461c20e1e2",
        "QWenAttention._merge_heads": "8dfff9aa3cfc0f4220114cddcb34c26a",
        "QWenAttention._split_heads": "3e26ba89ead16be1e32b0f0505219094",
        "QWenAttention.forward": "4203b6a7d61bf702fc3a01de2c3e6dea",
        "QWenLMHeadModel._reorder_cache": "c9093829d74a84d54099d28e09f6b83b",
        "_rotate_half": "068cc6629063eb0a3fa73fa82f200b0e",
        "apply_rotary_pos_emb": "f336e30d149b611c615f72de88aa6986",
        "dequantize_cache_torch": "df483de7314f016058614b0905fa7a1e",
        "quantize_cache_v": "590caea9c3acbe59965dd3fcb104f50f",
    },
    # qwen-kvprep's imitation of it (qwen_kvprep/tiny/remote), which the tests load
    TINY: {
        "QWenAttention": "8b5bb308279b678dedc537473af48095",
        "QWenAttention.__init__": "ce652199606409b44cb6bcf0064d7816",
        "QWenAttention._attn": "08eda429da47419db7a985d93d1cb358",
        "QWenAttention._causal_mask": "8f2615fe120f5291d44019403122c324",
        "QWenAttention._flash": "8c0e4f1c172221d5b3027c0fd40f87cd",
        "QWenAttention._merge_heads": "7fcf11a5f24db02262991c0df86c602d",
        "QWenAttention._sdpa": "ad9d62039efa976184739a0607fe5b6c",
        "QWenAttention._split_heads": "9aa364db1b16c2a8a5dd958dd955d2bf",
        "QWenAttention.forward": "64ee162885ca3716da9ca34d8bdd8406",
        "QWenLMHeadModel._reorder_cache": "ccecb5bebe24aee61ff3c71503ef0901",
        "_rotate_half": "064d9ac1acb4aa425545d2f9f76fe87c",
        "apply_rotary_pos_emb": "b551c89bc03f20d76d7cd253c2c33788",
        "dequantize_cache_torch": "01f2ff083dbb50d6f20d56f7c81afbf9",
        "quantize_cache_v": "99d3558ce2c51f748e75fcf73776afac",
    },
}


PER_TOKEN_LINE = b"PER_TOKEN_PREFILL = False\n"


def render_module(template: bytes, per_token_prefill: bool) -> bytes:
    """qwen_kvprep_kv.py as fix plants it: the template, with per-token prompt scales
    switched on when asked."""
    if not per_token_prefill:
        return template
    if template.count(PER_TOKEN_LINE) != 1:
        raise ValueError("templates/qwen_kvprep_kv.py lacks its PER_TOKEN_PREFILL line")
    return template.replace(PER_TOKEN_LINE, b"PER_TOKEN_PREFILL = True\n")


def module_bytes(per_token_prefill: bool = False) -> bytes:
    """The fast path's module as planted (also into the modules cache)."""
    return render_module((templates_dir() / FAST_FILE).read_bytes(), per_token_prefill)


def is_patched(text: str) -> bool:
    return BEGIN in text


def unpatched(text: str) -> str:
    """The file without our block (the text itself when it has none)."""
    return remove_block(text, BLOCK)


def remove_block(text: str, block: str) -> str:
    """`text` without our `block` and the line break before it, exactly as `append_block`
    added it (the text itself when it has none). Only the block as we wrote it is taken
    out: one whose lines were edited is the user's to resolve (compat.marker_problem says
    so), never a reason to delete lines we cannot tell from theirs."""
    start = text.find("\n" + block)
    if start != -1:
        before, after = text[:start], text[start + 1 + len(block) :]
        if after and not before.endswith("\n"):
            # the user's lines after our block stay on lines of their own
            return before + "\n" + after
        return before + after
    if text.endswith("\n" + block[:-1]):  # only the file's final line break taken off
        return text[: -len(block)]
    return text


def append_block(base: str, block: str) -> str:
    """`base` with `block` on lines of its own after it: a line break, then the block, so
    that `remove_block` gives back `base` byte for byte (a blank line before the block when
    `base` ends with a line break; no line break added to a file without a final one)."""
    return base + "\n" + block


def patched(text: str) -> str:
    """The file with our block appended (once)."""
    return append_block(unpatched(text), BLOCK)


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


def _shape(node: object) -> str:
    """A syntax tree as text: each node's kind and the fields that are set, docstrings
    left out. The same on every Python from 3.9 on: `ast.dump` is not (3.12 adds
    `type_params=[]`, 3.13 leaves out empty fields), while a field that is None or empty
    carries nothing and is left out here whichever Python added it. Positions, comments
    and blank lines are not in the tree."""
    if isinstance(node, list):
        return "[" + ",".join(_shape(item) for item in node) + "]"
    if not isinstance(node, ast.AST):
        return f"{type(node).__name__}:{node!r}"
    fields = []
    for name in node._fields:
        value = getattr(node, name, None)
        if name == "body" and isinstance(node, _DOCUMENTED) and _docstring(node.body):
            value = node.body[1:]
        if value is None or (isinstance(value, list) and not value):
            continue
        fields.append(f"{name}={_shape(value)}")
    return f"{type(node).__name__}({','.join(fields)})"


_DOCUMENTED = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _docstring(body: list[ast.stmt]) -> bool:
    return (
        bool(body)
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    )


def _digest(node: ast.AST) -> str:
    """sha256 of the node's shape, its first 128 bits in hex: enough to tell code apart."""
    return hashlib.sha256(_shape(node).encode("utf-8")).hexdigest()[:32]


def _pieces(tree: ast.Module) -> dict[str, str]:
    """The digest of each piece of the model's code the fast path stands in for or
    relies on, by name: QWenAttention (every method, and the class without them), the module's
    rotary, quantization and dequantization functions, QWenLMHeadModel._reorder_cache.
    A name defined twice is the later definition, as Python runs it."""
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    found = {name: _digest(functions[name]) for name in MODULE_PIECES if name in functions}
    attention = classes.get("QWenAttention")
    if attention is not None:
        methods = {n.name: n for n in attention.body if isinstance(n, ast.FunctionDef)}
        for name, method in methods.items():
            found[f"QWenAttention.{name}"] = _digest(method)
        rest = ast.ClassDef(
            name=attention.name,
            bases=attention.bases,
            keywords=attention.keywords,
            body=[n for n in attention.body if not isinstance(n, ast.FunctionDef)],
            decorator_list=attention.decorator_list,
        )
        found["QWenAttention"] = _digest(rest)
    lm_head = classes.get("QWenLMHeadModel")
    if lm_head is not None:
        for n in lm_head.body:
            if isinstance(n, ast.FunctionDef) and n.name == "_reorder_cache":
                found["QWenLMHeadModel._reorder_cache"] = _digest(n)
    return found


def digests(text: str) -> dict[str, str]:
    """The pieces' digests of a modeling_qwen.py (with or without our block), as KNOWN
    records them; empty when it does not parse."""
    try:
        return _pieces(ast.parse(unpatched(text)))
    except (SyntaxError, ValueError):
        return {}


def _unknown(found: dict[str, str]) -> Optional[str]:
    """None when `found` is a known revision's, else which pieces differ from the closest
    one (one line)."""
    if any(found == known for known in KNOWN.values()):
        return None

    def differences(known: dict[str, str]) -> list[str]:
        said = []
        for name in sorted(set(known) | set(found)):
            if name not in known:
                said.append(f"{name} is new")
            elif name not in found:
                said.append(f"{name} is missing")
            elif known[name] != found[name]:
                said.append(f"{name} differs")
        return said

    closest = min(KNOWN, key=lambda revision: len(differences(KNOWN[revision])))
    return (
        f"it is not a revision the fast path reproduces exactly: against the closest, "
        f"{closest}, {', '.join(differences(KNOWN[closest]))}"
    )


def source_text(text: str) -> str:
    """Python source as the interpreter reads it: a leading UTF-8 BOM is no character of
    the code (ast.parse of a str refuses it; Python itself skips it in a file)."""
    return text[1:] if text.startswith("\ufeff") else text


def recognise(text: str) -> Optional[str]:
    """None when the fast path applies to this modeling_qwen.py, else why not (one line).
    It applies only to attention code it reproduces exactly: the pieces' digests must be
    those of a revision in KNOWN."""
    try:
        tree = ast.parse(source_text(unpatched(text)))
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
    return _unknown(_pieces(tree))
