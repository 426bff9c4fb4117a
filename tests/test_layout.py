"""The package's import graph follows the data flow: every import (function-level ones included) points to
the same or an earlier stage, and there are no cycles. See docs/development.md (layout)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Earlier stages first; a module may import its own stage or an earlier one. The longest matching prefix
# decides a module's stage.
STAGES: list[tuple[str, ...]] = [
    ("pipeline.errors", "pipeline.faults", "pipeline.seeds", "pipeline.stopwatch"),
    ("kernels",),
    ("pipeline.model",),
    ("pipeline.engine",),
    ("pipeline.parallel",),
    ("pipeline.config",),
    ("pipeline.source",),
    ("pipeline.plan",),
    ("pipeline.output",),
    ("pipeline.perf",),
    ("pipeline.job", "pipeline.preflight"),
    ("pipeline.__main__", "pipeline.probe", "pipeline.verify", "pipeline.roofline"),
]
# The engine runs a model it is handed; loading files is the job's (through pipeline.parallel.runner).
ENGINE_MUST_NOT_IMPORT = ("pipeline.model.loader", "pipeline.model.gguf_file", "pipeline.model.hf_file",
                          "pipeline.model.gguf_format", "pipeline.model.tokenizer")


def stage_of(module: str) -> int:
    if module == "pipeline":  # the package itself holds only its version
        return 0
    best, stage = -1, None
    for i, prefixes in enumerate(STAGES):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, stage = len(p), i
    if stage is None:
        raise AssertionError(f"{module} belongs to no stage in tests/test_layout.py")
    return stage


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


@pytest.mark.parametrize("name", sorted(GRAPH))
def test_imports_point_to_the_same_or_an_earlier_stage(name):
    later = [m for m in GRAPH[name] if stage_of(m) > stage_of(name) and not name.startswith(m + ".")]
    assert not later, f"{name} imports later stages: {later}"


def test_the_model_knows_nothing_of_parallelism_but_its_collectives():
    for name, deps in GRAPH.items():
        if name.startswith("pipeline.model"):
            assert not {d for d in deps if d.startswith("pipeline.parallel")}, name


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
