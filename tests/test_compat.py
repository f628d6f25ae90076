"""Qwen (v1)'s code on the running transformers: the lines fix adds to modeling_qwen.py
(qwen_kvprep/compat.py) and the module they import (templates/qwen_kvprep_compat.py).

The decisions are pure functions of the release; what they do is checked on a model
loaded in a child process (its own modules cache), on whatever transformers runs the
suite: CI runs it on the newest 5.x and on the oldest supported 4.x, and the
cross-release test also in .venv453 (4.53.3).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from qwen_kvprep import compat, fastkv
from qwen_kvprep.common import COMPAT_FILE, MODELING_FILE
from qwen_kvprep.resources import templates_dir
from qwen_kvprep.tiny import REMOTE_CODE_DIR, generate_checkpoint
from tests import needs
from tests.cli import python as python_code
from tests.remote_code import transformers_release, with_compat

REPO = Path(__file__).resolve().parents[1]
VENV453_PYTHON = REPO / ".venv453" / "bin" / "python"
IMPORT = "        from transformers_stream_generator.main import StreamGenerationConfig\n"


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("compat_template", templates_dir() / COMPAT_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------ the lines in the user's file


def test_patched_hides_the_stream_import_and_unpatched_restores_every_byte() -> None:
    original = (REMOTE_CODE_DIR / "modeling_qwen.py").read_text(encoding="utf-8")
    assert IMPORT in original
    text = compat.patched(original)
    lines = text.splitlines(keepends=True)
    assert IMPORT not in lines and "    " + IMPORT in lines  # one level deeper, in the try
    assert text.endswith(compat.BLOCK) and compat.is_patched(text)
    assert compat.patched(text) == text  # idempotent
    assert compat.unpatched(text) == original
    # with the fast path's block after ours, as fix leaves the file
    both = fastkv.patched(text)
    assert compat.unpatched(fastkv.unpatched(both)) == original
    assert compat.patched(compat.unpatched(fastkv.unpatched(both))) == text


def test_the_hidden_import_is_out_of_transformers_import_check(tmp_path: Path) -> None:
    from transformers.dynamic_module_utils import get_imports

    path = tmp_path / "modeling_qwen.py"
    original = (REMOTE_CODE_DIR / "modeling_qwen.py").read_text(encoding="utf-8")
    path.write_text(original, encoding="utf-8")
    assert "transformers_stream_generator" in get_imports(str(path))
    path.write_text(compat.patched(original), encoding="utf-8")
    assert "transformers_stream_generator" not in get_imports(str(path))


def test_a_file_without_qwens_models_is_not_recognised() -> None:
    assert compat.recognise("x = 1\n") == (
        "it defines no QWenPreTrainedModel, QWenLMHeadModel"
    )
    assert "does not parse" in str(compat.recognise("def (\n"))
    original = (REMOTE_CODE_DIR / "modeling_qwen.py").read_text(encoding="utf-8")
    assert compat.recognise(original) is None


# ------------------------------------------------------------------ what each release needs


@pytest.mark.parametrize(
    ("release", "stream_ok", "can_generate", "want"),
    [
        ((4, 32), True, True, ()),
        ((4, 53), True, True, ()),
        ((4, 53), True, False, ("generation-mixin",)),
        # transformers_stream_generator not installed: chat_stream streams without it on
        # every release, not only where the package cannot be imported at all
        ((4, 32), False, True, ("stream",)),
        ((4, 53), False, True, ("stream",)),
        ((4, 54), True, False, ("generation-mixin", "tuple-cache")),
        ((4, 57), False, False, ("generation-mixin", "tuple-cache", "stream")),
        (
            (5, 24),
            False,
            False,
            (
                "generation-mixin", "tuple-cache", "head-mask", "loaded-numbers", "stream",
                "quiet-deprecations",
            ),
        ),
    ],
)
def test_needs_by_release(
    release: tuple[int, int], stream_ok: bool, can_generate: bool, want: tuple[str, ...]
) -> None:
    assert _module().needs(release, stream_ok, can_generate) == want


# ------------------------------------------------------------------ on the running transformers

SCRIPT = r"""
import json, logging, sys, warnings
warnings.simplefilter("ignore")
import torch
logged = []
class Keep(logging.Handler):
    def emit(self, record):
        logged.append(record.getMessage())
logging.getLogger("transformers").addHandler(Keep())
from transformers import AutoModelForCausalLM, AutoTokenizer
from qwen_kvprep.smoke.numbers import loaded_numbers
ckpt = sys.argv[1]
out = {}
tok = AutoTokenizer.from_pretrained(ckpt, trust_remote_code=True)
model = AutoModelForCausalLM.from_pretrained(ckpt, trust_remote_code=True).eval()
out["compat"] = list(getattr(type(model), "_qwen_kvprep_compat", ()) or ())
out["numbers"] = loaded_numbers(model, ckpt)
ids = tok("What is two plus two?", return_tensors="pt").input_ids
with torch.no_grad():
    out["logits"] = model(ids).logits[0, -1].tolist()
out["greedy"] = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:].tolist()
out["beams"] = model.generate(ids, max_new_tokens=4, num_beams=2, do_sample=False)[0].tolist()
response, _ = model.chat(tok, "Hello!", history=None, max_new_tokens=6, do_sample=False)
pieces = list(model.chat_stream(tok, "Hello!", history=None, max_new_tokens=6, do_sample=False))
out["chat"] = response
out["chat_stream"] = pieces
again = AutoModelForCausalLM.from_pretrained(ckpt, trust_remote_code=True).eval()
out["second_load_greedy"] = again.generate(ids, max_new_tokens=8, do_sample=False)[
    0, ids.shape[1]:].tolist()
out["logged"] = list(logged)
# the same deprecated names used by the server's own code (transformers logs each once)
from transformers.utils import logging as hf_logging
res = model(ids)
once = getattr(hf_logging, "warning_once", None)
if once is not None and hasattr(once, "cache_clear"):
    once.cache_clear()
del logged[:]
model.config.use_return_dict
res.past_key_values
out["logged_for_user"] = list(logged)
print(json.dumps(out))
"""


def _deprecated_here(messages: tuple[str, ...]) -> set[str]:
    """Which of these deprecation messages the installed transformers has (5.17 has
    `use_return_dict`'s, 5.24 `past_key_values`' too)."""
    import transformers

    root = Path(transformers.__file__).parent
    text = "".join(
        (root / name).read_text(encoding="utf-8")
        for name in ("configuration_utils.py", "utils/generic.py")
    )
    return {m for m in messages if m in text}


def _run(python: Path, ckpt: Path, tmp: Path) -> dict[str, Any]:
    tmp.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HOME": str(tmp / "hf"), "HF_MODULES_CACHE": str(tmp / "hf" / "m"),
           "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    if python == Path(sys.executable):  # forked where nothing differs (tests/forked.py)
        res = python_code(SCRIPT, str(ckpt), env=env, cwd=tmp, timeout=600)
    else:
        res = subprocess.run([str(python), "-c", SCRIPT, str(ckpt)], env=env,
                             capture_output=True, text=True, timeout=600, cwd=tmp)
    assert res.returncode == 0, res.stderr[-4000:]
    result: dict[str, Any] = json.loads(res.stdout.splitlines()[-1])
    return result


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ckpt = generate_checkpoint(tmp_path_factory.mktemp("compat") / "Tiny-Chat", dtype="fp32")
    with_compat(ckpt)
    return ckpt


@pytest.mark.slow
def test_the_model_loads_its_own_numbers_and_serves(prepared: Path, tmp_path: Path) -> None:
    got = _run(Path(sys.executable), prepared, tmp_path)
    n = got["numbers"]
    assert n["tensors_compared"] == n["tensors_stored"] > 0 and n["tensors_differ"] == 0, n
    assert n["buffers_compared"] > 0 and n["buffers_differ"] == 0, n
    assert tuple(got["compat"]) == _module().needs()
    assert len(got["greedy"]) == 8 and got["second_load_greedy"] == got["greedy"]
    # chat_stream yields the growing answer; its last piece is chat's answer (decoded, as
    # Qwen's chat_stream decodes, without the replacement characters chat shows)
    # (the imitation's own chat_stream, which runs before 4.57, keeps them)
    last = got["chat_stream"][-1] if got["chat_stream"] else None
    assert last is not None and last.replace("\ufffd", "") == got["chat"].replace("\ufffd", "")
    # a server's log: nothing transformers deprecates in Qwen's own code, which its user
    # cannot change; the same names in the server's own code still warn (transformers 5)
    deprecations = _module().QWEN_DEPRECATIONS
    assert not [m for m in got["logged"] if m.startswith(deprecations)], got["logged"]
    if "quiet-deprecations" in got["compat"]:
        user = {d for d in deprecations for m in got["logged_for_user"] if m.startswith(d)}
        assert user == _deprecated_here(deprecations[1:]), got["logged_for_user"]


@pytest.mark.slow
def test_without_the_module_transformers_5_loads_other_numbers(
    prepared: Path, tmp_path: Path
) -> None:
    """What the module prevents, measured: the same folder with its `loaded-numbers`
    change switched off (the module as planted, one line changed)."""
    ckpt = tmp_path / "Tiny-Chat"
    subprocess.run(["cp", "-a", str(prepared), str(ckpt)], check=True)
    module = ckpt / COMPAT_FILE
    text = module.read_text(encoding="utf-8")
    line = '    "loaded-numbers": _loaded_numbers,\n'
    assert line in text
    module.write_text(text.replace(line, '    "loaded-numbers": lambda namespace: False,\n'))
    n = _run(Path(sys.executable), ckpt, tmp_path)["numbers"]
    if transformers_release() < (5, 0):
        # transformers 4 builds the model on the CPU: the checkpoint's numbers all the same
        assert n["tensors_differ"] == n["buffers_differ"] == 0, n
        return
    assert n["tensors_differ"] > 0 or n["buffers_differ"] > 0, n
    assert any("c_proj" in name for name in n["tensors_differ_names"]), n
    assert any("logn_tensor" in name for name in n["buffers_differ_names"]), n


@pytest.mark.slow
def test_one_folder_serves_two_releases_with_the_same_logits(
    prepared: Path, tmp_path: Path
) -> None:
    if not VENV453_PYTHON.exists():
        needs.skip("venv-4.53", f"{VENV453_PYTHON} is not installed (.ci/run makes it)")
    here = _run(Path(sys.executable), prepared, tmp_path / "here")
    there = _run(VENV453_PYTHON, prepared, tmp_path / "there")
    assert here["greedy"] == there["greedy"]
    scale = max(abs(x) for x in there["logits"])
    assert max(abs(a - b) for a, b in zip(here["logits"], there["logits"])) <= 1e-5 * scale


# ------------------------------------------------------------------ doctor


@pytest.mark.parametrize(
    ("release", "prepared", "want"),
    [
        ("4.37.2", False, "info"),
        ("4.53.3", False, "info"),
        ("4.54.1", False, "fail"),
        ("5.24.0", False, "fail"),
        ("5.24.0", True, "ok"),
        ("4.32.0", True, "ok"),
    ],
)
def test_doctor_says_whether_the_code_runs_on_this_transformers(
    tmp_path: Path, release: str, prepared: bool, want: str
) -> None:
    from qwen_kvprep.probe.checkpoint import probe_checkpoint
    from qwen_kvprep.probe.env import package_info
    from tests.checks.facts import env_facts, facts, text, worst

    ckpt = generate_checkpoint(tmp_path / "Tiny-Chat", layers=1)
    if prepared:
        with_compat(ckpt)
    elif want == "info" and not package_info("transformers_stream_generator").found:
        # as shipped, chat_stream's import stops the load where that package cannot be
        # imported (tests/test_stream_generator.py decides it both ways)
        want = "fail"
    f = facts(env_facts(transformers_version=release), checkpoint=probe_checkpoint(ckpt))
    assert worst("checkpoint.compat", f).value == want
    if want == "fail":
        assert f"qwen-kvprep fix {ckpt}" in text("checkpoint.compat", f)


def test_doctor_fails_an_import_of_a_missing_or_changed_module(tmp_path: Path) -> None:
    from qwen_kvprep.probe.checkpoint import probe_checkpoint
    from tests.checks.facts import env_facts, facts, worst

    ckpt = generate_checkpoint(tmp_path / "Tiny-Chat", layers=1)
    with_compat(ckpt)
    (ckpt / COMPAT_FILE).write_text("# changed\n")
    f = facts(env_facts(transformers_version="5.24.0"), checkpoint=probe_checkpoint(ckpt))
    assert worst("checkpoint.compat", f).value == "warn"
    (ckpt / COMPAT_FILE).unlink()
    f = facts(env_facts(transformers_version="4.53.3"), checkpoint=probe_checkpoint(ckpt))
    assert worst("checkpoint.compat", f).value == "fail"


def test_the_numbers_check_reads_only_the_folders_own_shards(tmp_path: Path) -> None:
    from qwen_kvprep.smoke.numbers import INDEX, _shards

    (tmp_path / INDEX).write_text(json.dumps({"weight_map": {
        "a": "model-1.safetensors", "b": "../outside.safetensors", "c": "/abs.safetensors",
        "d": "model-1.safetensors",
    }}))
    assert _shards(tmp_path) == [tmp_path / "model-1.safetensors"]


@pytest.mark.parametrize("final_newline", [True, False])
def test_our_lines_come_out_exactly_and_the_users_lines_stay(final_newline: bool) -> None:
    original = (REMOTE_CODE_DIR / MODELING_FILE).read_text(encoding="utf-8")
    if not final_newline:
        original = original.rstrip("\n")
    both = fastkv.patched(compat.patched(original))
    assert compat.marker_problem(both) is None
    assert compat.without_ours(both) == original
    assert compat.unpatched(compat.patched(original)) == original
    # lines the user adds after our blocks stay on lines of their own
    tail = both + "TAIL = 1\n"
    assert compat.marker_problem(tail) is None
    left = compat.without_ours(tail)
    assert left.endswith("\nTAIL = 1\n") and compat.START_MARK not in left
    compile(left, MODELING_FILE, "exec")
    again = fastkv.patched(compat.patched(left))
    assert fastkv.patched(compat.patched(compat.without_ours(again))) == again


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        ((fastkv.END + "\n", ""), "has no end marker"),
        ((compat.BEGIN, "# edited"), "has no start marker"),
        (("(globals())\n# <<<", "(globals())\nx = 1\n# <<<"), "were edited"),  # inside a block
        (("# <<< qwen-kvprep\n            raise\n", "# <<< qwen-kvprep\n            pass\n"),
         "were edited"),  # the hidden import's `raise`
    ],
)
def test_edited_marker_lines_are_named_with_their_line(edit: tuple[str, str], said: str) -> None:
    original = (REMOTE_CODE_DIR / MODELING_FILE).read_text(encoding="utf-8")
    both = fastkv.patched(compat.patched(original))
    old, new = edit
    where = both.rfind(old)  # the last one: our blocks are at the end
    assert where != -1
    problem = compat.marker_problem(both[:where] + new + both[where + len(old) :])
    assert problem is not None and problem.startswith("line ") and said in problem, problem
