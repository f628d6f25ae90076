"""The modules-cache folder a transformers 5 load runs the code from is named after
transformers' own hash of the code, whose function changed its arguments between releases:
(folder, module file, resolved file, relative imports) on 5.8 and 5.9, (folder, resolved
file) from 5.10 on. fix crashed on 5.8 and 5.9 (a TypeError: "this is a bug") before it
called each as its release defines it."""

from __future__ import annotations

import hashlib
import types
from pathlib import Path

from qwen_kvprep.probe.codefolders import code_hash


def _digest(folder: str, names: list[str]) -> str:
    h = hashlib.sha256()
    for name in sorted(names):
        h.update((Path(folder) / name).read_bytes())
    return h.hexdigest()[:16]


def _release_5_9() -> types.ModuleType:
    dmu = types.ModuleType("dynamic_module_utils")

    def get_relative_imports(module_file: str) -> list[str]:
        return ["configuration_qwen"] if "configuration" in Path(module_file).read_text() else []

    def _compute_local_source_files_hash(
        pretrained_model_name_or_path: str,
        module_file: str,
        resolved_module_file: str,
        modules_needed: list[str],
    ) -> str:
        assert module_file == "modeling_qwen.py"
        assert Path(resolved_module_file).parent == Path(pretrained_model_name_or_path)
        return _digest(
            pretrained_model_name_or_path,
            [module_file, *(f"{m}.py" for m in modules_needed)],
        )

    dmu.get_relative_imports = get_relative_imports  # type: ignore[attr-defined]
    dmu._compute_local_source_files_hash = _compute_local_source_files_hash  # type: ignore[attr-defined]
    return dmu


def _release_5_10() -> types.ModuleType:
    dmu = types.ModuleType("dynamic_module_utils")

    def _compute_local_source_files_hash(
        pretrained_model_name_or_path: str, resolved_module_file: str
    ) -> str:
        return _digest(pretrained_model_name_or_path, [Path(resolved_module_file).name])

    dmu._compute_local_source_files_hash = _compute_local_source_files_hash  # type: ignore[attr-defined]
    return dmu


def test_the_hash_is_asked_for_as_each_release_defines_it(tmp_path: Path) -> None:
    (tmp_path / "modeling_qwen.py").write_text("from .configuration_qwen import QWenConfig\n")
    (tmp_path / "configuration_qwen.py").write_text("class QWenConfig: pass\n")
    old = code_hash(_release_5_9(), tmp_path)
    assert old == _digest(str(tmp_path), ["modeling_qwen.py", "configuration_qwen.py"])
    new = code_hash(_release_5_10(), tmp_path)
    assert new == _digest(str(tmp_path), ["modeling_qwen.py"])
    # the code as it will be once fix has written it: the hash follows the planned bytes
    planned = {"modeling_qwen.py": b"from .configuration_qwen import QWenConfig\n# fixed\n"}
    assert code_hash(_release_5_9(), tmp_path, planned) != old
