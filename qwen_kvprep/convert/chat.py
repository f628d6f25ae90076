"""Chat and generation for a converted checkpoint: the chat template that renders Qwen's
chatml context, and generation_config.json.

Qwen's `chat()` builds its context with `make_context` (qwen_generation_utils.py):

    <|im_start|>system\\n{system}<|im_end|>
    \\n<|im_start|>user\\n{query}<|im_end|>\\n<|im_start|>assistant\\n{response}<|im_end|>
    ...
    \\n<|im_start|>user\\n{query}<|im_end|>\\n<|im_start|>assistant\\n

with "You are a helpful assistant." as the system prompt when none is given. CHAT_TEMPLATE
renders the same text from a list of messages. It goes into tokenizer_config.json, which
every transformers release from 4.37 reads; chat_template.jinja is not written, since the
4.x releases before it was introduced never read it.

Where the two differ (Qwen tokenizes the role, the line break and the content apart and
never reads special-token text in content as special tokens; it drops the oldest turns
past 6,144 tokens) is said in the README and measured by tokproof.prove_chat_template.

generation_config.json carries the checkpoint's sampling defaults and the stop tokens.
Qwen's chat stops on `<|im_end|>` through its own stop-word processor (stop_words_ids),
which native loaders do not run: a chat model's converted config stops on `<|im_end|>` and
`<|endoftext|>` through eos_token_id instead.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from qwen_kvprep import hubcli
from qwen_kvprep.convert.bpe import (
    ENDOFTEXT,
    IM_END,
    SPECIAL_TOKENS,
    TIKTOKEN,
    Vocabulary,
    read_tiktoken,
)
from qwen_kvprep.errors import CheckpointError
from qwen_kvprep.fsutil import atomic_write_text
from qwen_kvprep.jsontypes import JSON, JSONObject
from qwen_kvprep.untrusted import describe_json_error, load_json, read_regular

GENERATION_CONFIG = "generation_config.json"
DEFAULT_SYSTEM = "You are a helpful assistant."
# Qwen's make_context drops the oldest turns past this many tokens; the template keeps all.
MAX_WINDOW = 6144

CHAT_TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] -%}"
    "{%- set turns = messages[1:] -%}"
    "{%- else -%}"
    "{%- set system = '" + DEFAULT_SYSTEM + "' -%}"
    "{%- set turns = messages -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>system\\n' + system + '<|im_end|>' -}}"
    "{%- for message in turns -%}"
    "{{- '\\n<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '\\n<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

_LIMIT = 1 << 20
_DEPTH = 16

# Sampling defaults that mean the same in Qwen's generate (transformers'), in today's
# transformers and in vLLM: carried as they are, after a type check. top_k 0 is "off" in
# transformers (no top-k step) and in vLLM (0 or -1); left out, transformers would apply
# its own default of 50.
_NUMBERS = ("temperature", "top_p", "repetition_penalty", "length_penalty")
_COUNTS = ("top_k", "max_new_tokens", "min_new_tokens", "num_beams", "no_repeat_ngram_size")
_FLAGS = ("do_sample",)
CARRIED = _FLAGS + _NUMBERS + _COUNTS


@dataclass(frozen=True)
class SourceGeneration:
    """What the checkpoint's generation_config.json says (empty when it has none)."""

    chat: bool
    sampling: JSONObject
    eos_token_id: Optional[int]
    pad_token_id: Optional[int]


def _refuse(path: Path, what: str) -> CheckpointError:
    return CheckpointError.failing(
        "convert.generation_config",
        f"{path} {what}",
        f"restore the model's own file: `{hubcli.download()} <repo> {GENERATION_CONFIG} "
        f"--local-dir {shlex.quote(str(path.parent))} --force-download`",
        [path],
    )


def read_source_generation(src: Path) -> SourceGeneration:
    """src's generation_config.json, validated. A chat model says `chat_format: chatml`;
    no file, or `raw`, is a base model. Raises CheckpointError for a bad file."""
    path = src / GENERATION_CONFIG
    try:
        raw = read_regular(path, _LIMIT)
    except FileNotFoundError:
        return SourceGeneration(chat=False, sampling={}, eos_token_id=None, pad_token_id=None)
    except OSError as exc:
        raise _refuse(path, describe_json_error(exc)) from None
    try:
        data = load_json(raw, _DEPTH)
    except ValueError as exc:
        raise _refuse(path, describe_json_error(exc)) from None
    if not isinstance(data, dict):
        raise _refuse(path, "does not hold a JSON object")
    chat_format = data.get("chat_format", "raw")
    if chat_format not in ("chatml", "raw"):
        raise _refuse(path, f"has chat_format {chat_format!r}: Qwen knows 'chatml' and 'raw'")
    sampling: JSONObject = {}
    for key in CARRIED:
        if key in data:
            sampling[key] = _checked(path, key, data[key])
    return SourceGeneration(
        chat=chat_format == "chatml",
        sampling=sampling,
        eos_token_id=_token_id(path, data, "eos_token_id"),
        pad_token_id=_token_id(path, data, "pad_token_id"),
    )


def _checked(path: Path, key: str, value: JSON) -> JSON:
    if key in _FLAGS:
        if not isinstance(value, bool):
            raise _refuse(path, f"has {key} {value!r}: true or false expected")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _refuse(path, f"has {key} {value!r}: a number expected")
    if key in _COUNTS:
        if not isinstance(value, int) or value < 0:
            raise _refuse(path, f"has {key} {value!r}: a whole number >= 0 expected")
        return value
    if not value > 0 or (key == "top_p" and value > 1):
        raise _refuse(path, f"has {key} {value!r}: out of range")
    return value


def _token_id(path: Path, data: JSONObject, key: str) -> Optional[int]:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _refuse(path, f"has {key} {value!r}: a token id expected")
    return value


def check_special_ids(src: Path, gen: SourceGeneration, vocab: Vocabulary) -> None:
    """Qwen's <|endoftext|> comes right after the ranks: a generation config that names
    another eos or pad id belongs to another vocabulary, and converting would move it."""
    expected = vocab.special_ids()[ENDOFTEXT]
    for key, value in (("eos_token_id", gen.eos_token_id), ("pad_token_id", gen.pad_token_id)):
        if value is not None and value != expected:
            raise _refuse(
                src / GENERATION_CONFIG,
                f"has {key} {value}, but <|endoftext|> is {expected} in qwen.tiktoken "
                f"({vocab.size:,} ranks): the two files are not of one checkpoint",
            )


def end_of_text_id(src: Path, rows: int) -> int:
    """<|endoftext|>'s id in src's qwen.tiktoken, once the ranks and the special tokens
    after them are known to fit the embedding's `rows` (CheckpointError otherwise: every
    special id would index past the weights, and the tokenizer, the configs and the model
    would disagree). Called before convert writes anything."""
    path = src / TIKTOKEN
    vocab = read_tiktoken(path, merges=False)
    ids = vocab.size + len(SPECIAL_TOKENS)
    if ids > rows:
        raise CheckpointError.failing(
            "convert.tiktoken",
            f"{path} has {vocab.size:,} ranks; with the {len(SPECIAL_TOKENS)} special tokens "
            f"after them that is {ids:,} ids, but the embedding has {rows:,} rows: "
            f"<|endoftext|> would be id {vocab.size:,} and {ids - rows:,} special ids would "
            "have no row. The tokenizer and the weights are not of one checkpoint",
            f"restore the model's own file: `{hubcli.download()} <repo> {TIKTOKEN} "
            f"--local-dir {shlex.quote(str(src))} --force-download`",
            [path],
        )
    return vocab.special_ids()[ENDOFTEXT]


def generation_config(gen: SourceGeneration, vocab: Vocabulary) -> JSONObject:
    ids = vocab.special_ids()
    eos: Union[int, list[JSON]] = ids[ENDOFTEXT]
    if gen.chat:
        eos = [ids[IM_END], ids[ENDOFTEXT]]
    out: JSONObject = dict(gen.sampling)
    out["eos_token_id"] = eos
    out["pad_token_id"] = ids[ENDOFTEXT]
    return out


def write_generation_config(src: Path, dst: Path, mode: Optional[int] = None) -> list[str]:
    """Write dst/generation_config.json from src's (atomically); the file names written.
    Raises CheckpointError for a bad source file or one at odds with qwen.tiktoken."""
    gen = read_source_generation(src)
    # the ranks' count and validity is all this needs: the merges are write_tokenizer's
    vocab = read_tiktoken(src / TIKTOKEN, merges=False)
    check_special_ids(src, gen, vocab)
    text = json.dumps(generation_config(gen, vocab), indent=2) + "\n"
    atomic_write_text(dst / GENERATION_CONFIG, text, mode=mode)
    return [GENERATION_CONFIG]
