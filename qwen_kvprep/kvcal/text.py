"""The texts calibration and the reference read, and their tokens.

Calibration text: by default the convert proof's own multilingual corpus (convert/corpus.py:
scripts, code, whitespace, emoji, then its seeded mixtures; special-token text left out),
taken in order until CALIBRATION_TOKENS tokens; or the user's file (UTF-8 text, or JSONL
whose lines carry a "text" field), at least MIN_TOKENS tokens, its first MAX_TOKENS used.
Either is cut into rows of ROW_TOKENS tokens, each read alone.

The passage the reference scores is kvjudge's (kvjudge.passage.PASSAGE), another text, so a
cache is judged on text it was not calibrated on.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from qwen_kvprep.convert import corpus
from qwen_kvprep.convert.bpe import SPECIAL_TOKENS, TIKTOKEN, read_tiktoken
from qwen_kvprep.convert.tokenizer import tokenizer_json
from qwen_kvprep.errors import UsageError
from qwen_kvprep.kvjudge import passage
from qwen_kvprep.kvjudge.passage import PASSAGE_TOKENS
from qwen_kvprep.untrusted import NotRegularFile, TooLarge, read_regular

if TYPE_CHECKING:
    from tokenizers import Tokenizer

CALIBRATION_TOKENS = 1024  # 2 rows: about 2 min at Qwen-7B's shape on 2 CPU cores
MIN_TOKENS = 512
MAX_TOKENS = 8192  # of a user's file: the pass costs its tokens (about 15 min at 7B on 2 cores)
ROW_TOKENS = 512
FILE_LIMIT = 64 << 20  # a calibration file is text: more than this is not what was meant
DEFAULT_NAME = "the proof's multilingual corpus"



@dataclass(frozen=True)
class Calibration:
    """The text calibrated on: its name (the file or DEFAULT_NAME), sha256, and tokens."""

    name: str
    sha256: str
    tokens: list[int]

    def rows(self) -> list[list[int]]:
        return [self.tokens[i:i + ROW_TOKENS] for i in range(0, len(self.tokens), ROW_TOKENS)]


def _default_texts() -> list[str]:
    return [t for t in corpus.texts() if t and not any(s in t for s in SPECIAL_TOKENS)]


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False).ids)


def default_calibration(tokenizer: Tokenizer) -> Calibration:
    """The corpus's texts, joined by line breaks, until CALIBRATION_TOKENS tokens."""
    tokens: list[int] = []
    used: list[str] = []
    for text in _default_texts():
        used.append(text)
        tokens += encode(tokenizer, text + "\n")
        if len(tokens) >= CALIBRATION_TOKENS:
            break
    digest = hashlib.sha256("\n".join(used).encode("utf-8", "surrogatepass")).hexdigest()
    return Calibration(DEFAULT_NAME, digest, tokens[:CALIBRATION_TOKENS])


def read_calibration_file(path: Path) -> tuple[str, str]:
    """(the text, the file's sha256): UTF-8 text as it is, or JSONL (a .jsonl name, or every
    non-empty line a JSON object) whose objects' "text" fields are joined by line breaks."""
    try:
        raw = read_regular(path, limit=FILE_LIMIT)
    except FileNotFoundError:
        raise UsageError(f"--calibration {path}: no such file") from None
    except (NotRegularFile, IsADirectoryError):
        raise UsageError(f"--calibration {path}: not a regular file") from None
    except TooLarge:
        raise UsageError(
            f"--calibration {path}: larger than {FILE_LIMIT >> 20} MiB; a few thousand "
            "tokens calibrate"
        ) from None
    except OSError as exc:
        raise UsageError(f"--calibration {path}: cannot be read ({exc.strerror})") from None
    digest = hashlib.sha256(raw).hexdigest()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(
            f"--calibration {path}: not UTF-8 text (byte {exc.start} is not)"
        ) from None
    lines = [ln for ln in text.splitlines() if ln.strip()]
    looks_jsonl = path.suffix == ".jsonl" or (bool(lines) and all(
        ln.lstrip().startswith("{") for ln in lines))
    if not looks_jsonl:
        return text, digest
    texts: list[str] = []
    for n, line in enumerate(lines, start=1):
        try:
            obj = json.loads(line)
        except ValueError:
            raise UsageError(f"--calibration {path}: line {n} is not JSON") from None
        field = obj.get("text") if isinstance(obj, dict) else None
        if not isinstance(field, str):
            raise UsageError(f"--calibration {path}: line {n} has no \"text\" string")
        texts.append(field)
    return "\n".join(texts), digest


def file_calibration(tokenizer: Tokenizer, path: Path) -> Calibration:
    text, digest = read_calibration_file(path)
    tokens = encode(tokenizer, text)
    if len(tokens) < MIN_TOKENS:
        raise UsageError(
            f"--calibration {path}: {len(tokens):,} tokens, too short to calibrate (at "
            f"least {MIN_TOKENS:,})",
            fix="give a longer text (a few pages of what the model will serve), or leave "
            "--calibration out to calibrate on the built-in corpus",
        )
    return Calibration(str(path), digest, tokens[:MAX_TOKENS])


def calibration(tokenizer: Tokenizer, path: Optional[Path]) -> Calibration:
    return default_calibration(tokenizer) if path is None else file_calibration(tokenizer, path)


def passage_ids(tokenizer: Tokenizer, tokens: int = PASSAGE_TOKENS) -> list[int]:
    """The first `tokens` tokens of kvjudge's passage, as this tokenizer encodes it."""
    return passage.passage_ids(lambda s: encode(tokenizer, s), (passage.PASSAGE,), tokens)


def tokenizer_of(directory: Path) -> Tokenizer:
    """The tokenizer a folder carries: OUT's tokenizer.json, or DIR's qwen.tiktoken made
    into the same (convert.tokenizer's construction, which the proof checks)."""
    from tokenizers import Tokenizer

    fast = directory / "tokenizer.json"
    if fast.is_file():
        return Tokenizer.from_str(read_regular(fast, limit=FILE_LIMIT).decode("utf-8"))
    body = tokenizer_json(read_tiktoken(directory / TIKTOKEN))
    return Tokenizer.from_str(json.dumps(body))


