"""Qwen (v1)'s code on the running transformers: the lines `fix` adds to modeling_qwen.py
for it.

The changes themselves are in our module `templates/qwen_kvprep_compat.py`, written as
`qwen_kvprep_compat.py` beside modeling_qwen.py; it decides when the model's code is imported
what the running transformers needs (on 4.32 to 4.53 nothing, unless
transformers_stream_generator cannot be imported), so a folder prepared once serves under
every supported release. The user's file gets two changes, each between
marker lines, that `revert` undoes byte for byte from the journal and `unpatched` takes
out exactly (`without_ours`: ours and the fast path's; every other line is the user's):

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

from qwen_kvprep import fastkv
from qwen_kvprep.common import COMPAT_FILE
from qwen_kvprep.fastkv import END, append_block, remove_block
from qwen_kvprep.resources import templates_dir

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
    return remove_block(_HIDDEN.sub(_unhide, text), BLOCK)


def patched(text: str) -> str:
    """The file with our changes (once); `text` must hold no fast-path block (the caller
    appends that one after ours)."""
    return append_block(_STREAM_IMPORT.sub(_hide, unpatched(text)), BLOCK)


def as_fixed(text: str) -> str:
    """The file's import lines as they will be once fix has run (the import of the stream
    generator wrapped), for reading which packages transformers will then require; the text
    itself where fix leaves the file alone (it defines none of Qwen's models)."""
    base = without_ours(text)
    if recognise(base) is not None:
        return text
    return _STREAM_IMPORT.sub(_hide, base)


def without_ours(text: str) -> str:
    """modeling_qwen.py without any of the lines fix adds (ours and the fast path's): the
    user's own file, byte for byte, when `marker_problem` finds nothing."""
    return unpatched(fastkv.unpatched(text))


# What every marker line of ours holds (the blocks' and the hidden import's).
START_MARK = ">>> qwen-kvprep"
END_MARK = "<<< qwen-kvprep"


def marker_problem(text: str) -> Optional[str]:
    """Why the lines fix added to this modeling_qwen.py cannot be told from the user's
    (a start marker without its end, lines inside a block edited), naming the first line
    concerned; None when `without_ours` takes them out exactly (or there are none)."""
    lines = text.split("\n")
    opened = 0
    for number, line in enumerate(lines, 1):
        if START_MARK in line:
            if opened:
                return (
                    f"line {opened}: qwen-kvprep's start marker has no end marker "
                    f"(`{END_MARK}`) before the next start marker, on line {number}"
                )
            opened = number
        elif END_MARK in line:
            if not opened:
                return f"line {number}: qwen-kvprep's end marker has no start marker before it"
            opened = 0
    if opened:
        return f"line {opened}: qwen-kvprep's start marker has no end marker (`{END_MARK}`)"
    left = set(without_ours(text).split("\n"))
    for number, line in enumerate(lines, 1):
        if (START_MARK in line or END_MARK in line) and line in left:
            return (
                f"line {number}: the lines qwen-kvprep marked there were edited, so they "
                "cannot be taken out without touching yours"
            )
    return None


def recognise(text: str) -> Optional[str]:
    """None when the module applies to this modeling_qwen.py (without our lines), else
    why not (one line)."""
    try:
        tree = ast.parse(fastkv.source_text(text))
    except (SyntaxError, ValueError) as exc:
        return f"it does not parse as Python ({exc.__class__.__name__})"
    classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    missing = [c for c in ("QWenPreTrainedModel", "QWenLMHeadModel") if c not in classes]
    if missing:
        return f"it defines no {', '.join(missing)}"
    return None


def compat_bytes() -> bytes:
    """The compatibility module as fix writes it."""
    return (templates_dir() / COMPAT_FILE).read_bytes()
