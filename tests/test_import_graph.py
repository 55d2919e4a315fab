"""The package's import graph: every import points down the floors of LAYERS, no cycle anywhere in src/
(function-level imports included), payload types at the bottom, and no module past the size where it should be
split."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "visionrl"
MAX_LINES = 500

# The floors of the package, bottom to top. A module imports modules of its own floor and of the floors below,
# never of a floor above. An entry names a module, or a package and with it every module inside; a new module
# must be placed (test_every_module_is_on_a_floor).
Floors = list[tuple[str, tuple[str, ...]]]  # (name, entries), bottom to top

LAYERS: Floors = [
    (
        "shared",
        (
            "visionrl", "visionrl.types", "visionrl.errors", "visionrl.files", "visionrl.run_layout",
            "visionrl.faults", "visionrl.pictures", "visionrl.finite", "visionrl.openai_wire",
        ),
    ),
    ("math", ("visionrl.algo",)),
    ("inputs", ("visionrl.data", "visionrl.rewards")),
    ("run records", ("visionrl.checkpoint", "visionrl.history", "visionrl.metrics")),
    (
        "config",
        (
            "visionrl.config", "visionrl.config_algorithm", "visionrl.config_env", "visionrl.config_logging", "visionrl.config_placement", "visionrl.config_ray",
            "visionrl.config_rollout", "visionrl.config_train", "visionrl.config_yaml",
        ),
    ),
    ("trackers", ("visionrl.trackers",)),
    ("adapter", ("visionrl.adapter",)),
    ("models", ("visionrl.models",)),
    ("environments", ("visionrl.envs",)),
    ("engines and learner", ("visionrl.rollout", "visionrl.train")),
    ("evaluation and serving", ("visionrl.eval", "visionrl.serve", "visionrl.judge", "visionrl.deploy")),
    ("orchestration", ("visionrl.orchestrate",)),
    ("entry points", ("visionrl.cli", "visionrl.cli_args", "visionrl.demo")),
]  # fmt: skip


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted((SRC / PACKAGE).rglob("*.py"))}


def _absolute(module: str, name: str | None, level: int) -> str:
    """The absolute name of `from <level dots><name> import ...` written in `module`."""
    if level == 0:
        return name or ""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{name}" if name else package


def _imports(module: str) -> set[str]:
    """The visionrl modules `module` imports, at any depth of its code (`from pkg import sub` counts as importing
    `pkg.sub`; relative imports count as the absolute ones they stand for)."""
    tree = ast.parse(MODULES[module].read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, node.module, node.level)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in MODULES else base)
    return {name for name in found if name in MODULES and name != module}


GRAPH = {module: _imports(module) for module in MODULES}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None (iterative depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(graph):
        if state.get(root):
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            child = next(stack[-1], None)
            if child is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(child) == 1:
                return path[path.index(child) :] + [child]
            elif not state.get(child):
                state[child] = 1
                path.append(child)
                stack.append(iter(sorted(graph[child])))
    return None


def floor_of(module: str, layers: Floors) -> int | None:
    """The index in `layers` of the entry naming `module` (the longest such entry), or None. The package root
    names only itself, not the whole package."""
    best: tuple[int, int] | None = None  # (entry length, floor)
    for floor, (_, entries) in enumerate(layers):
        for entry in entries:
            inside = entry != PACKAGE and module.startswith(entry + ".")
            if (module == entry or inside) and (best is None or len(entry) > best[0]):
                best = (len(entry), floor)
    return None if best is None else best[1]


def upward_imports(graph: dict[str, set[str]], layers: Floors) -> list[str]:
    """`a (floor) imports b (higher floor)` for every import of `graph` that points up the floors."""
    found = []
    for module in sorted(graph):
        here = floor_of(module, layers)
        for target in sorted(graph[module]):
            there = floor_of(target, layers)
            if here is not None and there is not None and there > here:
                found.append(
                    f"{module} (floor {layers[here][0]!r}) imports {target} (floor {layers[there][0]!r}, higher)"
                )
    return found


def test_floor_of_takes_the_longest_entry_and_keeps_the_root_to_itself() -> None:
    layers: Floors = [("low", ("visionrl", "visionrl.a.core")), ("high", ("visionrl.a",))]
    modules = ("visionrl", "visionrl.a", "visionrl.a.x", "visionrl.a.core.y", "visionrl.b")
    assert [floor_of(m, layers) for m in modules] == [0, 1, 1, 0, None]


def test_upward_imports_names_both_modules_of_a_planted_upward_import() -> None:
    layers: Floors = [("low", ("pkg.low",)), ("high", ("pkg.high",))]
    graph = {"pkg.low.a": {"pkg.high.b", "pkg.low.c"}, "pkg.high.b": {"pkg.low.c"}, "pkg.low.c": set()}
    assert upward_imports(graph, layers) == [
        "pkg.low.a (floor 'low') imports pkg.high.b (floor 'high', higher)"
    ]


def test_every_import_points_down_the_floors() -> None:
    found = upward_imports(GRAPH, LAYERS)
    assert not found, "imports that point up the floors of LAYERS:\n" + "\n".join(found)


def test_every_module_is_on_a_floor() -> None:
    unplaced = [module for module in MODULES if floor_of(module, LAYERS) is None]
    assert not unplaced, f"place these modules on a floor of LAYERS in {Path(__file__).name}: {unplaced}"


def test_every_floor_entry_names_a_module() -> None:
    entries = [entry for _, names in LAYERS for entry in names]
    stale = [e for e in entries if e not in MODULES and not any(m.startswith(e + ".") for m in MODULES)]
    assert not stale, f"LAYERS names modules that do not exist: {stale}"
    assert len(entries) == len(set(entries)), "a LAYERS entry is on two floors"


def test_find_cycle_finds_a_planted_cycle_and_accepts_a_tree() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_package_has_no_import_cycle() -> None:
    assert find_cycle(GRAPH) is None


@pytest.mark.parametrize(
    "bottom", ["visionrl.types", "visionrl.errors", "visionrl.files", "visionrl.run_layout"]
)
def test_shared_modules_import_nothing_from_the_package(bottom: str) -> None:
    assert GRAPH[bottom] == set()


def test_no_module_is_over_the_size_limit() -> None:
    sizes = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()}
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}


MAX_FUNCTION_LINES = 80  # a function longer than a screen is split into named parts
STEP_FUNCTION_LINES = 50  # the GRPO step reads as its phases


def long_functions(source: str, limit: int) -> dict[str, int]:
    """Functions and methods of `source` (by qualified name) longer than `limit` lines, decorators excluded."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                n = (child.end_lineno or child.lineno) - child.lineno + 1
                if n > limit:
                    found[prefix + child.name] = n
                visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(source), "")
    return found


def test_long_functions_measures_a_planted_long_method() -> None:
    body = "\n".join(f"        x{i} = {i}" for i in range(81))
    source = f"class A:\n    @staticmethod\n    def f():\n{body}\n\ndef g():\n    return 1\n"
    assert long_functions(source, 80) == {"A.f": 82}  # the def line and 81 statements
    assert long_functions(source, 82) == {}


def test_no_function_is_over_a_screen_and_the_step_fits_in_fifty_lines() -> None:
    over = {
        f"{module}:{name}": n
        for module, path in MODULES.items()
        for name, n in long_functions(path.read_text(), MAX_FUNCTION_LINES).items()
    }
    assert over == {}, f"split these into named parts: {over}"
    loop = long_functions(MODULES["visionrl.orchestrate.loop"].read_text(), 0)
    assert 0 < loop["Loop.step"] <= STEP_FUNCTION_LINES
