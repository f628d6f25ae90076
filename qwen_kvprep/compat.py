"""Qwen (v1)'s code on the running transformers: the lines `fix` adds to modeling_qwen.py
for it.

The changes themselves are in our module `templates/qwen_kvprep_compat.py`, written as
`qwen_kvprep_compat.py` beside modeling_qwen.py; it decides when the model's code is imported
what the running transformers needs (nothing on 4.32 to 4.53), so a folder prepared once
serves under every supported release. The user's file gets two changes, each between
marker lines, that `revert` undoes byte for byte from the journal and `unpatched` takes
out exactly:

- a block at the end that imports the module (before the fast path's block, if any);
- the import of `transformers_stream_generator` inside `chat_stream` wrapped in
  `try:`/`except ImportError: raise`. Its behaviour is unchanged, but transformers' check
  of the packages a model file imports skips `try` blocks (4.x by a regular expression
  from `try:` to the next `except ...:`, later releases on the syntax tree): from 4.57 on
  that package cannot be imported at all, and the check refused every load although only
  `chat_stream` uses it (the module then gives `chat_stream` its own streaming).
"""

from __future__ import annotations

import ast
import re
from typing import Optional

from qwen_kvprep.fastkv import END, remove_block

BEGIN = "# >>> qwen-kvprep: Qwen's code on this transformers (qwen_kvprep_compat.py)"
# A relative import, unlike the fast path's block (fastkv.py): transformers then copies
# the module into every modules-cache folder the code runs from, under every release (4.x
# names the folder after DIR, 5.x after a hash of the code), and a load without it fails
# loudly instead of running with other numbers than the checkpoint's.
BLOCK = f"""{BEGIN}; `qwen-kvprep revert` removes it
from .qwen_kvprep_compat import install as _qwen_kvprep_compat_install

_qwen_kvprep_compat_install(globals())
{END}
"""

_HIDE_BEGIN = "try:  # >>> qwen-kvprep: out of transformers' import check (qwen_kvprep_compat.py)"
_HIDE_END = "except ImportError:  # <<< qwen-kvprep"
# An import of the stream generator on a line of its own, as Qwen's chat_stream has it.
_STREAM_IMPORT = re.compile(
    r"^(?P<indent>[ \t]*)(?P<stmt>(?:from[ \t]+transformers_stream_generator[\w.]*[ \t]+import"
    r"|import[ \t]+transformers_stream_generator)[^\n]*)\n",
    re.MULTILINE,
)
_HIDDEN = re.compile(
    r"^(?P<indent>[ \t]*)" + re.escape(_HIDE_BEGIN) + r"\n"
    r"(?P=indent)    (?P<stmt>[^\n]*)\n"
    r"(?P=indent)" + re.escape(_HIDE_END) + r"\n"
    r"(?P=indent)    raise\n",
    re.MULTILINE,
)


def _hide(match: re.Match[str]) -> str:
    indent, stmt = match.group("indent"), match.group("stmt")
    return f"{indent}{_HIDE_BEGIN}\n{indent}    {stmt}\n{indent}{_HIDE_END}\n{indent}    raise\n"


def _unhide(match: re.Match[str]) -> str:
    return f"{match.group('indent')}{match.group('stmt')}\n"


def is_patched(text: str) -> bool:
    return BEGIN in text


def unpatched(text: str) -> str:
    """The file without our changes (the text itself when it has none)."""
    return remove_block(_HIDDEN.sub(_unhide, text), BEGIN)


def patched(text: str) -> str:
    """The file with our changes (once); `text` must hold no fast-path block (the caller
    appends that one after ours)."""
    base = _STREAM_IMPORT.sub(_hide, unpatched(text))
    if not base.endswith("\n"):
        base += "\n"
    return base + "\n" + BLOCK


def recognise(text: str) -> Optional[str]:
    """None when the module applies to this modeling_qwen.py (without our lines), else
    why not (one line)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError) as exc:
        return f"it does not parse as Python ({exc.__class__.__name__})"
    classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    missing = [c for c in ("QWenPreTrainedModel", "QWenLMHeadModel") if c not in classes]
    if missing:
        return f"it defines no {', '.join(missing)}"
    return None
