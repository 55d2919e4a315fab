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


# --------------------------------------------------------------------------- command lines in the docs

_FENCE = re.compile(r"```[^\n]*\n(.*?)```", re.S)
_SPAN = re.compile(r"`([^`\n]+)`")
_COMMAND = re.compile(r"(?:^|[\s(\"'])(?:\.venv/bin/)?visionrl (?=[a-z])")
_SHELL_END = ("&", "|", ";", ">", ")", "2>")


def _cut(line: str, match: re.Match[str]) -> list[str]:
    """The words of the command line `match` starts, up to where the shell ends it (`&`, `|`, `;`, a redirection,
    or the `)` of a `$(visionrl ...)`)."""
    import shlex

    rest = line[match.end() :]
    if match.group().lstrip().startswith("("):  # $(visionrl fetch URL)
        rest = rest.split(")", 1)[0]
    words = []
    for word in shlex.split(rest, comments=True):
        if word.startswith(_SHELL_END):
            break
        words.append(word)
    return words


def visionrl_commands(markdown: str) -> list[tuple[list[str], bool]]:
    """(words after `visionrl`, complete) of each command line: those of the fenced blocks (continuation lines
    joined) are complete, to be copied as written; those of inline code spans name a subcommand and some of its
    flags (an inline span with `...` or `|` is a sketch or a list of subcommands and is left out)."""
    found = []
    for block in _FENCE.findall(markdown):
        for line in block.replace("\\\n", " ").splitlines():
            found += [(_cut(line, m), True) for m in _COMMAND.finditer(line)]
    for span in _SPAN.findall(_FENCE.sub("", markdown)):
        if "..." not in span and "|" not in span:
            found += [(_cut(span, m), False) for m in _COMMAND.finditer(span)]
    return found


def command_error(words: list[str], complete: bool) -> str | None:
    """None when visionrl's own parser takes `words`: in full (subcommand, flags, values, required arguments) for a
    complete line; the subcommand and the flags named for an inline mention. Else what is wrong."""
    import argparse
    import contextlib
    import io

    from visionrl.cli import build_parser

    parser = build_parser()
    if complete:
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                parser.parse_args(words)
        except SystemExit:
            return err.getvalue().strip().splitlines()[-1]
        return None
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if words[0] not in sub.choices:
        return f"no subcommand {words[0]!r}"
    unknown = [w.split("=")[0] for w in words[1:] if w.startswith("--")]
    unknown = [w for w in unknown if w not in sub.choices[words[0]]._option_string_actions]
    return f"{words[0]} has no {unknown}" if unknown else None


def test_the_command_check_finds_a_wrong_flag_and_a_literal_option_bracket() -> None:
    text = "```bash\nvisionrl eval --data d --out o \\\n  --wrong 1\nvisionrl eval --data d --out o [--ablate-images] &\n"
    text += 'curl -d "$(visionrl fetch s3://b/x)"\n```\n'
    text += "Then `visionrl validate job.yaml --check-data`, `visionrl eval --judge`, `visionrl train | eval ...`, "
    text += "`visionrl serve --no-such-flag`.\n"
    commands = visionrl_commands(text)
    assert commands == [
        (["eval", "--data", "d", "--out", "o", "--wrong", "1"], True),
        (["eval", "--data", "d", "--out", "o", "[--ablate-images]"], True),
        (["fetch", "s3://b/x"], True),
        (["validate", "job.yaml", "--check-data"], False),
        (["eval", "--judge"], False),
        (["serve", "--no-such-flag"], False),
    ]
    errors = [command_error(*c) for c in commands]
    assert "unrecognized arguments: --wrong 1" in str(errors[0])
    assert "unrecognized arguments: [--ablate-images]" in str(errors[1])
    assert errors[2:5] == [None, None, None]
    assert errors[5] == "serve has no ['--no-such-flag']"


@pytest.mark.parametrize(
    "doc", [README, ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name
)
def test_every_visionrl_command_line_in_the_docs_parses(doc: Path) -> None:
    """A user copies these lines as written: each subcommand and flag must exist and each value be one it takes."""
    errors = {
        " ".join(words): command_error(words, complete)
        for words, complete in visionrl_commands(doc.read_text())
    }
    assert {c: e for c, e in errors.items() if e is not None} == {}
