"""The transformers line convert prints, run as printed: on a chat model and on a base
model (no chat template), on the running transformers and on transformers 4.37.2 (the
oldest release that serves convert's output; .venv437, which .ci/run makes)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from qwen_kvprep.convert.run import ConvertOptions, convert
from qwen_kvprep.convert.serving import TRANSFORMERS, commands
from qwen_kvprep.tiny import generate_checkpoint
from tests import needs
from tests.remote_code import transformers_release

REPO = Path(__file__).resolve().parent.parent
VENV437_PYTHON = REPO / ".venv437" / "bin" / "python"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A converted chat model and a converted base model (DIR without
    generation_config.json: no chat template)."""
    root = tmp_path_factory.mktemp("serving")
    chat_src = generate_checkpoint(root / "chat", dtype="fp32", shards=1)
    base_src = generate_checkpoint(root / "base", dtype="fp32", shards=1)
    (base_src / "generation_config.json").unlink()
    out = {}
    for name, src in (("chat", chat_src), ("base", base_src)):
        out[name] = convert(src, root / f"{name}-out", ConvertOptions(verify=False)).out
    config = json.loads((out["base"] / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert "chat_template" not in config
    return out


def _run_printed(python: str, folder: Path) -> subprocess.CompletedProcess[str]:
    line = dict(commands(folder, gptq=False, max_len=64))[TRANSFORMERS]
    argv = shlex.split(line)
    assert argv[0] == "python"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([python, *argv[1:]], capture_output=True, text=True, env=env,
                          timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["base", "chat"])
def test_the_printed_transformers_line_runs(folders: dict[str, Path], model: str) -> None:
    if transformers_release() < (4, 37):
        needs.skip("transformers-4.37", "this transformers has no Qwen2ForCausalLM")
    done = _run_printed(sys.executable, folders[model])
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["base", "chat"])
def test_the_printed_transformers_line_runs_on_transformers_4_37(
    folders: dict[str, Path], model: str
) -> None:
    if not VENV437_PYTHON.exists():
        needs.skip("venv-4.37", f"{VENV437_PYTHON} is not installed (.ci/run makes it)")
    done = _run_printed(str(VENV437_PYTHON), folders[model])
    assert done.returncode == 0, done.stderr[-3000:]
