"""Qwen (v1)'s own remote code on each transformers release: its tokenizer, its model as
shipped, and its model after `qwen-kvprep fix`.

    python bench/transformers_releases.py --venv V --qwen-code DIR [--releases 5.0.0 5.1.0 ...]
        [--minors 5] [--work W] [--out results.json]

V is a virtual environment with torch and qwen-kvprep installed (`pip install -e .`); the
script installs each transformers release there in turn (`pip install transformers==X`, so
pip picks the huggingface-hub and tokenizers that release needs) and uninstalls
transformers_stream_generator first (fix's compatibility module makes it unnecessary, and
it cannot be imported on transformers >= 4.57). DIR holds Qwen's own remote code, from a
Qwen (v1) model repo: modeling_qwen.py, configuration_qwen.py, qwen_generation_utils.py,
cpp_kernels.py and tokenization_qwen.py (not part of this repository). `--minors 5` takes
the newest patch release of every 5.x minor release pip knows (`pip index versions`).

For each release, on a tiny random-weight checkpoint (qwen_kvprep.tiny) whose remote code
is replaced by DIR's, each in a child process with its own modules cache:

- tokenizer: Qwen's tokenization_qwen.py loads through `AutoTokenizer` (trust_remote_code)
  and encodes and decodes a text back to itself;
- shipped: Qwen's model code as shipped loads, holds the checkpoint's numbers
  (qwen_kvprep.smoke.numbers), and runs `generate`, `chat` and `chat_stream` (these two with
  the tiny checkpoint's tokenizer: Qwen's own numbers its special tokens past the tiny
  vocabulary);
- fixed: `qwen-kvprep fix --no-smoke` on a copy (the extension is built once for the venv's
  torch, in W's build cache), then the same as `shipped` (the numbers check is smoke's).

Prints a Markdown table and writes every outcome to --out. Not part of the test suite: it
installs packages and takes two to four minutes per release on two busy cores.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

QWEN_FILES = (
    "modeling_qwen.py",
    "configuration_qwen.py",
    "qwen_generation_utils.py",
    "cpp_kernels.py",
)
TOKENIZER_FILE = "tokenization_qwen.py"
QWEN_RANKS = 151643
TEXT = "hello world: a small program, 你好"
CHILD_TIMEOUT_S = 900


# -- inside the measured venv -------------------------------------------------------------


def _last_line(exc: BaseException) -> str:
    """The exception's first line and where it was raised (file name and line)."""
    import traceback

    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return (text[0][:200] if text else type(exc).__name__) + where


def _tokenizer(folder: str) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    ids = tok.encode(TEXT)
    back = tok.decode(ids)
    return {"ok": back == TEXT, "detail": f"{len(ids)} ids" if back == TEXT else repr(back)}


def _model(folder: str) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qwen_kvprep.smoke.numbers import loaded_numbers

    out: dict[str, Any] = {}
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    numbers = loaded_numbers(model, folder)
    out["numbers"] = {
        "ok": numbers["tensors_differ"] == 0 and numbers["buffers_differ"] == 0,
        "detail": f"{numbers['tensors_differ']} tensors, "
        f"{numbers['buffers_differ']} buffers differ",
    }
    short = {"max_new_tokens": 4, "do_sample": False}
    # generate from token ids, so that the model is judged apart from the tokenizer, which
    # chat and chat_stream need (the tiny checkpoint's own: see the module's docstring)
    prompt = torch.tensor([[5, 17, 99, 3, 42, 7]])
    try:
        tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
        tok.encode(TEXT)
        tok_error = None
    except Exception as exc:
        tok_error = "the tokenizer fails: " + _last_line(exc)

    def with_tokenizer(run: Any) -> Any:
        if tok_error is not None:
            raise RuntimeError(tok_error)
        return run()

    steps = {
        "generate": lambda: model.generate(prompt, **short).shape[1],
        "chat": lambda: with_tokenizer(lambda: model.chat(tok, "hello", history=None, **short)[0]),
        "chat_stream": lambda: with_tokenizer(
            lambda: list(model.chat_stream(tok, "hello", history=None, **short))[-1:]
        ),
    }
    for name, run in steps.items():
        try:
            out[name] = {"ok": True, "detail": str(run())[:60]}
        except Exception as exc:
            out[name] = {"ok": False, "detail": _last_line(exc)}
    return out


def child(step: str, folder: str) -> None:
    """Run one step in this interpreter and print its outcome as one JSON line."""
    import importlib.util
    import warnings

    warnings.simplefilter("ignore")
    assert importlib.util.find_spec("transformers_stream_generator") is None
    try:
        result = _tokenizer(folder) if step == "tokenizer" else _model(folder)
    except Exception as exc:
        result = {"ok": False, "detail": _last_line(exc)}
    print("RESULT " + json.dumps(result), flush=True)


# -- the driver -----------------------------------------------------------------------------


def _run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False
    )


def _results(proc: subprocess.CompletedProcess[str], count: int = 2) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = [
        json.loads(line[len("RESULT "):])
        for line in proc.stdout.splitlines()
        if line.startswith("RESULT ")
    ]
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    lost = {"ok": False, "detail": f"exit {proc.returncode}: {tail[0][:200]}"}
    return found + [lost] * (count - len(found))


def _result(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    return _results(proc, 1)[0]


def newest_patches(python: str, major: int) -> list[str]:
    proc = _run([python, "-m", "pip", "index", "versions", "transformers"], dict(os.environ))
    match = re.search(r"Available versions: (.*)", proc.stdout)
    if match is None:
        raise SystemExit(f"pip index versions transformers printed no versions: {proc.stderr}")
    best: dict[tuple[int, int], tuple[int, ...]] = {}
    for text in match.group(1).split(", "):
        if not re.fullmatch(r"\d+\.\d+\.\d+", text.strip()):
            continue  # pre-releases
        version = tuple(int(p) for p in text.strip().split("."))
        if version[0] == major and version > best.get(version[:2], (-1,)):
            best[version[:2]] = version
    return [".".join(map(str, v)) for _, v in sorted(best.items())]


def _full_vocabulary(path: Path) -> None:
    """Pad qwen.tiktoken to Qwen's 151,643 ranks: Qwen's tokenizer asserts that its special
    tokens follow them. The fillers start with bytes no UTF-8 text holds, so no text
    encodes to them."""
    lines = path.read_text(encoding="ascii").splitlines()
    ranks = len(lines)
    with path.open("a", encoding="ascii") as out:
        for rank in range(ranks, QWEN_RANKS):
            token = b"\xf8\xf9" + rank.to_bytes(3, "big")
            out.write(f"{base64.b64encode(token).decode()} {rank}\n")


def _checkpoint(work: Path, python: str, code: Path, tokenizer: bool) -> Path:
    """A tiny checkpoint (made once per work folder) with Qwen's code copied over."""
    base = work / "tiny"
    if not base.exists():
        subprocess.run([python, "-m", "qwen_kvprep.tiny", str(base)], check=True)
    dest = Path(tempfile.mkdtemp(prefix="qwen_", dir=work))
    shutil.rmtree(dest)
    shutil.copytree(base, dest)
    for name in QWEN_FILES + ((TOKENIZER_FILE,) if tokenizer else ()):
        shutil.copyfile(code / name, dest / name)
    if tokenizer:
        _full_vocabulary(dest / "qwen.tiktoken")
    return dest


def measure(release: str, python: str, code: Path, work: Path) -> dict[str, Any]:
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    installed = _run([*pip, f"transformers=={release}"], dict(os.environ))
    if installed.returncode != 0:
        return {"release": release, "install": installed.stderr.strip()[-300:]}
    _run([python, "-m", "pip", "uninstall", "-y", "-q", "transformers_stream_generator"],
         dict(os.environ))
    hub = _run([python, "-c", "import huggingface_hub, tokenizers; "
                "print(huggingface_hub.__version__, tokenizers.__version__)"], dict(os.environ))
    out: dict[str, Any] = {"release": release, "hub_tokenizers": hub.stdout.strip()}
    script = str(Path(__file__).resolve())

    def env() -> dict[str, str]:
        modules = tempfile.mkdtemp(prefix="modules_", dir=work)
        return dict(os.environ, HF_MODULES_CACHE=modules, HF_HUB_OFFLINE="1",
                    QWEN_KVPREP_CACHE=str(work / "buildcache"))

    tok = _checkpoint(work, python, code, tokenizer=True)
    shipped = _checkpoint(work, python, code, tokenizer=False)
    # one interpreter for both (two folders, two module names): interpreters cost most here
    both = _run([python, script, "--child", "tokenizer", str(tok),
                 "--child", "model", str(shipped)], env())
    results = _results(both)
    out["tokenizer"], out["shipped"] = results[0], results[1]
    fixed = _checkpoint(work, python, code, tokenizer=False)
    fix_env = env()
    # the smoke is left out: the next child loads the fixed folder and checks its numbers
    fix = _run([python, "-m", "qwen_kvprep", "fix", str(fixed), "--no-smoke", "--json"],
               fix_env)
    try:
        report = json.loads(fix.stdout)
        bad = [f"{f['id']}: {f['message']}" for f in report.get("findings", [])
               if f.get("severity") == "fail"]
        error = (report.get("error") or {}).get("message")
        out["fix"] = {"ok": fix.returncode == 0,
                      "detail": "; ".join(bad or [str(error or "")])[:300]}
    except ValueError:
        tail = (fix.stderr or fix.stdout).strip().splitlines()[-1:] or ["no output"]
        out["fix"] = {"ok": False, "detail": f"exit {fix.returncode}: {tail[0][:200]}"}
    out["fixed"] = _result(_run([python, script, "--child", "model", str(fixed)], fix_env))
    for folder in (tok, shipped, fixed):
        shutil.rmtree(folder, ignore_errors=True)
    return out


def _cell(outcome: Optional[dict[str, Any]]) -> str:
    if not outcome:
        return "—"
    if "ok" in outcome and len(outcome) <= 3:
        return "works" if outcome["ok"] else f"fails: `{outcome['detail']}`"
    parts = []
    for name in ("numbers", "generate", "chat", "chat_stream"):
        step = outcome.get(name)
        if step is None:
            return f"fails: `{outcome.get('detail')}`"
        parts.append(f"{name} {'ok' if step['ok'] else 'fails: `' + step['detail'] + '`'}")
    if all(outcome[n]["ok"] for n in ("numbers", "generate", "chat", "chat_stream")):
        return "works"
    return "; ".join(parts)


def table(results: list[dict[str, Any]]) -> str:
    rows = [
        "| transformers | huggingface-hub, tokenizers | Qwen's tokenizer | model as shipped "
        "| `fix` | model after fix |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        rows.append(
            f"| {r['release']} | {r.get('hub_tokenizers', r.get('install', ''))} "
            f"| {_cell(r.get('tokenizer'))} | {_cell(r.get('shipped'))} "
            f"| {_cell(r.get('fix'))} | {_cell(r.get('fixed'))} |"
        )
    return "\n".join(rows)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", nargs=2, action="append", metavar=("STEP", "FOLDER"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--venv", type=Path)
    parser.add_argument("--qwen-code", type=Path)
    parser.add_argument("--releases", nargs="*", default=[])
    parser.add_argument("--minors", type=int, help="every minor release of this major")
    parser.add_argument("--work", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.child:
        for step, folder in args.child:
            child(step, folder)
        return 0
    if args.venv is None or args.qwen_code is None:
        parser.error("--venv and --qwen-code are required")
    python = str(args.venv / "bin" / "python")
    missing = [n for n in (*QWEN_FILES, TOKENIZER_FILE) if not (args.qwen_code / n).is_file()]
    if missing:
        parser.error(f"{args.qwen_code} lacks {', '.join(missing)}")
    releases = list(args.releases)
    if args.minors is not None:
        releases += newest_patches(python, args.minors)
    work = args.work or Path(tempfile.mkdtemp(prefix="tf_releases_"))
    work.mkdir(parents=True, exist_ok=True)
    results = []
    for release in releases:
        result = measure(release, python, args.qwen_code.resolve(), work)
        results.append(result)
        print(json.dumps(result), flush=True)
        if args.out:
            args.out.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
