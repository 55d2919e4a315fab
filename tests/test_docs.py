"""Docs that stay true: the README's Layout section names only files and folders that exist, and no file under
src/, docs/, the README or CONTRIBUTING cites a document or a repository path that is not in the repository."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# Where facts are cited from: the code and the project's own docs.
CITING = sorted(
    [
        *(ROOT / "src" / "visionrl").rglob("*.py"),
        *(ROOT / "docs").glob("*.md"),
        README,
        ROOT / "CONTRIBUTING.md",
    ]
)
# A file name in a Layout description: these are the kinds the tree holds.
_FILE = re.compile(r"(?<![\w./<>-])([\w.-]*\w\.(?:py|yaml|md|json|sh|txt|toml)|Dockerfile|Makefile)\b")
_FOLDER = re.compile(r"(?<![\w./<>:-])([\w-]+/)(?=[\s,;)]|$)")


def layout_block(readme: str) -> list[str]:
    """The lines of the code block under the `## Layout` heading."""
    section = readme.split("\n## Layout\n", 1)
    if len(section) != 2:
        raise ValueError("the README has no '## Layout' section")
    body = section[1].split("\n## ", 1)[0]
    fence = body.split("```")
    if len(fence) < 3:
        raise ValueError("the Layout section has no code block")
    return fence[1].splitlines()[1:]  # the first line is the fence's own (language) line


def layout_paths(lines: list[str]) -> list[str]:
    """Every path the Layout block names, relative to the repository root.

    A line is `NAME  description`; its indentation puts NAME inside the nearest less indented folder (a
    name ending in `/`). A line indented to the description's column continues the description. File and
    folder names in a description are inside NAME's folder (NAME itself when it is a folder).
    """
    paths: list[str] = []
    parents: list[tuple[int, str]] = []  # (indentation, folder path ending in /)
    folder, description_column = "", 0
    for line in lines:
        indent = len(line) - len(line.lstrip())
        if not line.strip():
            continue
        if description_column and indent >= description_column:
            description = line.strip()
        else:
            name, _, description = line.strip().partition(" ")
            while parents and parents[-1][0] >= indent:
                parents.pop()
            path = (parents[-1][1] if parents else "") + name
            paths.append(path)
            folder = path if path.endswith("/") else path.rpartition("/")[0] + "/" * ("/" in path)
            if path.endswith("/"):
                parents.append((indent, path))
            rest = line[indent + len(name) :]
            description_column = indent + len(name) + len(rest) - len(rest.lstrip()) if description else 0
        named = _FILE.findall(description) + _FOLDER.findall(description)
        paths += [folder + p for p in named]
    return paths


def missing(paths: list[str], root: Path) -> list[str]:
    """The paths that do not exist under `root` (a folder must be a folder)."""
    gone = []
    for path in paths:
        target = root / path
        if not (target.is_dir() if path.endswith("/") else target.exists()):
            gone.append(path)
    return gone


def test_the_layout_parser_finds_a_planted_missing_file_and_folder(tmp_path: Path) -> None:
    (tmp_path / "src" / "pkg").mkdir(parents=True)
    (tmp_path / "src" / "pkg" / "cli.py").write_text("")
    (tmp_path / "src" / "pkg" / "io.py").write_text("")
    readme = (
        "# x\n\n## Layout\n\n```\n"
        "src/pkg/\n"
        "  cli.py      the command line (io.py: its files,\n"
        "              gone.py)\n"
        "  serve.py    a module that is gone\n"
        "  algo/       a folder that is gone\n"
        "tests/        unit/ (pure)\n"
        "```\n\n## Next\n\n```\nnot/the/layout.py\n```\n"
    )
    paths = layout_paths(layout_block(readme))
    assert paths == ["src/pkg/", "src/pkg/cli.py", "src/pkg/io.py", "src/pkg/gone.py", "src/pkg/serve.py",
                     "src/pkg/algo/", "tests/", "tests/unit/"]  # fmt: skip
    assert missing(paths, tmp_path) == [
        "src/pkg/gone.py",
        "src/pkg/serve.py",
        "src/pkg/algo/",
        "tests/",
        "tests/unit/",
    ]


def test_the_readme_layout_names_only_what_exists() -> None:
    paths = layout_paths(layout_block(README.read_text()))
    assert len(paths) > 20  # the parser read the block
    assert missing(paths, ROOT) == []


# A document cited by name (DESIGN.md, docs/ENGINE_NOTES.md), and a path from the root into a folder of the
# repository (benchmarks/gpu_step.py, tests/integration/). A results file a benchmark writes need not exist.
_DOC = re.compile(r"(?<![\w./-])([\w./-]*\w\.md)\b")
_REPO_PATH = re.compile(
    r"(?<![\w./-])((?:src|tests|docs|benchmarks|configs|deploy|scripts)/[\w./-]*[\w/])(?![\w/<>*{}-]|\.\w)"
)  # a pattern such as tests/test_<module>.py names no one path
_QUOTED_SECTION = re.compile(r"(docs/\w+\.md),? \"([^\"]+)\"")


def cited_paths(text: str) -> list[str]:
    found = _DOC.findall(text) + [p.rstrip(".") for p in _REPO_PATH.findall(text)]
    return [p for p in dict.fromkeys(found) if not p.startswith("benchmarks/results/")]


def resolves(path: str, citing: Path) -> bool:
    """A cited path exists from the root or from the citing file's folder; a bare document name also in docs/."""
    bases = [ROOT, citing.parent] + ([ROOT / "docs"] if "/" not in path else [])
    return any((base / path).exists() for base in bases)


def test_the_citation_check_catches_a_document_outside_the_repository() -> None:
    text = "see DESIGN.md and docs/ENGINE_NOTES.md; measured in benchmarks/gpu_lerner.py (.md twins, tests/<area>/)."
    assert cited_paths(text) == ["DESIGN.md", "docs/ENGINE_NOTES.md", "benchmarks/gpu_lerner.py"]
    assert [p for p in cited_paths(text) if not resolves(p, README)] == [
        "DESIGN.md",
        "benchmarks/gpu_lerner.py",
    ]


@pytest.mark.parametrize("citing", CITING, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cited_file_is_in_the_repository(citing: Path) -> None:
    text = citing.read_text()
    assert [p for p in cited_paths(text) if not resolves(p, citing)] == []
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text) if citing.suffix == ".md" else []
    assert [t for t in links if "://" not in t and not (citing.parent / t).exists()] == []


@pytest.mark.parametrize("citing", CITING, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cited_section_is_in_its_document(citing: Path) -> None:
    """`docs/X.md, "Name"` points at a passage: the name must stand in that document."""
    text = " ".join(citing.read_text().split())
    cited = _QUOTED_SECTION.findall(text)
    assert [(doc, name) for doc, name in cited if name not in (ROOT / doc).read_text()] == []


def test_the_architecture_names_only_modules_and_packages_that_exist() -> None:
    """docs/ARCHITECTURE.md names modules (`train/forward.py`) and packages (`algo/`) inside src/visionrl."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    named = re.findall(r"`([\w/]+\.py|[a-z_]+/)`", text)
    package = ROOT / "src" / "visionrl"
    assert len(named) > 20
    assert [n for n in named if not ((package / n).exists() or (ROOT / n).exists())] == []


def test_contributing_recipes_name_what_the_files_define() -> None:
    """A recipe's "`src/visionrl/x.py` (`NAME`" means NAME is defined in that file."""
    text = " ".join((ROOT / "CONTRIBUTING.md").read_text().split())
    pairs = re.findall(r"`(src/visionrl/[\w/]+\.py)` \(`(\w+)`", text)
    assert len(pairs) >= 3
    assert [(f, n) for f, n in pairs if not re.search(rf"^{n}\b", (ROOT / f).read_text(), re.M)] == []


def _layers() -> list[tuple[str, tuple[str, ...]]]:
    """LAYERS of tests/test_import_graph.py, the floors the import graph is checked against."""
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "tests" / "test_import_graph.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return list(module.LAYERS)


def test_the_architecture_floors_are_the_import_graph_floors() -> None:
    """The floors table of docs/ARCHITECTURE.md lists LAYERS' floors, in order, each with its modules."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    rows = re.findall(r"^\| ([a-z ]+) \| ((?:`[\w/]+`(?:, )?)+) \|", text, re.M)
    documented = [(floor, sorted(m.strip("`/") for m in names.split(", "))) for floor, names in rows]
    layers = [(floor, sorted(e.removeprefix("visionrl.") for e in entries if e != "visionrl"))
              for floor, entries in _layers()]  # fmt: skip
    assert documented == layers
