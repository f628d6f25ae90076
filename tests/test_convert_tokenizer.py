"""convert's tokenizer (qwen_kvprep/convert/tokenizer.py, bpe.py), chat template and
generation config (chat.py), and the proof that the converted tokenizer is Qwen's
(tokproof.py over corpus.py).

The proofs load Qwen's tokenizer through the tiny checkpoint's remote code (an imitation of
Qwen's: tiktoken over qwen.tiktoken, Qwen's split pattern and special tokens) and the
converted one natively, in a child process with its own modules cache, as convert's
verification does: on the running transformers, and in .venv437 (transformers 4.37.2 with
tokenizers 0.15, the oldest release that serves the converted checkpoint) when present.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path
from typing import Any

import pytest

from qwen_kvprep.convert import bpe, chat, corpus
from qwen_kvprep.convert.tokenizer import TOKENIZER_CLASS, tokenizer_json, write_tokenizer
from qwen_kvprep.errors import CheckpointError
from qwen_kvprep.tiny import generate_checkpoint
from tests import needs
from tests.remote_code import transformers_release

REPO = Path(__file__).resolve().parents[1]
VENV437_PYTHON = REPO / ".venv437" / "bin" / "python"
CL100K_DIGITS = bpe.SPLIT_PATTERN.replace(r"|\p{N}|", r"|\p{N}{1,3}|")

# Each job: Qwen's tokenizer from `src` (remote code), the converted one from `out`.
SCRIPT = r"""
import json, sys, warnings
warnings.filterwarnings("ignore")
import tokenizers, transformers
from transformers import AutoTokenizer
from qwen_kvprep.convert.tokproof import prove_chat_template, prove_tokenizer
results = []
for job in json.loads(sys.argv[1]):
    original = AutoTokenizer.from_pretrained(job["src"], trust_remote_code=True)
    converted = AutoTokenizer.from_pretrained(job["out"])
    result = {"class": type(converted).__name__,
              "tokenizer": prove_tokenizer(original, converted).to_json()}
    if job.get("template"):
        result["template"] = prove_chat_template(original, converted).to_json()
    results.append(result)
print(json.dumps({"transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
                  "results": results}))
"""


def _prove(python: Path, jobs: list[dict[str, Any]], tmp: Path) -> dict[str, Any]:
    tmp.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HOME": str(tmp / "hf"), "HF_MODULES_CACHE": str(tmp / "hf" / "m"),
           "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    res = subprocess.run([str(python), "-c", SCRIPT, json.dumps(jobs)], env=env,
                         capture_output=True, text=True, timeout=900, cwd=tmp)
    assert res.returncode == 0, res.stderr[-4000:]
    out: dict[str, Any] = json.loads(res.stdout.splitlines()[-1])
    return out


def _converted(src: Path, out: Path) -> Path:
    out.mkdir(parents=True)
    write_tokenizer(src, out)
    chat.write_generation_config(src, out)
    return out


def _rewrite(path: Path, change: Any) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    change(data)
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


def _with_digit_tokens(ckpt: Path) -> Path:
    """Add "12", "123", "20", "204", "2048" after the tiny's ranks (merges of lower ranks,
    as BPE training would leave them): a vocabulary where splitting digits one by one
    (Qwen) and three at a time (cl100k) give different ids."""
    path = ckpt / bpe.TIKTOKEN
    lines = path.read_bytes().splitlines()
    extra = [b"12", b"123", b"20", b"204", b"2048"]
    for tok in extra:
        lines.append(base64.b64encode(tok) + b" " + str(len(lines)).encode())
    path.write_bytes(b"\n".join(lines) + b"\n")
    eod = len(lines)

    def ids(data: dict[str, Any]) -> None:
        data["eos_token_id"] = data["pad_token_id"] = eod

    _rewrite(ckpt / chat.GENERATION_CONFIG, ids)
    return ckpt


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny chat checkpoint and its conversions: as convert writes it, with one merge
    removed, and (on a vocabulary with multi-digit tokens) with Qwen's and cl100k's split."""
    root = tmp_path_factory.mktemp("convert-tok")
    tiny = generate_checkpoint(root / "Tiny-Chat", dtype="fp32")
    good = _converted(tiny, root / "good")
    bad_merges = _converted(tiny, root / "bad-merges")

    def drop_merge(data: dict[str, Any]) -> None:
        # " the" or the first merge that forms a word: the tiny's corpus is English
        merges = data["model"]["merges"]
        merges.remove(next(m for m in merges if m.replace(" ", "") == "Ġthe"))

    _rewrite(bad_merges / "tokenizer.json", drop_merge)
    digits = _with_digit_tokens(generate_checkpoint(root / "Tiny-Digits", dtype="fp32"))
    digits_good = _converted(digits, root / "digits-good")
    digits_cl100k = _converted(digits, root / "digits-cl100k")

    def cl100k(data: dict[str, Any]) -> None:
        data["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = CL100K_DIGITS

    _rewrite(digits_cl100k / "tokenizer.json", cl100k)
    return {"tiny": tiny, "good": good, "bad-merges": bad_merges, "digits": digits,
            "digits-good": digits_good, "digits-cl100k": digits_cl100k}


def _jobs(f: dict[str, Path]) -> list[dict[str, Any]]:
    return [
        {"src": str(f["tiny"]), "out": str(f["good"]), "template": True},
        {"src": str(f["tiny"]), "out": str(f["bad-merges"])},
        {"src": str(f["digits"]), "out": str(f["digits-good"])},
        {"src": str(f["digits"]), "out": str(f["digits-cl100k"])},
    ]


def _check_proofs(got: dict[str, Any]) -> None:
    good, bad_merges, digits_good, digits_cl100k = got["results"]
    proof = good["tokenizer"]
    assert good["class"] in ("PreTrainedTokenizerFast", "TokenizersBackend")
    assert proof["ok"], proof["examples"]
    assert proof["vocabulary"] == 512 + len(bpe.SPECIAL_TOKENS)  # the tiny's ranks and specials
    assert proof["entries"] + proof["entries_not_utf8"] == 512 and proof["entries"] > 256
    assert proof["ids_decoded"] == 720 and proof["texts"] == corpus.SIZE >= 10_000
    assert proof["corpus_sha256"] == corpus.fingerprint(corpus.texts())
    template = good["template"]
    assert template["ok"] and not template["skipped"], template
    cases = {c["name"]: c for c in template["cases"]}
    assert sum(not c["documented"] for c in cases.values()) >= 9
    injected = cases["special-token text in a user message"]
    # what the reference says: the same text, but the converted template's tokens include the
    # special tokens that Qwen keeps as plain text
    assert injected["text_equal"] and not injected["ids_equal"], injected
    assert injected["converted_tokens"] < injected["qwen_tokens"]
    window = cases["history longer than Qwen's window"]
    assert not window["text_equal"] and window["converted_tokens"] > chat.MAX_WINDOW

    for broken in (bad_merges["tokenizer"], digits_cl100k["tokenizer"]):
        assert not broken["ok"] and broken["mismatches"] > 0 and broken["examples"]
    assert any("ids" in m["check"] for m in bad_merges["tokenizer"]["examples"])
    assert digits_good["tokenizer"]["ok"], digits_good["tokenizer"]["examples"]
    assert any(
        "123" in m["text"] or "2048" in m["text"] for m in digits_cl100k["tokenizer"]["examples"]
    ), digits_cl100k["tokenizer"]["examples"]


@pytest.mark.slow
def test_the_proof_holds_on_the_running_transformers_and_catches_broken_conversions(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    if transformers_release() < (4, 37):
        needs.skip("transformers-4.37", "the converted tokenizer is served from 4.37 on")
    _check_proofs(_prove(Path(sys.executable), _jobs(folders), tmp_path))


@pytest.mark.slow
def test_the_proof_holds_on_transformers_4_37_with_tokenizers_0_15(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    if not VENV437_PYTHON.exists():
        needs.skip("venv-4.37", f"{VENV437_PYTHON} is not installed (.ci/run makes it)")
    got = _prove(VENV437_PYTHON, _jobs(folders), tmp_path)
    assert got["transformers"] == "4.37.2" and got["tokenizers"].startswith("0.15."), got
    _check_proofs(got)


# ------------------------------------------------------------------ the files written


def test_tokenizer_json_has_the_shape_tokenizers_0_15_reads(folders: dict[str, Path]) -> None:
    data = json.loads((folders["good"] / "tokenizer.json").read_text(encoding="utf-8"))
    model = data["model"]
    # pairs ("merges": [["a", "b"]]) and ignore_merges are what 0.20+ writes and 0.15 refuses
    assert all(isinstance(m, str) and m.count(" ") == 1 for m in model["merges"])
    assert "ignore_merges" not in model and model["type"] == "BPE"
    assert len(model["merges"]) == len(model["vocab"]) - 256  # one merge per multi-byte token
    assert data["normalizer"] == {"type": "NFC"}
    split = data["pre_tokenizer"]["pretokenizers"][0]
    assert split["pattern"]["Regex"] == bpe.SPLIT_PATTERN and r"\p{N}{1,3}" not in bpe.SPLIT_PATTERN
    specials = {t["content"]: t["id"] for t in data["added_tokens"]}
    assert specials["<|endoftext|>"] == 512 and specials["<|im_start|>"] == 513
    assert specials["<|im_end|>"] == 514 and specials["<|extra_204|>"] == 512 + 207
    # looked for in the NFC text, as Qwen does (see the corpus's "<|im_end|>\u0338")
    assert all(t["special"] and t["normalized"] for t in data["added_tokens"])


def test_a_chat_model_gets_the_template_and_stops_at_the_end_of_a_turn(
    folders: dict[str, Path],
) -> None:
    config = json.loads((folders["good"] / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["tokenizer_class"] == TOKENIZER_CLASS and "auto_map" not in config
    assert config["eos_token"] == "<|im_end|>" and config["pad_token"] == "<|endoftext|>"
    assert config["bos_token"] is None and config["chat_template"] == chat.CHAT_TEMPLATE
    assert config["model_max_length"] == 8192 and config["clean_up_tokenization_spaces"] is False
    assert config["added_tokens_decoder"]["514"]["content"] == "<|im_end|>"
    gen = json.loads((folders["good"] / chat.GENERATION_CONFIG).read_text(encoding="utf-8"))
    # the tiny's: chatml, top_k 0 (off, in transformers and vLLM alike), top_p 0.8, ...
    assert gen == {"do_sample": True, "top_p": 0.8, "repetition_penalty": 1.1, "top_k": 0,
                   "max_new_tokens": 512, "eos_token_id": [514, 512], "pad_token_id": 512}
    assert not list(folders["good"].glob("*.py")) and not list(folders["good"].glob(".*"))


def test_a_base_model_has_no_template_and_stops_at_endoftext(tmp_path: Path) -> None:
    ckpt = generate_checkpoint(tmp_path / "Tiny", dtype="fp32")
    gen_path = ckpt / chat.GENERATION_CONFIG
    _rewrite(gen_path, lambda d: d.update(chat_format="raw", max_window_size=1,
                                          stop_words_ids=[[1]]))
    out = _converted(ckpt, tmp_path / "out")
    config = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert "chat_template" not in config and config["eos_token"] == "<|endoftext|>"
    gen = json.loads((out / chat.GENERATION_CONFIG).read_text(encoding="utf-8"))
    assert gen["eos_token_id"] == 512 and "max_window_size" not in gen
    assert "stop_words_ids" not in gen and "chat_format" not in gen

    gen_path.unlink()  # no generation_config.json at all: a base model, no sampling defaults
    bare = _converted(ckpt, tmp_path / "bare")
    assert json.loads((bare / chat.GENERATION_CONFIG).read_text()) == {
        "eos_token_id": 512, "pad_token_id": 512}


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"top_p": "0.8"}, "top_p '0.8': a number expected"),
        ({"top_k": -1}, "top_k -1: a whole number >= 0"),
        ({"do_sample": 1}, "do_sample 1: true or false"),
        ({"chat_format": "alpaca"}, "chat_format 'alpaca'"),
        ({"eos_token_id": 7}, "eos_token_id 7, but <|endoftext|> is 512"),
    ],
)
def test_a_bad_generation_config_is_refused_before_anything_is_written(
    tmp_path: Path, change: dict[str, Any], said: str
) -> None:
    ckpt = generate_checkpoint(tmp_path / "Tiny", dtype="fp32")
    _rewrite(ckpt / chat.GENERATION_CONFIG, lambda d: d.update(change))
    out = tmp_path / "out"
    out.mkdir()
    for write in (write_tokenizer, chat.write_generation_config):
        with pytest.raises(CheckpointError) as info:
            write(ckpt, out)
        assert said in info.value.message and "generation_config.json" in info.value.message
        assert info.value.fix and "--force-download" in info.value.fix
    assert not list(out.iterdir())


# ------------------------------------------------------------------ qwen.tiktoken, untrusted


def _line(tok: bytes, rank: int) -> bytes:
    return base64.b64encode(tok) + b" " + str(rank).encode()


def _bytes_file(extra: list[bytes]) -> bytes:
    return b"\n".join([_line(bytes([b]), b) for b in range(256)] + extra) + b"\n"


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (b"", "holds no ranks"),
        (_bytes_file([b"not base64! 256"]), "line 257 is not `<base64 token> <rank>`"),
        (_bytes_file([b"YWJj 256 extra"]), "line 257 is not"),
        (_bytes_file([b"YWJ 256"]), "line 257: the token is not valid base64"),
        (_bytes_file([_line(b"ab", 257)]), "skips rank 256"),
        (_bytes_file([_line(b"ab", 256), _line(b"cd", 256)]), "line 258: rank 256 appears twice"),
        (_bytes_file([_line(b"ab", 256), _line(b"ab", 257)]), "is also rank 256"),
        (_bytes_file([b"YWI= 0256"]), "line 257 is not"),
        (_bytes_file([_line(b"xyz", 256)]), "rank 256 (b'xyz') ends as 3 parts"),
        (_bytes_file([_line(b"<|im_end|>", 256)]), "<|im_end|> as an ordinary token"),
        (b"\n".join(_line(bytes([b]), b) for b in range(255)), "lacks the single byte 0xff"),
        (_bytes_file([_line(b"a" * 1025, 256)]), "a token of 1025 bytes"),
    ],
)
def test_a_malformed_qwen_tiktoken_is_refused_clearly(
    tmp_path: Path, content: bytes, said: str
) -> None:
    ckpt = generate_checkpoint(tmp_path / "Tiny", dtype="fp32")
    (ckpt / bpe.TIKTOKEN).write_bytes(content)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(CheckpointError) as info:
        write_tokenizer(ckpt, out)
    assert said in info.value.message and str(ckpt / bpe.TIKTOKEN) in info.value.message
    assert info.value.fix and "qwen.tiktoken" in info.value.fix
    assert not list(out.iterdir())


def test_qwen_tiktoken_that_is_not_a_small_regular_file_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / bpe.TIKTOKEN
    with pytest.raises(CheckpointError, match="does not exist"):
        bpe.read_tiktoken(path)
    os.mkfifo(path)  # a reader would wait forever for a writer: refused at once
    with pytest.raises(CheckpointError, match="FIFO"):
        bpe.read_tiktoken(path)
    path.unlink()
    path.write_bytes(_bytes_file([]))
    monkeypatch.setattr(bpe, "FILE_LIMIT", 100)
    with pytest.raises(CheckpointError, match="more than the 100 allowed"):
        bpe.read_tiktoken(path)


def test_merges_are_tiktoken_s_own_procedure() -> None:
    """Each multi-byte token's one merge is the pair tiktoken's loop leaves below its rank,
    even where another split of the same bytes exists ("abc" = "a"+"bc" = "ab"+"c")."""
    extra = [_line(b"bc", 256), _line(b"ab", 257), _line(b"abc", 258), _line(b"aab", 259)]
    vocab = bpe.parse_tiktoken(_bytes_file(extra), Path("x"))
    assert vocab.merges == ((b"b", b"c"), (b"a", b"b"), (b"a", b"bc"), (b"a", b"ab"))
    data = tokenizer_json(vocab)
    assert data["model"]["merges"][:3] == ["b c", "a b", "a bc"]
    assert data["model"]["vocab"]["Ġ"] == 32 and data["model"]["vocab"]["Ċ"] == 10  # GPT-2 table
    assert bpe.to_bytes(bpe.to_unicode(bytes(range(256)))) == bytes(range(256))


def test_the_corpus_is_large_deterministic_and_covers_the_edges() -> None:
    texts = corpus.texts()
    assert len(texts) == corpus.SIZE >= 10_000 and texts == corpus.texts()
    joined = "".join(texts)
    for needle in ("\r\n", "\t", "  \n", "\u200d", "<|im_end|>", "<|extra_204|>", "1234567",
                   "\u0301", "中文", "Ελληνικά", "العربية", "हिन्दी", "def main"):
        assert needle in joined, needle
    # the same texts on every Python release CI runs (3.9 to 3.13)
    assert corpus.fingerprint(texts)[:16] == "1056a1ee0770f52c"


# ------------------------------------------------------------------ the proof's verdicts


class _Fake:
    """A tokenizer over single bytes (ids 0..255, then the special tokens), enough for the
    proof: `quirk` changes the ids of the texts it names, `letters_unknown` are letters its
    regex engine does not know (tokenizers 0.15 and Unicode 15's letters, say)."""

    def __init__(self, quirk: tuple[str, ...] = (), letters_unknown: str = "") -> None:
        self.quirk = quirk
        self.unknown = letters_unknown
        self.specials = {t: 256 + i for i, t in enumerate(bpe.SPECIAL_TOKENS)}
        self.backend_tokenizer = self
        self.pre_tokenizer = self

    def pre_tokenize_str(self, text: str) -> list[tuple[str, tuple[int, int]]]:
        split = any(c in self.unknown for c in text)
        return [(c, (i, i + 1)) for i, c in enumerate(text)] if split else [(text, (0, 1))]

    def get_vocab(self) -> dict[Any, int]:
        return {bytes([b]): b for b in range(256)} if not self.quirk else {
            bpe.to_unicode(bytes([b])): b for b in range(256)} | self.specials

    def __len__(self) -> int:
        return 256 + len(self.specials)

    def convert_tokens_to_ids(self, token: str) -> int:
        return self.specials[token]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ids[::-1] if text in self.quirk else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", "replace")

    def batch_decode(self, rows: list[list[int]]) -> list[str]:
        return [self.decode(r) for r in rows]

    def __call__(self, texts: list[str], add_special_tokens: bool) -> dict[str, Any]:
        return {"input_ids": [self.encode(t) for t in texts]}


def test_a_split_the_regex_engine_s_unicode_tables_cause_is_reported_apart() -> None:
    from qwen_kvprep.convert.tokproof import prove_tokenizer

    kawi = "ab \U00011f04\U00011f05\n \n"  # Unicode 15 letters, unknown to tokenizers 0.15
    texts = ["plain", kawi, "reversed"]
    converted = _Fake(quirk=(kawi, "reversed"), letters_unknown="\U00011f04\U00011f05")
    proof = prove_tokenizer(_Fake(), converted, texts=texts)
    assert proof.mismatches == 1 and proof.examples[0].text == "reversed"
    assert proof.engine_unicode == 1 and "U+11F04 U+11F05" in proof.engine_examples[0].check
    assert proof.texts == 3 and proof.vocabulary == 256 and proof.entries == 128
    assert any("regex engine does not know" in line for line in proof.lines())
    # the same difference with letters the engine knows is the conversion's
    plain = _Fake(quirk=(kawi, "reversed"))
    assert prove_tokenizer(_Fake(), plain, texts=texts).mismatches == 2


class _Normalizing(_Fake):
    """Qwen's order: NFC over the whole text, then its special tokens, then bytes."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = self._pieces(unicodedata.normalize("NFC", text))
        return ids[::-1] if text in self.quirk else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        names = {i: t for t, i in self.specials.items()}
        out, run = "", b""
        for i in ids:
            if i < 256:
                run += bytes([i])
                continue
            out += run.decode("utf-8", "replace")
            out += "" if skip_special_tokens else names.get(i, "")
            run = b""
        return out + run.decode("utf-8", "replace")

    def _pieces(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in re.split("(" + "|".join(map(re.escape, self.specials)) + ")", text):
            if piece in self.specials:
                ids.append(self.specials[piece])
            else:
                ids += list(piece.encode("utf-8"))
        return ids


class _SpecialsFirst(_Normalizing):
    """transformers 5's Qwen2 tokenizer's order: special tokens first, then NFC per piece."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids: list[int] = []
        for piece in re.split("(" + "|".join(map(re.escape, self.specials)) + ")", text):
            if piece in self.specials:
                ids.append(self.specials[piece])
            else:
                ids += self._pieces(unicodedata.normalize("NFC", piece))
        return ids[::-1] if text in self.quirk else ids


def test_special_text_that_nfc_joins_with_a_mark_is_reported_apart_and_hides_nothing() -> None:
    from qwen_kvprep.convert.tokproof import prove_tokenizer

    joined = "<|im_end|>\u0338 after"  # NFC makes '>' + U+0338 one character: no token
    texts = ["plain <|im_end|> text", joined, "reversed"]
    proof = prove_tokenizer(_Normalizing(), _SpecialsFirst(quirk=("reversed",)), texts=texts)
    assert proof.mismatches == 1 and proof.examples[0].text == "reversed"
    assert proof.specials_first == 1 and proof.specials_first_examples[0].text == joined
    assert any("finds the special token first" in line for line in proof.lines())
    assert proof.to_json()["specials_first"] == 1
    # the same text with another difference in it is the conversion's, not put apart
    other = prove_tokenizer(_Normalizing(), _SpecialsFirst(quirk=(joined,)), texts=[joined])
    assert other.mismatches == 1 and other.specials_first == 0
