"""A runtime image without nvcc (or a GPU other than the default list) reuses a cached CUDA
build that loads with this torch and covers the visible GPUs, instead of compiling."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from qwen_kvprep.buildcache.builder import find_compatible
from qwen_kvprep.buildcache.paths import CacheLayout
from qwen_kvprep.steps import build as build_step

RUNTIME = {
    "sources": {"cache_autogptq_cuda_256.cpp": "aa", "cache_autogptq_cuda_kernel_256.cu": "bb"},
    "torch": "2.11.0+cu130",
    "torch_cuda": "13.0",
    "cxx11_abi": True,
    "python_tag": "cp311",
    "machine": "x86_64",
    "tool_version": "0.1.0",
}


def publish(layout: CacheLayout, key: str, cuda: bool, arch_list: list[str], **over: Any) -> Path:
    folder = layout.builds / key
    folder.mkdir(parents=True)
    so = folder / "cache_autogptq_cuda_256.so"
    so.write_bytes(b"\x7fELF fake " + key.encode())
    inputs = {**RUNTIME, "arch_list": arch_list, "nvcc": "13.0" if cuda else None,
              "flags": {}, **over}
    manifest = {"manifest_version": 1, "key": key, "inputs": inputs, "cuda": cuda,
                "so": so.name, "so_sha256": hashlib.sha256(so.read_bytes()).hexdigest(),
                "created": key}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def plan(cuda: bool, origin: Any = None, key: str = "wanted") -> Any:
    return SimpleNamespace(key=key, cuda=cuda, arch_origin=origin, inputs=dict(RUNTIME),
                           torch=SimpleNamespace(cuda="13.0"))


def test_finds_a_cuda_build_covering_the_gpus(tmp_path: Path) -> None:
    layout = CacheLayout(tmp_path)
    publish(layout, "k-cpu", cuda=False, arch_list=[])
    publish(layout, "k-other-torch", cuda=True, arch_list=["9.0"], torch="2.10.0+cu130")
    publish(layout, "k-80", cuda=True, arch_list=["8.0"])
    publish(layout, "k-8090", cuda=True, arch_list=["8.0", "9.0"])
    found = find_compatible(layout, plan(cuda=False), gpus=((9, 0),))
    assert found is not None and found.key == "k-8090"
    assert find_compatible(layout, plan(cuda=False), gpus=((12, 0),)) is None


def test_a_tampered_build_is_not_reused(tmp_path: Path) -> None:
    layout = CacheLayout(tmp_path)
    folder = publish(layout, "k", cuda=True, arch_list=["9.0"])
    (folder / "cache_autogptq_cuda_256.so").write_bytes(b"changed")
    assert find_compatible(layout, plan(cuda=False), gpus=((9, 0),)) is None


@pytest.mark.parametrize(
    ("cuda", "origin", "arch_option", "reused"),
    [
        (False, None, None, True),  # no nvcc: use the image's CUDA build
        (True, "the visible GPU(s)", None, True),  # the build covers the GPU already
        (True, "default: covers every architecture", None, False),  # portable build wanted
        (False, None, "8.0", False),  # asked by name: build exactly that
    ],
)
def test_when_a_compatible_build_replaces_the_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cuda: bool, origin: Any,
    arch_option: Any, reused: bool,
) -> None:
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr("qwen_kvprep.buildcache.arch.visible_gpu_archs", lambda: ("9.0",))
    layout = CacheLayout(tmp_path)
    publish(layout, "k-8090", cuda=True, arch_list=["8.0", "9.0"])
    got = build_step._reuse_compatible(layout, plan(cuda, origin), arch_option)
    assert (got is not None) is reused
