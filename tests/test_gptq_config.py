"""A GPTQ checkpoint's quantization config (gptqconfig.py, checkpoint.gptq): one grammar for
doctor, fix and plan, the two copies agreeing, and the config fitting the packed weights
as the safetensors headers show them. Nothing here loads a model or needs a GPTQ backend.

Also the bounded reading of the JSON configs (too large is said so, not "invalid JSON")
and a modeling_qwen.py that starts with a UTF-8 BOM.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest

from qwen_kvprep import gptqconfig
from qwen_kvprep.common import MODELING_FILE
from qwen_kvprep.errors import ConfigError
from qwen_kvprep.planning.model import read_model
from qwen_kvprep.probe.checkpoint import probe_checkpoint
from qwen_kvprep.tiny import generate_checkpoint
from tests.cli import invoke
from tests.test_checkpoint_validation import assert_case, by_id, run_cli

QUANTIZE = "quantize_config.json"
# just over the 16 MiB a text file is read up to: what was once judged by its first part
HUGE = (16 << 20) + 4096


@pytest.fixture(scope="session")
def gptq_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_checkpoint(
        tmp_path_factory.mktemp("gptq") / "Qwen-tiny-Int4", gptq=True, shards=2
    )


@pytest.fixture()
def work(tmp_path: Path, isolated_hf: Path) -> Path:
    w = tmp_path / "work"
    w.mkdir()
    return w


@pytest.fixture()
def int4(gptq_template: Path, work: Path) -> Path:
    dest = work / "Qwen-tiny-Int4"
    shutil.copytree(gptq_template, dest, symlinks=True)
    return dest


def _edit(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    change(data)
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def _in_config(d: Path, **fields: Any) -> None:
    _edit(d / "config.json", lambda c: c["quantization_config"].update(fields))


def _in_file(d: Path, **fields: Any) -> None:
    _edit(d / QUANTIZE, lambda c: c.update(fields))


def _drop_from_config(d: Path) -> None:
    _edit(d / "config.json", lambda c: c.pop("quantization_config"))


def _gptq_fails(d: Path, work: Path) -> list[str]:
    """checkpoint.gptq's failures; doctor fails and fix refuses before its first write."""
    found = assert_case(d, work, "checkpoint.gptq", "fail")
    code, _ = run_cli(["doctor", str(d), "--json"])
    assert code == 1
    return [f["message"] for f in found if f["severity"] == "fail"]


# -- packed weights need a config transformers reads ----------------------------------------


def test_packed_weights_without_any_quantization_config_fail(int4: Path, work: Path) -> None:
    (int4 / QUANTIZE).unlink()
    _drop_from_config(int4)
    [message] = _gptq_fails(int4, work)
    assert "no quantization_config and there is no quantize_config.json" in message
    assert "newly initialized (random) weights" in message
    assert "transformer.h.0.attn.c_attn.qweight" in message
    assert "packed at bits 4, group_size 128" in message  # read from the shapes


def test_quantize_config_alone_is_not_enough_and_the_advice_works(
    int4: Path, work: Path
) -> None:
    _drop_from_config(int4)
    [message] = _gptq_fails(int4, work)
    assert "transformers never reads that file" in message
    _, doc = run_cli(["doctor", str(int4), "--json"])
    fix = by_id(doc, "checkpoint.gptq")[0]["fix"]
    entry = fix.split('"quantization_config": ', 1)[1].rstrip("`")
    _edit(int4 / "config.json", lambda c: c.update(quantization_config=json.loads(entry)))
    _, doc = run_cli(["doctor", str(int4), "--json"])
    [healthy] = by_id(doc, "checkpoint.gptq")
    assert healthy["severity"] == "info", healthy
    assert "its 10 packed linears fit it" in healthy["message"]


def test_a_gptq_config_over_unpacked_weights_fails(work: Path) -> None:
    d = generate_checkpoint(work / "Qwen-tiny", dtype="fp16")
    _edit(d / "config.json", lambda c: c.update(
        quantization_config={"bits": 4, "group_size": 128, "quant_method": "gptq"}
    ))
    [message] = _gptq_fails(d, work)
    assert "no safetensors shard holds a packed qweight" in message


# -- one grammar -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("where", "field", "value", "said"),
    [
        (QUANTIZE, "bits", "4", 'bits "4" (a string)'),
        ("config.json", "bits", True, "bits true (a boolean)"),
        ("config.json", "bits", 4.0, "bits 4.0 (a number)"),
        ("config.json", "group_size", -5, "group_size -5 (an integer)"),
        (QUANTIZE, "desc_act", "false", 'desc_act "false" (a string)'),
        ("config.json", "sym", 1, "sym 1 (an integer)"),
        ("config.json", "damp_percent", 1.5, "damp_percent 1.5"),
        ("config.json", "checkpoint_format", "marlin2", 'checkpoint_format "marlin2"'),
    ],
)
def test_every_gptq_field_is_judged_by_doctor_and_fix(
    int4: Path, work: Path, where: str, field: str, value: Any, said: str
) -> None:
    (_in_file if where == QUANTIZE else _in_config)(int4, **{field: value})
    messages = _gptq_fails(int4, work)
    source = QUANTIZE if where == QUANTIZE else gptqconfig.IN_CONFIG
    assert any(f"{source} gives {said}" in m for m in messages), messages


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        (lambda d: _in_config(d, desc_act="false"), 'desc_act "false"'),
        (lambda d: _in_config(d, bits="4"), 'bits "4"'),
        (lambda d: (_drop_from_config(d), _in_file(d, group_size=-5)), "group_size -5"),
    ],
)
def test_plan_refuses_what_doctor_refuses_in_the_same_words(
    int4: Path, work: Path, edit: Callable[[Path], object], said: str
) -> None:
    edit(int4)
    with pytest.raises(ConfigError) as refused:
        read_model(int4)
    assert said in refused.value.message
    _, doc = run_cli(["doctor", str(int4), "--json"])
    assert any(
        refused.value.message in f["message"] for f in by_id(doc, "checkpoint.gptq")
    ), (refused.value.message, by_id(doc, "checkpoint.gptq"))


def test_bits_that_disagree_between_the_two_configs_fail(int4: Path, work: Path) -> None:
    _in_file(int4, bits=8)
    messages = _gptq_fails(int4, work)
    disagree = [m for m in messages if "disagree" in m]
    assert disagree, messages
    assert "says bits 4" in disagree[0] and "says bits 8" in disagree[0]


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"bits": 8}, "256 inputs (its g_idx) at 8 bits pack into 64 rows, not 32"),
        ({"group_size": 64}, "256 inputs in groups of 64 and 768 outputs make [4, 768]"),
        ({"group_size": -1}, "in one group (group_size -1)"),
    ],
)
def test_a_config_that_does_not_fit_the_packed_shapes_fails(
    int4: Path, work: Path, fields: dict[str, Any], said: str
) -> None:
    _in_config(int4, **fields)
    _in_file(int4, **fields)
    messages = _gptq_fails(int4, work)
    assert any("does not fit the packed weights of 10 of 10" in m and said in m for m in messages)
    assert any("packed at bits 4, group_size 128" in m for m in messages)


def _duplicated(d: Path, key: str, first: str, last: str) -> None:
    text = (d / QUANTIZE).read_text(encoding="utf-8")
    head, rest = text.split("{", 1)
    (d / QUANTIZE).write_text(
        f'{head}{{\n  "{key}": {first},\n  "{key}": {last},{rest}', encoding="utf-8"
    )


def test_a_duplicate_key_is_a_warning_and_a_changed_field_a_failure(
    int4: Path, work: Path
) -> None:
    _edit(int4 / QUANTIZE, lambda c: c.pop("damp_percent"))
    _duplicated(int4, "damp_percent", "0.01", "0.01")
    found = assert_case(int4, work, "checkpoint.gptq", "warn")
    assert "gives damp_percent twice" in found[0]["message"]
    assert found[0]["details"]["key"] == "damp_percent"
    _edit(int4 / QUANTIZE, lambda c: c.pop("bits"))
    _duplicated(int4, "bits", "8", "4")
    messages = _gptq_fails(int4, work)
    assert any("gives bits twice, 8 and then 4" in m for m in messages), messages


# -- bounded reading --------------------------------------------------------------------------


def test_a_huge_quantize_config_is_too_large_not_invalid(int4: Path, work: Path) -> None:
    text = (int4 / QUANTIZE).read_text(encoding="utf-8")
    (int4 / QUANTIZE).write_text(text + " " * HUGE, encoding="utf-8")  # still valid JSON
    found = assert_case(int4, work, "checkpoint.content", "fail")
    message = found[0]["message"]
    assert f"too large to be a quantization config ({len(text) + HUGE:,} bytes, limit " in message
    assert "JSON" not in message
    with pytest.raises(ConfigError, match="too large to be a quantization config"):
        _drop_from_config(int4)
        read_model(int4)


def test_a_huge_config_json_is_too_large_not_unreadable(int4: Path, work: Path) -> None:
    text = (int4 / "config.json").read_text(encoding="utf-8")
    (int4 / "config.json").write_text(text + " " * HUGE, encoding="utf-8")
    found = assert_case(int4, work, "config.parse", "fail")
    assert f"is too large to be a model config ({len(text) + HUGE:,} bytes, limit " in (
        found[0]["message"]
    )


# -- a BOM at the start of the model's code ---------------------------------------------------


def test_model_code_with_a_bom_is_python_and_revert_restores_it(
    work: Path, monkeypatch: pytest.MonkeyPatch, isolated_hf: Path
) -> None:
    from transformers import dynamic_module_utils as dmu

    monkeypatch.setattr(dmu, "HF_MODULES_CACHE", str(isolated_hf / "modules"))
    d = generate_checkpoint(work / "Qwen", dtype="fp32")
    code = d / MODELING_FILE
    original = b"\xef\xbb\xbf" + code.read_bytes()
    code.write_bytes(original)
    assert probe_checkpoint(d).fast_path_problem is None
    done = invoke("fix", str(d), "--no-build", "--no-smoke", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads(done.stdout)
    assert doc["fast_path"] is True and doc["compat"] is True
    assert not any("does not parse" in f["message"] for f in doc["findings"])
    # transformers' import check (ast, from 4.53) cannot take the BOM: fix leaves it out
    assert [f["severity"] for f in doc["findings"] if f["id"] == "compat.bom"] == ["info"]
    assert code.read_bytes()[:3] != b"\xef\xbb\xbf"
    assert code.read_bytes().startswith(original[3:200])
    done = invoke("revert", str(d))
    assert done.returncode == 0, done.stdout + done.stderr
    assert code.read_bytes() == original
