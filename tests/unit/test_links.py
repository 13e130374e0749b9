"""Every documentation link resolves: relative Markdown links (`[text](path)`, with or without
an anchor) and the repository paths that docstrings name (`services/scheduler/server.py`,
`docs/design/contracts.md`, ...). A path counts as a repository path when its first part is a
top-level folder of the repository; web links are not fetched."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MD_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
# a/b/c.ext or a/b/ (a folder), made of plain path characters only
REPO_PATH = re.compile(
    r"(?<![\w/.~<$-])((?:[A-Za-z_][\w.-]*/)+(?:[\w-]+\.[A-Za-z]{1,5})?)(?![\w/<>*{])"
)
RELATIVE_PATH = re.compile(r"(?<![\w/])((?:\.\./)+[\w./-]*\w)")
EXTERNAL = ("http://", "https://", "mailto:", "#")


def _tracked(pattern: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", pattern], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return [ROOT / line for line in out.splitlines() if (ROOT / line).is_file()]


def _top_folders() -> set[str]:
    """The repository's own top-level folders (not logs/, results/ or a virtual environment)."""
    return {
        p.relative_to(ROOT).parts[0] for p in _tracked("*") if len(p.relative_to(ROOT).parts) > 1
    }


def markdown_problems(path: Path, top: set[str], root: Path = ROOT) -> list[str]:
    """Relative links in one Markdown file that point at nothing, and repository paths (or
    ../ paths) its prose names that do not exist. Code blocks are examples, not references."""
    where = path.relative_to(root)
    problems = []
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    for target in MD_LINK.findall(text):
        if target.startswith(EXTERNAL):
            continue
        local = target.split("#", 1)[0]
        if local and not (path.parent / local).exists():
            problems.append(f"{where}: link to {target!r}")
    prose = MD_LINK.sub("", text)
    for named in RELATIVE_PATH.findall(prose):
        if not (path.parent / named).exists():
            problems.append(f"{where}: names {named!r}")
    problems += [f"{where}: {p}" for p in _missing_repo_paths(prose, top, root)]
    return problems


def _missing_repo_paths(text: str, top: set[str], root: Path) -> list[str]:
    return [
        f"names {named!r}"
        for named in REPO_PATH.findall(text)
        if named.split("/", 1)[0] in top and not (root / named).exists()
    ]


def docstring_problems(path: Path, top: set[str], root: Path = ROOT) -> list[str]:
    """Repository paths named in one module's docstrings that do not exist."""
    problems = []
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef,
             ast.AsyncFunctionDef, ast.ClassDef)))]  # fmt: skip
    for node in nodes:
        doc = ast.get_docstring(node, clean=False) or ""
        for problem in _missing_repo_paths(doc, top, root):
            problems.append(f"{path.relative_to(root)}: docstring {problem}")
    return problems


def test_markdown_links_resolve() -> None:
    files = _tracked("*.md")
    assert len(files) > 5, files
    top = _top_folders()
    problems = [p for f in files for p in markdown_problems(f, top)]
    assert not problems, "\n".join(problems)


def test_paths_named_in_docstrings_exist() -> None:
    top = _top_folders()
    files = _tracked("*.py")
    assert len(files) > 50, len(files)
    problems = [p for f in files for p in docstring_problems(f, top)]
    assert not problems, "\n".join(problems)


def test_the_checker_finds_what_is_broken(tmp_path: Path) -> None:
    """The checker itself, on a small repository of its own: a missing target is reported; an
    existing one, a URL and a path outside the repository's folders are not."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "services").mkdir()
    (tmp_path / "README.md").write_text("read me\n")
    (tmp_path / "docs" / "protocol.md").write_text("the protocol\n")
    doc = tmp_path / "docs" / "guide.md"
    doc.write_text("[ok](../README.md) [web](https://example.com) [bad](nowhere.md#x)\n"
                   "See ../../ARCHITECTURE, `services/gone.py`, `docs/protocol.md`, "
                   "`logs/scheduler.log`.\n")  # fmt: skip
    top = {"docs", "services"}
    assert [p.split(": ", 1)[1] for p in markdown_problems(doc, top, tmp_path)] == [
        "link to 'nowhere.md#x'",
        "names '../../ARCHITECTURE'",
        "names 'services/gone.py'",
    ]
    module = tmp_path / "services" / "probe.py"
    module.write_text('"""See docs/protocol.md and services/nowhere.py."""\n'
                      'def f() -> None:\n    """Reads docs/missing.md."""\n')  # fmt: skip
    assert [p.split(": ", 1)[1] for p in docstring_problems(module, top, tmp_path)] == [
        "docstring names 'services/nowhere.py'",
        "docstring names 'docs/missing.md'",
    ]
