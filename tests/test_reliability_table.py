"""docs/RELIABILITY.md stays true: every row of its fault tables names a test, every test it names exists, and
the row count it states is the number of rows."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TABLE = REPO / "docs" / "RELIABILITY.md"


def _fault_rows() -> list[list[str]]:
    """The cells of every row of the fault tables (those with a `fault | ... | test | data lost` header)."""
    rows, in_table = [], False
    for line in TABLE.read_text().splitlines():
        if line.startswith("| fault |"):
            in_table = True
        elif not line.startswith("|"):
            in_table = False
        elif in_table and not line.startswith("|---"):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def _references(cell: str) -> list[tuple[str, str]]:
    """(test file under tests/, test function or "") of each `file.py::name`, `file.py` or `::name` (the file
    before) named in a cell; parametrized ids ([thread]) dropped."""
    found, last = [], ""
    for ref in re.findall(r"`([^`]+)`", cell):
        if ref.startswith("::"):
            found.append((last, ref[2:].split("[")[0]))
        elif re.match(r"^[\w/]+\.py(::|$)", ref):
            last, _, name = ref.partition("::")
            found.append((last, name.split("[")[0]))
    return found


def _functions(path: Path) -> set[str]:
    return {node.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.FunctionDef)}


def test_every_fault_row_names_tests_that_exist() -> None:
    rows = _fault_rows()
    assert len(rows) > 40  # the tables were found
    missing = []
    for cells in rows:
        assert len(cells) == 4, (
            f"a fault row needs 4 cells (fault | what happens | test | data lost): {cells}"
        )
        if not _references(cells[2]) and not cells[2].startswith("same test"):  # "same test": the row above's
            missing.append(f"{cells[0]}: names no test")
    # Every test named anywhere in a table (the figures too) exists.
    for line in TABLE.read_text().splitlines():
        for file, name in _references(line) if line.startswith("|") else []:
            path = REPO / "tests" / file
            if not path.is_file():
                missing.append(f"no file tests/{file} ({line[:60]}...)")
            elif name and name not in _functions(path):
                missing.append(f"no test {name} in tests/{file}")
    assert not missing, "\n".join(missing)


def test_the_stated_row_count_is_the_number_of_rows() -> None:
    stated = re.search(r"\| fault kinds injected \(rows below\) \| (\d+) \|", TABLE.read_text())
    assert stated is not None
    assert int(stated.group(1)) == len(_fault_rows())
