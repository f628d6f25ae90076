"""The converted checkpoint's tokenizer: tokenizer.json and tokenizer_config.json, built
from qwen.tiktoken (bpe.py), with no remote code.

tokenizer.json is written here, field by field, in the shape that `tokenizers` 0.15 (the
release transformers 4.37 pins) through 0.23 all read: merges as "left right" strings
(0.20 and later save them as pairs, which 0.15 cannot parse) and no field that 0.15 does
not know (`ignore_merges` among them: the merges alone reach every token, bpe.py says
why). Its pipeline is Qwen's: NFC first (Qwen's tokenizer normalizes every text to NFC
before splitting), Qwen's split pattern, the byte-level mapping, BPE, and the 208 special
tokens as added tokens, looked for in the NFC text before the rest is split, as Qwen's
tokenizer looks for them.

tokenizer_config.json names `PreTrainedTokenizerFast`, the class that loads tokenizer.json
whole in every release: 4.37 through 4.x, and 5.x, where it is the plain tokenizers
backend. A model-specific class would not do: transformers 5's Qwen2Tokenizer keeps only
the vocabulary and merges of the file and rebuilds the rest from its own code, so the
file would no longer be what runs. Special tokens as Qwen2's releases set them: a chat
model's eos is `<|im_end|>` (the end of a turn, where Qwen's chat stops; engines that
read only the tokenizer's eos stop there too), a base model's `<|endoftext|>`; pad is
`<|endoftext|>` (Qwen's pad_token_id); no bos (Qwen adds none), no unk (byte-level BPE
encodes every text).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Optional

from qwen_kvprep.convert.bpe import (
    ENDOFTEXT,
    IM_END,
    SPECIAL_TOKENS,
    SPLIT_PATTERN,
    TIKTOKEN,
    Vocabulary,
    read_tiktoken,
    to_unicode,
)
from qwen_kvprep.convert.chat import (
    CHAT_TEMPLATE,
    SourceGeneration,
    check_special_ids,
    read_source_generation,
)
from qwen_kvprep.errors import CheckpointError
from qwen_kvprep.fsutil import atomic_write_text
from qwen_kvprep.jsontypes import JSON, JSONObject
from qwen_kvprep.untrusted import describe_json_error, load_json, read_regular

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
TOKENIZER_CLASS = "PreTrainedTokenizerFast"

_BYTE_LEVEL: JSONObject = {
    "type": "ByteLevel",
    "add_prefix_space": False,
    "trim_offsets": False,
    "use_regex": False,
}


def _added(token: str, id_: int) -> JSONObject:
    return {
        "id": id_,
        "content": token,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        # Qwen normalizes the whole text to NFC and only then looks for special tokens: a
        # normalized added token is looked for in the normalized text, the same order
        # ("<|im_end|>" followed by U+0338 is "<|im_end|" and "≯" to both)
        "normalized": True,
        "special": True,
    }


def tokenizer_json(vocab: Vocabulary, split_pattern: str = SPLIT_PATTERN) -> JSONObject:
    """tokenizer.json's content (`split_pattern` is a knob for the tests that prove a wrong
    one is caught)."""
    model: JSONObject = {
        "type": "BPE",
        "dropout": None,
        "unk_token": None,
        "continuing_subword_prefix": "",
        "end_of_word_suffix": "",
        "fuse_unk": False,
        "byte_fallback": False,
        "vocab": {to_unicode(tok): rank for rank, tok in enumerate(vocab.tokens)},
        "merges": [f"{to_unicode(a)} {to_unicode(b)}" for a, b in vocab.merges],
    }
    added: list[JSON] = [_added(tok, id_) for tok, id_ in vocab.special_ids().items()]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": split_pattern},
                    "behavior": "Isolated",
                    "invert": False,
                },
                dict(_BYTE_LEVEL),
            ],
        },
        "post_processor": dict(_BYTE_LEVEL),
        "decoder": dict(_BYTE_LEVEL),
        "model": model,
    }


def tokenizer_config(
    vocab: Vocabulary, gen: SourceGeneration, max_length: Optional[int]
) -> JSONObject:
    decoder: JSONObject = {}
    for tok, id_ in vocab.special_ids().items():
        entry = _added(tok, id_)
        del entry["id"]
        decoder[str(id_)] = entry
    out: JSONObject = {
        "tokenizer_class": TOKENIZER_CLASS,
        "bos_token": None,
        "eos_token": IM_END if gen.chat else ENDOFTEXT,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        # Qwen's decode returns the text as it was: no clean-up of spaces before
        # punctuation (4.x's default for a tokenizer that does not say)
        "clean_up_tokenization_spaces": False,
        "add_prefix_space": False,
        "split_special_tokens": False,
        # what the model's forward takes: PreTrainedTokenizerFast would add token_type_ids
        # on transformers 4.x, which generate(**tok(text)) refuses for Qwen2 (4.37: "The
        # following `model_kwargs` are not used by the model: ['token_type_ids']")
        "model_input_names": ["input_ids", "attention_mask"],
        # all of them, so that skip_special_tokens and all_special_ids cover every id past
        # the ranks, as Qwen's decode does
        "additional_special_tokens": list(SPECIAL_TOKENS),
        "added_tokens_decoder": decoder,
    }
    if max_length is not None:
        out["model_max_length"] = max_length
    if gen.chat:
        out["chat_template"] = CHAT_TEMPLATE
    return out


def _max_length(src: Path) -> Optional[int]:
    """Qwen's own tokenizer_config.json model_max_length, else config.json's seq_length;
    None when neither says (both are read as untrusted, and a bad value is refused)."""
    for name, key in ((TOKENIZER_CONFIG, "model_max_length"), ("config.json", "seq_length")):
        path = src / name
        try:
            data = load_json(read_regular(path, 16 << 20), 64)
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as exc:
            raise CheckpointError.failing(
                "convert.tokenizer_config",
                f"{path} {describe_json_error(exc)}",
                f"restore the model's own {name} (`ls -l {shlex.quote(str(path))}`)",
                [path],
            ) from None
        value = data.get(key) if isinstance(data, dict) else None
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckpointError.failing(
                "convert.tokenizer_config",
                f"{path} has {key} {value!r}: a positive whole number expected",
                f"restore the model's own {name}",
                [path],
            )
        return value
    return None


def _dump(data: JSONObject) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def write_tokenizer(src: Path, dst: Path, mode: Optional[int] = None) -> list[str]:
    """Write tokenizer.json and tokenizer_config.json into dst (each atomically) from
    src's qwen.tiktoken, generation_config.json (chat or base) and tokenizer_config.json;
    the file names written. Everything is read and checked before the first write.
    Raises CheckpointError for a bad source file."""
    vocab = read_tiktoken(src / TIKTOKEN)
    gen = read_source_generation(src)
    check_special_ids(src, gen, vocab)
    config = tokenizer_config(vocab, gen, _max_length(src))
    body = tokenizer_json(vocab)
    atomic_write_text(dst / TOKENIZER_JSON, _dump(body), mode=mode)
    atomic_write_text(dst / TOKENIZER_CONFIG, _dump(config), mode=mode)
    return [TOKENIZER_JSON, TOKENIZER_CONFIG]
