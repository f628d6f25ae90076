"""Qwen (v1)'s vocabulary, `qwen.tiktoken`, read as untrusted input and turned into the
byte-level BPE that the `tokenizers` library runs.

The file holds one `base64-token rank` per line, ranks 0..N-1. Qwen's tokenizer runs it
through tiktoken, which merges, within each piece the split pattern cuts, the adjacent
pair of parts whose concatenation has the lowest rank, until no concatenation is a token;
a piece that is a token as a whole is that token at once. Its special tokens follow the
ranks: `<|endoftext|>` (N), `<|im_start|>` (N+1), `<|im_end|>` (N+2), then `<|extra_0|>` to
`<|extra_204|>`, 208 in all.

`tokenizers` merges pairs instead: a list of (left, right) in priority order. Each token of
rank r with more than one byte gets exactly one merge: the two parts that tiktoken's own
procedure, run on the token's bytes with only the ranks below r, leaves. That split is
the one tiktoken always forms the token from, in any text: the merges inside a span that
ends as the token are those of the span alone (a part that crossed its edge could never
be undone), and run alone the span ends with those two parts at rank r. So merging by
these pairs in rank order is tiktoken's procedure exactly, and every token, whole-piece
shortcut included, is reached; a file where some token cannot be reached that way is no
BPE vocabulary and is refused. The tokenizer proof (tokproof.py) checks the outcome.
"""

from __future__ import annotations

import base64
import binascii
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from qwen_kvprep import hubcli
from qwen_kvprep.errors import CheckpointError
from qwen_kvprep.untrusted import NotRegularFile, TooLarge, read_regular

TIKTOKEN = "qwen.tiktoken"

# The real file is 2,561,218 bytes (151,643 ranks, the longest token 128 bytes).
FILE_LIMIT = 64 << 20
TOKEN_LIMIT = 1024

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (
    ENDOFTEXT,
    IM_START,
    IM_END,
    *(f"<|extra_{i}|>" for i in range(205)),
)

# Qwen's split before BPE: contractions, letter runs with at most one leading non-letter,
# ONE digit at a time (cl100k, which Qwen's vocabulary grew from, takes up to three),
# punctuation runs with their line breaks, line breaks, other whitespace.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_LINE = re.compile(rb"([A-Za-z0-9+/]+={0,2}) (0|[1-9][0-9]{0,9})")


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's table: each byte as a printable character (the printable Latin-1 bytes as
    themselves, the others shifted past U+0100), so a byte string is a str of the same
    length that `tokenizers`' ByteLevel steps understand."""
    keep = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table = {b: chr(b) for b in keep}
    shift = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(0x100 + shift)
            shift += 1
    return table


BYTE_TO_UNICODE = byte_to_unicode()
UNICODE_TO_BYTE = {c: b for b, c in BYTE_TO_UNICODE.items()}


def to_unicode(token: bytes) -> str:
    return "".join(BYTE_TO_UNICODE[b] for b in token)


def to_bytes(token: str) -> bytes:
    """The bytes of a byte-level token string (KeyError for a character outside the table)."""
    return bytes(UNICODE_TO_BYTE[c] for c in token)


@dataclass(frozen=True)
class Vocabulary:
    """The validated ranks: `tokens[r]` is the token of rank r; `merges[i]` the pair that
    forms the i-th multi-byte token, in rank order."""

    tokens: tuple[bytes, ...]
    merges: tuple[tuple[bytes, bytes], ...]

    @property
    def size(self) -> int:
        return len(self.tokens)

    def special_ids(self) -> dict[str, int]:
        return {tok: self.size + i for i, tok in enumerate(SPECIAL_TOKENS)}


def _refuse(path: Path, what: str) -> CheckpointError:
    q = shlex.quote
    return CheckpointError.failing(
        "convert.tiktoken",
        f"{path} {what}",
        f"restore the model's own file: `{hubcli.download()} <repo> {TIKTOKEN} "
        f"--local-dir {q(str(path.parent))} --force-download`",
        [path],
    )


def read_tiktoken(path: Path, merges: bool = True) -> Vocabulary:
    """Read, validate and convert `path` (merges=False: no merges recovered, an empty
    tuple). Raises CheckpointError naming the first bad line."""
    try:
        raw = read_regular(path, FILE_LIMIT)
    except FileNotFoundError:
        raise _refuse(path, "does not exist: the tokenizer is built from it") from None
    except (NotRegularFile, TooLarge) as exc:
        raise _refuse(path, exc.strerror or "cannot be read") from None
    except OSError as exc:
        raise _refuse(path, f"cannot be read ({exc.strerror or exc})") from None
    return parse_tiktoken(raw, path, merges)


def parse_tiktoken(raw: bytes, path: Path, merges: bool = True) -> Vocabulary:
    # Qwen's loader takes bytes.splitlines() and skips empty lines: so do we.
    by_rank: dict[int, bytes] = {}
    seen: dict[bytes, int] = {}
    number = 0
    for number, line in enumerate(raw.splitlines(), 1):
        if not line:
            continue
        match = _LINE.fullmatch(line)
        if match is None:
            shown = line[:60].decode("ascii", "backslashreplace")
            raise _refuse(
                path, f"line {number} is not `<base64 token> <rank>` ({shown!r})"
            )
        try:
            token = base64.b64decode(match.group(1), validate=True)
        except binascii.Error:
            raise _refuse(path, f"line {number}: the token is not valid base64") from None
        rank = int(match.group(2))
        if not token or len(token) > TOKEN_LIMIT:
            raise _refuse(
                path, f"line {number}: a token of {len(token)} bytes (1 to {TOKEN_LIMIT})"
            )
        if rank in by_rank:
            raise _refuse(path, f"line {number}: rank {rank} appears twice")
        if token in seen:
            raise _refuse(
                path, f"line {number}: the token of rank {rank} is also rank {seen[token]}"
            )
        by_rank[rank] = token
        seen[token] = rank
    size = len(by_rank)
    if size == 0:
        raise _refuse(path, "holds no ranks")
    if max(by_rank) != size - 1:
        missing = next(r for r in range(size) if r not in by_rank)
        raise _refuse(path, f"skips rank {missing}: ranks must be 0..N-1 without gaps")
    absent = [b for b in range(256) if bytes([b]) not in seen]
    if absent:
        raise _refuse(
            path,
            f"lacks the single byte 0x{absent[0]:02x} ({len(absent)} of 256 missing): a "
            "byte-level BPE needs every byte as a token",
        )
    specials = [t for t in SPECIAL_TOKENS if t.encode("utf-8") in seen]
    if specials:
        raise _refuse(path, f"has {specials[0]} as an ordinary token (it is a special token)")
    tokens = tuple(by_rank[r] for r in range(size))
    return Vocabulary(tokens=tokens, merges=_merges(tokens, path) if merges else ())


def _merges(tokens: tuple[bytes, ...], path: Path) -> tuple[tuple[bytes, bytes], ...]:
    ranks = {tok: r for r, tok in enumerate(tokens)}
    merges: list[tuple[bytes, bytes]] = []
    for rank, token in enumerate(tokens):
        if len(token) == 1:
            continue
        parts = _bpe(token, ranks, rank)
        if len(parts) != 2:
            raise _refuse(
                path,
                f"has a token that merges cannot form: rank {rank} ({token!r}) ends as "
                f"{len(parts)} parts when tiktoken's merges below its rank run on its "
                "bytes, so no byte-level BPE reproduces this vocabulary",
            )
        merges.append((parts[0], parts[1]))
    return tuple(merges)


def _bpe(token: bytes, ranks: dict[bytes, int], below: int) -> list[bytes]:
    """tiktoken's merge loop on `token`'s bytes, with the ranks below `below` only."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 1:
        best_rank, best_at = below, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1], below)
            if rank < best_rank:
                best_rank, best_at = rank, i
        if best_at < 0:
            break
        parts[best_at : best_at + 2] = [parts[best_at] + parts[best_at + 1]]
    return parts
