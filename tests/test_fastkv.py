"""The Int8 cache's fast path in the model's code: which modeling_qwen.py it is applied to,
the block fix appends, and how fix, --dry-run, --no-fast-path and revert treat the file."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest

from qwen_kvprep import compat, fastkv
from qwen_kvprep.common import COMPAT_FILE, FAST_FILE, MODELING_FILE
from qwen_kvprep.resources import templates_dir
from qwen_kvprep.tiny import REMOTE_CODE_DIR, generate_checkpoint
from tests.cli import invoke
from tests.remote_code import qwen_modeling

TINY_CODE = (REMOTE_CODE_DIR / MODELING_FILE).read_text(encoding="utf-8")


def _code(revision: str) -> str:
    """A known revision's modeling_qwen.py: qwen-kvprep's tiny one, or Qwen's own where
    the run brings it along."""
    return TINY_CODE if revision == fastkv.TINY else qwen_modeling()


# The first statement of _attn's body in both revisions, and a line added before it:
# signatures unchanged, the numbers not.
ATTN_BODY = "        if self.use_cache_quantization:\n            qk, qk_scale, qk_zero = key\n"
ONE_LINE = "        query = query * 1.0001\n"


def _attn_changed(text: str) -> str:
    assert text.count(ATTN_BODY) == 1
    return text.replace(ATTN_BODY, ONE_LINE + ATTN_BODY)


def test_qwen_kvprep_s_own_model_code_is_recognised() -> None:
    assert fastkv.recognise(TINY_CODE) is None


@pytest.mark.parametrize("revision", sorted(fastkv.KNOWN))
def test_the_known_revisions_have_their_recorded_digests_on_this_python(revision: str) -> None:
    """The table holds what this Python computes (the digests leave out what Python
    versions print differently in ast.dump): a change to either file, or to how digests
    are taken, shows here with the new digests."""
    text = _code(revision)
    found = fastkv.digests(text)
    assert found == fastkv.KNOWN[revision], found
    assert fastkv.recognise(text) is None
    assert fastkv.recognise(fastkv.patched(compat.patched(text))) is None


@pytest.mark.parametrize("revision", sorted(fastkv.KNOWN))
def test_one_changed_line_of_attention_code_is_not_recognised(revision: str) -> None:
    reason = fastkv.recognise(_attn_changed(_code(revision)))
    assert reason is not None
    assert f"against the closest, {revision}, QWenAttention._attn differs" in reason, reason
    # the structural checks alone (signatures, attributes) would have let it through
    assert "takes" not in reason and "sets no" not in reason


@pytest.mark.parametrize("revision", sorted(fastkv.KNOWN))
def test_comments_blank_lines_and_docstrings_change_nothing(revision: str) -> None:
    text = _code(revision)
    anchor = "    def _attn(self, query, key, value, causal_mask=None, attention_mask=None, "
    assert text.count(anchor) == 1
    reworded = text.replace(anchor, "    # reworded by hand\n\n" + anchor).replace(
        ATTN_BODY, "\n        # why, in a comment\n" + ATTN_BODY
    )
    rotary = next(
        n for n in ast.parse(text).body
        if isinstance(n, ast.FunctionDef) and n.name == "apply_rotary_pos_emb"
    )
    docstring = ast.get_docstring(rotary, clean=False)
    assert docstring and reworded.count(docstring) == 1
    reworded = reworded.replace(docstring, "Said otherwise.")
    assert fastkv.recognise(reworded) is None
    # whereas one more method, or one less, is other code
    extra = text.replace(anchor, "    def _helper(self):\n        return 1\n\n" + anchor)
    assert "QWenAttention._helper is new" in str(fastkv.recognise(extra))


def test_digests_leave_out_what_python_versions_print_differently() -> None:
    """3.12's ast.dump adds `type_params=[]`, 3.13's leaves out empty fields: a field that
    is None or empty is left out of the digested shape, so a newer Python's empty field
    changes nothing."""
    tree = ast.parse("def f(x):\n    'doc'\n    return x\n")
    shape = fastkv._shape(tree.body[0])
    assert "type_params" not in shape and "returns" not in shape and "doc" not in shape
    assert shape.startswith("FunctionDef(name=str:'f',args=arguments(args=[arg(arg=str:'x')])")


@pytest.mark.parametrize(
    ("change", "said"),
    [
        # a revision whose attention takes one rotary table, not a list per row
        (("rotary_pos_emb_list=None,", "rotary_pos_emb=None,"), "QWenAttention.forward takes"),
        (("causal_mask=None, attention_mask", "attention_mask"), "QWenAttention._attn takes"),
        (("def quantize_cache_v(", "def quantize_cache("), "defines no quantize_cache_v"),
        (("self.cache_kernels =", "self.kernels ="), "sets no cache_kernels"),
        (("def _reorder_cache(", "def _reorder_caches("), "has no _reorder_cache"),
        (("class QWenAttention(nn.Module):", "class QWenAttention(nn.Module)"), "does not parse"),
    ],
)
def test_other_revisions_are_named_with_the_reason(change: tuple[str, str], said: str) -> None:
    old, new = change
    assert old in TINY_CODE
    reason = fastkv.recognise(TINY_CODE.replace(old, new))
    assert reason is not None and said in reason, reason


def test_the_block_is_appended_once_and_taken_out_byte_for_byte() -> None:
    once = fastkv.patched(TINY_CODE)
    assert once.startswith(TINY_CODE) and fastkv.is_patched(once)
    assert once.count(fastkv.BEGIN) == 1 and once.endswith(fastkv.END + "\n")
    assert fastkv.patched(once) == once
    assert fastkv.unpatched(once) == TINY_CODE
    assert fastkv.recognise(once) is None
    # a file without a final newline keeps its last line intact, and gets no line break
    # of ours once the block is out again
    bare = TINY_CODE.rstrip("\n")
    assert fastkv.patched(bare) == bare + "\n" + fastkv.BLOCK
    assert fastkv.unpatched(fastkv.patched(bare)) == bare
    # the block compiles, and imports by name (a relative import would make transformers
    # copy the module into its cache and fail the load when it is missing)
    compile(once, MODELING_FILE, "exec")
    assert "from ." not in fastkv.BLOCK


def test_the_planted_module_compiles_and_names_what_the_model_code_needs() -> None:
    source = (templates_dir() / FAST_FILE).read_text(encoding="utf-8")
    compile(source, FAST_FILE, "exec")
    for name in ("def install(namespace)", "attention_step", "attention-step"):
        assert name in source


@pytest.fixture()
def ckpt(tmp_path: Path, isolated_hf: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from transformers import dynamic_module_utils as dmu

    # fix runs in this process, where transformers read the modules cache's place when it
    # was first imported: this test's private one instead
    monkeypatch.setattr(dmu, "HF_MODULES_CACHE", str(isolated_hf / "modules"))
    return generate_checkpoint(tmp_path / "Qwen", dtype="fp32")


def _fix(*args: str) -> dict[str, Any]:
    done = invoke("fix", *args, "--no-build", "--no-smoke", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    doc: dict[str, Any] = json.loads(done.stdout)
    return doc


def _finding(doc: dict[str, Any], fid: str) -> dict[str, Any]:
    found = [f for f in doc["findings"] if f["id"] == fid]
    assert len(found) == 1, [f["id"] for f in doc["findings"]]
    finding: dict[str, Any] = found[0]
    return finding


def test_fix_installs_it_and_revert_restores_the_model_code(ckpt: Path) -> None:
    original = (ckpt / MODELING_FILE).read_bytes()
    doc = _fix(str(ckpt))
    assert _finding(doc, "fastkv.model_code")["severity"] == "info"
    assert doc["fast_path"] is True
    text = (ckpt / MODELING_FILE).read_text(encoding="utf-8")
    assert text == fastkv.patched(compat.patched(original.decode("utf-8")))
    assert (ckpt / FAST_FILE).read_bytes() == (templates_dir() / FAST_FILE).read_bytes()
    state = json.loads((ckpt / ".qwen-kvprep" / "state.json").read_text())
    assert FAST_FILE in state["modules"]["files"]
    # a second fix finds it in place
    assert _finding(_fix(str(ckpt)), "fastkv.model_code")["severity"] == "ok"
    done = invoke("revert", str(ckpt))
    assert done.returncode == 0, done.stdout + done.stderr
    assert (ckpt / MODELING_FILE).read_bytes() == original
    assert not (ckpt / FAST_FILE).exists()
    assert not (ckpt / COMPAT_FILE).exists()


def test_fix_repairs_a_lost_fast_module_and_speaks_only_of_what_it_did(ckpt: Path) -> None:
    first = _fix(str(ckpt))
    # doctor's view of the model code, taken before fix's own step, is not fix's to report
    assert "checkpoint.fast_path" not in [f["id"] for f in first["findings"]]
    (ckpt / FAST_FILE).unlink()  # the import stays in modeling_qwen.py: doctor fails this
    again = _fix(str(ckpt))
    assert "checkpoint.fast_path" not in [f["id"] for f in again["findings"]]
    assert (ckpt / FAST_FILE).read_bytes() == (templates_dir() / FAST_FILE).read_bytes()


def test_dry_run_shows_the_change_and_writes_nothing(ckpt: Path) -> None:
    original = (ckpt / MODELING_FILE).read_bytes()
    done = invoke("fix", str(ckpt), "--dry-run", "--no-build", "--no-smoke")
    assert done.returncode == 0, done.stdout + done.stderr
    assert fastkv.BEGIN in done.stdout  # the diff of modeling_qwen.py
    assert FAST_FILE in done.stdout
    assert (ckpt / MODELING_FILE).read_bytes() == original
    assert not (ckpt / FAST_FILE).exists()


def test_no_fast_path_takes_the_block_out_again(ckpt: Path) -> None:
    original = (ckpt / MODELING_FILE).read_bytes()
    _fix(str(ckpt))
    doc = _fix(str(ckpt), "--no-fast-path")
    assert doc["fast_path"] is False
    # the compatibility lines stay: the model needs them on transformers >= 4.54
    assert (ckpt / MODELING_FILE).read_text() == compat.patched(original.decode("utf-8"))
    done = invoke("revert", str(ckpt))
    assert done.returncode == 0, done.stdout + done.stderr
    assert (ckpt / MODELING_FILE).read_bytes() == original


def test_an_unrecognised_revision_is_left_alone_with_the_reason(ckpt: Path) -> None:
    path = ckpt / MODELING_FILE
    older = path.read_text(encoding="utf-8").replace(
        "rotary_pos_emb_list=None,", "rotary_pos_emb=None,", 1
    )
    path.write_text(older, encoding="utf-8")
    doc = _fix(str(ckpt))
    finding = _finding(doc, "fastkv.model_code")
    assert finding["severity"] == "warn"
    assert "rotary_pos_emb" in finding["message"]
    # the command that fetches the final revision, for this folder
    assert f"download REPO {MODELING_FILE} --local-dir {ckpt}" in finding["fix"]
    assert path.read_text(encoding="utf-8") == compat.patched(older)
    assert not (ckpt / FAST_FILE).exists()


def test_changed_attention_code_is_left_to_the_model_with_the_reason(ckpt: Path) -> None:
    """One line added to _attn, signatures unchanged: fix (and --dry-run) leaves the fast
    path out and says which function differs, and so does doctor."""
    path = ckpt / MODELING_FILE
    changed = _attn_changed(path.read_text(encoding="utf-8"))
    path.write_text(changed, encoding="utf-8")
    said = "QWenAttention._attn differs"
    dry = invoke("fix", str(ckpt), "--dry-run", "--no-build", "--no-smoke")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert said in dry.stdout and fastkv.BEGIN not in dry.stdout
    assert _doctor(ckpt)["severity"] == "info" and said in _doctor(ckpt)["message"]
    doc = _fix(str(ckpt))
    finding = _finding(doc, "fastkv.model_code")
    assert finding["severity"] == "warn" and said in finding["message"], finding
    assert doc["fast_path"] is False
    assert path.read_text(encoding="utf-8") == compat.patched(changed)
    assert not (ckpt / FAST_FILE).exists()


def test_attention_code_changed_under_the_fast_path_is_a_warning_fix_undoes(
    ckpt: Path,
) -> None:
    """The fast path in place (fix ran on the code as shipped), then _attn changed: doctor
    warns that the fast path stands in for code it does not reproduce; fix takes it out."""
    _fix(str(ckpt))
    path = ckpt / MODELING_FILE
    path.write_text(_attn_changed(path.read_text(encoding="utf-8")), encoding="utf-8")
    found = _doctor(ckpt)
    assert found["severity"] == "warn", found
    assert "QWenAttention._attn differs" in found["message"]
    assert "takes the fast path out" in found["fix"]
    doc = _fix(str(ckpt))
    assert doc["fast_path"] is False
    assert not fastkv.is_patched(path.read_text(encoding="utf-8"))
    assert _doctor(ckpt)["severity"] == "info"


def _doctor(ckpt: Path) -> dict[str, Any]:
    done = invoke("doctor", str(ckpt), "--check", "checkpoint.fast_path", "--json")
    doc: dict[str, Any] = json.loads(done.stdout)
    return _finding(doc, "checkpoint.fast_path")


def test_per_token_prefill_is_one_line_of_the_planted_module(ckpt: Path) -> None:
    template = (templates_dir() / FAST_FILE).read_bytes()
    assert fastkv.render_module(template, False) == template
    on = fastkv.render_module(template, True)
    assert on.replace(b"PER_TOKEN_PREFILL = True\n", fastkv.PER_TOKEN_LINE) == template
    with pytest.raises(ValueError):
        fastkv.render_module(template.replace(fastkv.PER_TOKEN_LINE, b""), True)
    doc = _fix(str(ckpt), "--per-token-prefill")
    assert doc["fast_path"] is True
    assert (ckpt / FAST_FILE).read_bytes() == on
