"""The documentation keeps up with the code: docs/reference.md documents every option of
every command, every finding id, every QWEN_KVPREP_* environment variable and every exit
code the package has, and every relative link in the README and docs/ resolves (anchors
included). Everything is read from the code itself (the click group, the package's
source), so a new option, finding, variable or exit code without its documentation fails
here."""

from __future__ import annotations

import ast
import re
import unicodedata
from collections.abc import Iterator
from pathlib import Path

import click
import pytest

from qwen_kvprep.cli import cli

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "qwen_kvprep"
REFERENCE = ROOT / "docs" / "reference.md"
README = ROOT / "README.md"
# The functions that make a finding from an id (findings.py, errors.KvprepError.failing);
# checks declare theirs with @check(id, ...).
FINDING_MAKERS = {"ok", "info", "warn", "fail", "skip", "failing"}
ID_RE = re.compile(r"[a-z]+\.[a-z0-9_]+")
FENCE_RE = re.compile(r"^(```|~~~)")


def _strip_code_blocks(text: str) -> str:
    """The text outside fenced code blocks (links and headings in code are not links)."""
    kept, fenced = [], False
    for line in text.splitlines():
        if FENCE_RE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            kept.append(line)
    return "\n".join(kept)


def _sections(text: str) -> list[tuple[str, int, str]]:
    """(heading, level, body up to the next heading of the same or a higher level); a
    `#` line inside a fenced code block is no heading, but stays in the body."""
    lines = text.splitlines()
    heads, fenced = [], False
    for i, line in enumerate(lines):
        if FENCE_RE.match(line.strip()):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)):
            heads.append((i, len(m.group(1)), m.group(2)))
    out = []
    for n, (i, level, title) in enumerate(heads):
        end = next((j for j, lv, _ in heads[n + 1 :] if lv <= level), len(lines))
        out.append((title, level, "\n".join(lines[i + 1 : end])))
    return out


def _section(text: str, pattern: str) -> str:
    """The body of the one heading matching `pattern` (a regex on the heading's text)."""
    found = [body for title, _, body in _sections(text) if re.fullmatch(pattern, title)]
    assert len(found) == 1, f"expected one heading matching {pattern!r}, found {len(found)}"
    return found[0]


def _mentions(text: str, word: str) -> bool:
    """`word` (an option, a variable) as a whole token: `-o` is not found in `--output`."""
    return re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", text) is not None


def _walk(
    group: click.Group, prefix: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], click.Command]]:
    for name, command in sorted(group.commands.items()):
        yield (*prefix, name), command
        if isinstance(command, click.Group):
            yield from _walk(command, (*prefix, name))


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _finding_ids() -> dict[str, Path]:
    """Every finding id the package can report, with a file that reports it: the ids of
    @check declarations and every literal id given to a finding maker, including a local
    name bound to one (`report = info if changed else ok`)."""
    ids: dict[str, Path] = {}
    for path in _sources():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        makers = set(FINDING_MAKERS) | {"check"}
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.IfExp):
                branches = (node.value.body, node.value.orelse)
                if all(isinstance(b, ast.Name) and b.id in FINDING_MAKERS for b in branches):
                    makers |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            first = node.args[0]
            if (
                name in makers
                and isinstance(first, ast.Constant)
                and isinstance(first.value, str)
                and ID_RE.fullmatch(first.value)
            ):
                ids.setdefault(first.value, path)
    return ids


def _env_vars() -> set[str]:
    names: set[str] = set()
    for path in _sources():
        names |= set(re.findall(r"QWEN_KVPREP_[A-Z0-9_]*[A-Z0-9]", path.read_text("utf-8")))
    return names


def _exit_codes() -> dict[str, int]:
    """Every module-level `EXIT_* = <int>` of the package."""
    codes = {}
    for path in _sources():
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Constant)
                and type(node.value.value) is int
            ):
                for target in node.targets:
                    if isinstance(target, ast.Name) and target.id.startswith("EXIT_"):
                        codes[f"{path.relative_to(ROOT)}:{target.id}"] = node.value.value
    return codes


@pytest.fixture(scope="module")
def reference() -> str:
    return REFERENCE.read_text(encoding="utf-8")


def test_every_option_of_every_command_is_in_its_section(reference: str) -> None:
    commands = _strip_code_blocks(_section(reference, "Commands"))
    # what every command shares (--json, --debug, -h) is said once, before the first command
    shared = commands.split("\n### ", 1)[0]
    missing = [
        f"qwen-kvprep: {opt}"
        for param in cli.params
        if isinstance(param, click.Option)
        for opt in (*param.opts, *param.secondary_opts)
        if not _mentions(shared, opt)
    ]
    walked = list(_walk(cli))
    assert len(walked) >= 10  # the walk really found the commands
    for path, command in walked:
        name = " ".join(path)
        # said in a table or prose, not only in the synopsis
        # a group's own heading is its name alone (`qwen-kvprep cache`): its commands' start so
        tail = "" if isinstance(command, click.Group) else r"\b.*"
        body = _strip_code_blocks(_section(reference, rf"`qwen-kvprep {re.escape(name)}{tail}`"))
        for param in command.params:
            if not isinstance(param, click.Option):
                continue
            for opt in (*param.opts, *param.secondary_opts):
                if not (_mentions(body, opt) or _mentions(shared, opt)):
                    missing.append(f"{name}: {opt}")
    assert not missing, "options without documentation in docs/reference.md: " + ", ".join(missing)


def test_every_finding_id_is_documented(reference: str) -> None:
    ids = _finding_ids()
    assert {"env.torch", "checkpoint.shards", "build.compile", "modules.plant"} <= set(ids)
    missing = [
        f"{i} ({p.relative_to(ROOT)})" for i, p in sorted(ids.items()) if f"`{i}`" not in reference
    ]
    assert not missing, "finding ids not in docs/reference.md: " + ", ".join(missing)


def test_every_environment_variable_is_in_the_table(reference: str) -> None:
    names = _env_vars()
    assert {"QWEN_KVPREP_CACHE", "QWEN_KVPREP_LOCK_TIMEOUT"} <= names
    table = _section(reference, "Environment variables")
    missing = sorted(n for n in names if not _mentions(table, n))
    assert not missing, "QWEN_KVPREP_* variables not under Environment variables: " + ", ".join(
        missing
    )


def test_every_exit_code_is_in_the_table(reference: str) -> None:
    codes = _exit_codes()
    assert {0, 1, 2, 130} <= set(codes.values())
    table = _section(reference, "Exit codes")
    rows = {int(m) for m in re.findall(r"^\|\s*(\d+)\s*\|", table, re.MULTILINE)}
    missing = sorted(f"{code} ({name})" for name, code in codes.items() if code not in rows)
    assert not missing, "exit codes without a row under Exit codes: " + ", ".join(missing)


def _slug(title: str) -> str:
    """The anchor GitHub gives a heading: lower case, markup and punctuation dropped,
    spaces to hyphens (hyphens and underscores kept)."""
    text = re.sub(r"<[^>]+>", "", title).lower()
    kept = "".join(
        c for c in text if c in "-_ " or not unicodedata.category(c).startswith(("P", "S"))
    )
    return kept.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for title, _, _ in _sections(path.read_text(encoding="utf-8")):
        slug = _slug(title)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _documents() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def test_every_relative_link_resolves() -> None:
    broken, checked = [], 0
    for doc in _documents():
        text = _strip_code_blocks(doc.read_text(encoding="utf-8"))
        text = re.sub(r"`[^`\n]*`", "", text)  # inline code is not a link either
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            checked += 1
            file_part, _, anchor = target.partition("#")
            dest = (doc.parent / file_part).resolve() if file_part else doc
            where = f"{doc.relative_to(ROOT)}: ({target})"
            if not dest.exists():
                broken.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{where}: no heading with anchor #{anchor}")
    assert checked >= 20  # the README's and the reference's own links were found
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_slugs_are_githubs() -> None:
    assert _slug("`qwen-kvprep prestart DIR [OPTIONS] [-- CMD ARGS…]`") == (
        "qwen-kvprep-prestart-dir-options----cmd-args"
    )
    assert _slug("What goes wrong, and what `fix` does about it") == (
        "what-goes-wrong-and-what-fix-does-about-it"
    )
    assert _slug("qwen-kvprep's kernels") == "qwen-kvpreps-kernels"


def test_readme_keeps_the_test_command_and_links_the_documentation() -> None:
    """The README keeps what CI runs from it (the test command; the Quick start block is
    .ci/run's own check) and leads to the rest."""
    readme = README.read_text(encoding="utf-8")
    assert 'pip install -e ".[test]" && pytest' in _section(readme, "Development")
    for doc in ("reference.md", "development.md", "architecture.md", "qwen-v1.md"):
        assert f"(docs/{doc}" in readme, doc


README_LINES_LIMIT = 250  # the short version; the reference holds the rest


def test_readme_stays_short_and_shows_every_command() -> None:
    """The README says what each command does with an example of it (`qwen-kvprep NAME ...`
    in a code block or inline), and stays short enough to read."""
    readme = README.read_text(encoding="utf-8")
    lines = len(readme.splitlines())
    assert lines <= README_LINES_LIMIT, f"README.md: {lines} lines (at most {README_LINES_LIMIT})"
    leaves = [path for path, command in _walk(cli) if not isinstance(command, click.Group)]
    assert len(leaves) >= 10
    without = [
        " ".join(path)
        for path in leaves
        if not re.search(rf"qwen-kvprep {re.escape(' '.join(path))}(?=[ `\n])", readme)
    ]
    assert not without, f"commands with no example in the README: {without}"


def test_the_quick_start_chooses_torch_before_installing_it() -> None:
    """`pip install .` brings a 3 GB CUDA build of torch unless one is installed: the way to
    the CPU build comes before the commands that CI's newcomer stage runs (the first fenced
    block of the section)."""
    quick = _section(README.read_text(encoding="utf-8"), "Quick start")
    before, fence, commands = quick.partition("```")
    assert fence and "pip install ." in commands.split("```")[0]
    assert "--index-url https://download.pytorch.org/whl/cpu" in before


def test_the_measured_tokenizer_table_is_the_codes(reference: str) -> None:
    """doctor's tokenizer warning (checks/measured.py) and the table the reference shows
    say the same of every release."""
    from qwen_kvprep.checks.measured import QWEN_TOKENIZER

    body = _section(reference, r"Measured on each transformers 5\.x release")
    rows = [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in body.splitlines()
        if re.match(r"^\|\s*\d+\.\d+\.\d+\s*\|", line)
    ]
    documented = {row[0]: row[2] for row in rows}
    assert set(documented) == {release for release, _ in QWEN_TOKENIZER.values()}
    for release, how in QWEN_TOKENIZER.values():
        works = documented[release].startswith("works")
        assert works is (how is None), (release, documented[release])
