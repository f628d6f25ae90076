"""The package's layering, read from its import statements.

Layers point one way: base → probe → checks → engines → orchestrators → render → commands →
cli. A module may import modules of its own layer or below, never above, and no two modules
may import each other (directly or through others; `from PKG import name` imports PKG's
`__init__` too). A package's modules share its layer, but for the few SPLITS below.
prestart's quick start imports only the standard library and the stdlib-only base modules.
docs/architecture.md says what each layer is for.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "qwen_kvprep"
EXCLUDED = ("tiny/remote/",)  # the remote code a tiny checkpoint carries: not ours to import

BASE, PROBE, CHECKS, ENGINES, ORCHESTRATORS, RENDER, COMMANDS, CLI = range(8)
LAYER_NAMES = (
    "base", "probe", "checks", "engines", "orchestrators", "render", "commands", "cli"
)

# Longest prefix wins. Every module of the package must be covered.
LAYERS: dict[str, int] = {
    "qwen_kvprep": BASE,  # the package's __init__ (its version)
    "qwen_kvprep.common": BASE,
    "qwen_kvprep.errors": BASE,
    "qwen_kvprep.findings": BASE,
    "qwen_kvprep.jsontypes": BASE,
    "qwen_kvprep.hubcli": BASE,
    "qwen_kvprep.hubcache": BASE,
    "qwen_kvprep.untrusted": BASE,
    "qwen_kvprep.fsutil": BASE,
    "qwen_kvprep.redact": BASE,
    "qwen_kvprep.resources": BASE,
    "qwen_kvprep.configjson": BASE,
    "qwen_kvprep.gptqconfig": BASE,  # the GPTQ config's grammar (probe, checks and plan)
    "qwen_kvprep.catalogue": BASE,
    "qwen_kvprep.state.reader": BASE,
    "qwen_kvprep.journal.reader": BASE,
    "qwen_kvprep.fastkv": BASE,  # which model code the fast path applies to (pure text work)
    "qwen_kvprep.chart": BASE,
    "qwen_kvprep.provenance": BASE,  # provenance.json: convert writes it, doctor's probe reads it
    "qwen_kvprep.kvjudge": BASE,  # a KV cache judged by KL and top-1 (pure numbers)
    "qwen_kvprep.probe": PROBE,
    "qwen_kvprep.checks": CHECKS,
    "qwen_kvprep.buildcache.arch": CHECKS,  # pure decisions over probed toolchain facts
    # engines: each does one kind of work (build, journal, smoke, profile, plan...)
    "qwen_kvprep.buildcache": ENGINES,
    "qwen_kvprep.journal": ENGINES,  # its reader is base (above)
    "qwen_kvprep.state": ENGINES,  # its reader is base (above)
    "qwen_kvprep.view": ENGINES,
    "qwen_kvprep.modcache": ENGINES,
    "qwen_kvprep.dirlock": ENGINES,
    "qwen_kvprep.quickstart": ENGINES,
    "qwen_kvprep.smoke": ENGINES,
    "qwen_kvprep.profile": ENGINES,
    "qwen_kvprep.planning": ENGINES,
    "qwen_kvprep.childproc": ENGINES,
    "qwen_kvprep.runtime": ENGINES,
    "qwen_kvprep.tiny": ENGINES,
    "qwen_kvprep.templating": ENGINES,
    "qwen_kvprep.convert": ENGINES,  # convert's parts: mapping, weights, output, the proof
    "qwen_kvprep.engines": ENGINES,  # serving engines on a converted folder (smoke --engine)
    "qwen_kvprep.kvcal": ENGINES,  # fp8 KV scales: calibration over OUT, the CPU reference
    # orchestrators: run engines in order for one command (fix's steps, demo, doctor)
    "qwen_kvprep.steps": ORCHESTRATORS,
    "qwen_kvprep.convert.run": ORCHESTRATORS,  # convert's steps in order (validate first)
    "qwen_kvprep.demo": ORCHESTRATORS,
    "qwen_kvprep.doctor": ORCHESTRATORS,
    "qwen_kvprep.render": RENDER,
    "qwen_kvprep.commands": COMMANDS,
    "qwen_kvprep.cli": CLI,
    "qwen_kvprep.entry": CLI,
    "qwen_kvprep.__main__": CLI,
}

def modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).as_posix()
        if any(part in rel for part in EXCLUDED):
            continue
        name = rel[:-3].replace("/", ".")
        out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


def _resolve(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if not is_pkg:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, known: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """(imported qwen_kvprep module, line) for every import statement, at any depth (an
    import inside a function still ties the two modules together).

    `from PKG import name` imports the package PKG (its `__init__` runs first, and the name
    is looked up in it) even where `name` is a submodule: it ties the module to PKG too, so
    a package whose `__init__` imports a module that imports the package back is a loop."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "qwen_kvprep":
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, is_pkg, node)
            if target.split(".")[0] != "qwen_kvprep":
                continue
            names_package = target in known and known[target].name == "__init__.py"
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in known:
                    yield sub, node.lineno
                if sub not in known or names_package:
                    yield target, node.lineno


def layer_of(module: str) -> int:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[best]


def graph() -> dict[str, set[str]]:
    known = modules()
    return {
        m: {t for t, _ in imports_of(m, p, known) if t != m and t in known}
        for m, p in known.items()
    }


def cycles(g: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    counter = 0
    for root in sorted(g):
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(g[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = set()
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        comp.add(top)
                        if top == node:
                            break
                    if len(comp) > 1:
                        found.append(comp)
    return found


# Modules in another layer than their package's (its `__init__`'s): the drawing in
# docs/architecture.md shows each apart from its package. Anything else a package holds sits
# in the package's layer, so a module that lower layers read (a format, a reader) lives in
# its own layer's place, not inside the package of what writes it.
SPLITS = {
    "qwen_kvprep.state.reader": BASE,  # the state's reader (prestart's quick start reads it)
    "qwen_kvprep.journal.reader": BASE,  # the journal's reader (revert's plan, doctor)
    "qwen_kvprep.buildcache.arch": CHECKS,  # which architectures to build for (pure)
    "qwen_kvprep.convert.run": ORCHESTRATORS,  # convert's steps in order, as steps/ runs fix's
}


def package_of(module: str, known: dict[str, Path]) -> str:
    """The package a module is in (the package itself for its `__init__`)."""
    if known[module].name == "__init__.py":
        return module
    return module.rsplit(".", 1)[0]


def test_a_package_keeps_to_its_layer() -> None:
    known = modules()
    apart = {
        name: layer_of(name)
        for name in known
        if package_of(name, known) != "qwen_kvprep"  # the root holds every layer's modules
        and layer_of(name) != layer_of(package_of(name, known))
    }
    assert apart == SPLITS, {
        name: f"{LAYER_NAMES[layer]} in {LAYER_NAMES[layer_of(package_of(name, known))]}"
        for name, layer in apart.items()
    }


def test_every_module_has_a_layer() -> None:
    for name in modules():
        assert any(name == p or name.startswith(p + ".") for p in LAYERS), name


def test_no_module_imports_a_higher_layer() -> None:
    g = graph()
    upward = sorted(
        (m, t) for m, targets in g.items() for t in targets if layer_of(t) > layer_of(m)
    )
    assert not upward, "\n".join(
        f"{m} ({LAYER_NAMES[layer_of(m)]}) imports {t} ({LAYER_NAMES[layer_of(t)]})"
        for m, t in upward
    )


def test_no_import_cycles() -> None:
    found = cycles(graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(sorted(c)) for c in found)


def test_a_package_import_loop_is_a_cycle(tmp_path: Path) -> None:
    """`from pkg import sibling` in a module that pkg/__init__ imports is a loop, whether
    the name is a submodule or not, spelt absolutely or relatively."""
    pkg = tmp_path / "qwen_kvprep" / "pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from qwen_kvprep.pkg.a import f\n")
    (pkg / "a.py").write_text("from qwen_kvprep.pkg import b\n")
    (pkg / "b.py").write_text("from . import c\n")
    (pkg / "c.py").write_text("from qwen_kvprep.pkg.b import x\n")
    known = {
        "qwen_kvprep.pkg": pkg / "__init__.py",
        **{f"qwen_kvprep.pkg.{n}": pkg / f"{n}.py" for n in "abc"},
    }
    edges = {m: {t for t, _ in imports_of(m, p, known) if t != m} for m, p in known.items()}
    assert edges["qwen_kvprep.pkg.a"] == {"qwen_kvprep.pkg", "qwen_kvprep.pkg.b"}
    assert edges["qwen_kvprep.pkg.b"] == {"qwen_kvprep.pkg", "qwen_kvprep.pkg.c"}
    assert edges["qwen_kvprep.pkg.c"] == {"qwen_kvprep.pkg.b"}  # names the submodule only
    assert cycles(edges) == [set(known)]


def test_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_upward_import_is_caught() -> None:
    assert layer_of("qwen_kvprep.checks.env") > layer_of("qwen_kvprep.probe.env")
    assert layer_of("qwen_kvprep.buildcache.arch") < layer_of("qwen_kvprep.buildcache.builder")
    assert layer_of("qwen_kvprep.cli") == CLI


_ANY = re.compile(r"\bAny\b")


def any_lines(source: str) -> list[int]:
    """Lines of `source` that use typing.Any (imports not counted)."""
    lines: list[int] = []
    for node in ast.walk(ast.parse(source)):
        named = isinstance(node, ast.Name) and node.id == "Any"
        attribute = isinstance(node, ast.Attribute) and node.attr == "Any"
        # a quoted annotation ("dict[str, Any]")
        quoted = (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and len(node.value) < 80
            and "[" in node.value
            and _ANY.search(node.value) is not None
        )
        if named or attribute or quoted:
            lines.append(node.lineno)
    return lines


def explicit_any() -> list[str]:
    """Every use of typing.Any in the package, as module:line."""
    return [
        f"{name}:{line}"
        for name, path in modules().items()
        for line in any_lines(path.read_text(encoding="utf-8"))
    ]


def test_any_counter_sees_every_spelling() -> None:
    sample = (
        "from typing import Any\nimport typing\n"
        "def f(x: Any, y: typing.Any) -> 'dict[str, Any]': ...\n"
        "z: list[int] = []  # Any in a comment\n"
    )
    assert any_lines(sample) == [3, 3, 3]


ANY_LIMIT = 25


def test_explicit_any_is_rare() -> None:
    uses = explicit_any()
    assert len(uses) <= ANY_LIMIT, f"{len(uses)} explicit Any (limit {ANY_LIMIT}): {uses}"


# Imports of the package's own modules inside functions hide a link from the reader and from
# this test's graph until the function runs. Those left keep prestart's quick start and the
# CLI's start light, or order the smoke/profile children's imports; each says why.
IN_FUNCTION_LIMIT = 38
COMMAND_LINES_LIMIT = 120  # a command parses options, calls the library and renders


def imports_in_functions() -> list[str]:
    """module:line of every import of a qwen_kvprep module inside a function."""
    known = modules()
    found: set[str] = set()
    for name, path in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    one = ast.Module(body=[node], type_ignores=[])
                    if any(True for _ in _imports_in(name, path, one, known)):
                        found.add(f"{name}:{node.lineno}")
    return sorted(found)


def _imports_in(
    module: str, path: Path, tree: ast.Module, known: dict[str, Path]
) -> Iterator[str]:
    is_pkg = path.name == "__init__.py"
    for node in tree.body:
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.split(".")[0] == "qwen_kvprep")
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, is_pkg, node)
            if target.split(".")[0] == "qwen_kvprep":
                yield target


def test_few_imports_inside_functions() -> None:
    found = imports_in_functions()
    assert len(found) <= IN_FUNCTION_LIMIT, (
        f"{len(found)} in-function imports (limit {IN_FUNCTION_LIMIT}): {found}"
    )


def test_in_function_counter_sees_them() -> None:
    assert any(f.startswith("qwen_kvprep.checks:") for f in imports_in_functions())


def test_commands_are_thin() -> None:
    long = {
        name: n
        for name, path in modules().items()
        if name.startswith("qwen_kvprep.commands.")
        and (n := len(path.read_text(encoding="utf-8").splitlines())) > COMMAND_LINES_LIMIT
    }
    assert not long, f"commands over {COMMAND_LINES_LIMIT} lines: {long}"


def test_each_class_is_declared_once() -> None:
    """A shape declared twice drifts apart: one class per name in the package."""
    seen: dict[str, str] = {}
    twice: list[str] = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                if node.name in seen:
                    twice.append(f"{node.name}: {seen[node.name]} and {name}")
                seen[node.name] = name
    assert not twice, twice


def test_orchestrators_sit_above_engines() -> None:
    assert layer_of("qwen_kvprep.steps.fix") > layer_of("qwen_kvprep.buildcache.builder")
    assert layer_of("qwen_kvprep.demo") > layer_of("qwen_kvprep.smoke.runner")
    assert layer_of("qwen_kvprep.probe.revertplan") < layer_of("qwen_kvprep.journal.writer")
    # provenance.json's format sits below doctor's probe, which reads it, and convert
    assert layer_of("qwen_kvprep.provenance") < layer_of("qwen_kvprep.probe.converted")
    assert layer_of("qwen_kvprep.convert.run") > layer_of("qwen_kvprep.convert.verify")


if __name__ == "__main__":  # `python tests/test_architecture.py`: the report
    g = graph()
    for m, t in sorted((m, t) for m, ts in g.items() for t in ts if layer_of(t) > layer_of(m)):
        print(f"upward: {m} -> {t}")
    for c in cycles(g):
        print("cycle:", " <-> ".join(sorted(c)))
    print("explicit Any:", len(explicit_any()))
    sys.exit(0)
