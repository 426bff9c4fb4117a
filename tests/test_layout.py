"""The package's import graph follows the data flow: its packages and top-level modules stand on floors, and
every import (function-level and type-checking ones included) points to the same floor or a lower one, with
no cycles. A package stands on one floor whole, so no import climbs out of it. See docs/development.md
(Import floors)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Lowest first; a module may import from its own floor or a lower one. Each entry is a whole package or a
# top-level module (`kernels`, `pipeline.X`): a package cannot stand on two floors.
FLOORS: list[tuple[str, ...]] = [
    ("pipeline.errors", "pipeline.faults", "pipeline.seeds", "pipeline.stopwatch"),
    ("kernels",),
    ("pipeline.model",),
    ("pipeline.engine",),
    ("pipeline.parallel",),
    ("pipeline.config",),
    ("pipeline.source",),
    ("pipeline.plan",),
    ("pipeline.output",),
    ("pipeline.task",),
    ("pipeline.perf",),
    ("pipeline.job", "pipeline.preflight"),
    ("pipeline.__main__", "pipeline.probe", "pipeline.roofline", "pipeline.verify"),
]
# The engine runs a model it is handed; loading files is the job's (through pipeline.parallel.runner).
ENGINE_MUST_NOT_IMPORT = ("pipeline.model.loader", "pipeline.model.gguf_file", "pipeline.model.hf_file",
                          "pipeline.model.gguf_format", "pipeline.model.tokenizer")


def unit_of(module: str) -> str:
    """The package or top-level module that `module` belongs to: `kernels`, or `pipeline.X`."""
    parts = module.split(".")
    return parts[0] if parts[0] == "kernels" else ".".join(parts[:2])


def floor_of(module: str) -> int:
    if module == "pipeline":  # the package itself holds only its version
        return 0
    unit = unit_of(module)
    floor = next((i for i, units in enumerate(FLOORS) if unit in units), None)
    if floor is None:
        raise AssertionError(f"{unit} ({module}) stands on no floor in tests/test_layout.py")
    return floor


def modules() -> dict[str, Path]:
    out = {}
    for top in ("pipeline", "kernels"):
        for path in (ROOT / top).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Project modules `name` imports anywhere in its body (`from a import b` counts `a.b` if it is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in found if m in known and m != name}


GRAPH = {name: imports_of(name, path, set(modules())) for name, path in modules().items()}


def test_each_floor_holds_whole_packages_and_each_package_has_one():
    named = [unit for units in FLOORS for unit in units]
    assert [unit for unit in named if unit_of(unit) != unit] == []  # no module of a package on a floor of its own
    assert len(named) == len(set(named))
    assert set(named) == {unit_of(m) for m in GRAPH if m != "pipeline"}  # and none left out, none stale


@pytest.mark.parametrize("name", sorted(GRAPH))
def test_imports_point_to_the_same_or_a_lower_floor(name):
    higher = [m for m in GRAPH[name] if floor_of(m) > floor_of(name)]
    assert not higher, f"{name} (floor {floor_of(name)}) imports higher floors: {higher}"


def test_the_engine_loads_no_files():
    for name, deps in GRAPH.items():
        if name.startswith("pipeline.engine"):
            assert not deps & set(ENGINE_MUST_NOT_IMPORT), name


def test_nothing_imports_the_job_but_the_entry_point():
    assert {n for n, deps in GRAPH.items() if "pipeline.job" in deps} <= {"pipeline.__main__"}


def test_no_import_cycles():
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(GRAPH[node]):
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*path[path.index(dep):], dep]))
            if dep not in state:
                visit(dep, [*path, dep])
        state[node] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])
