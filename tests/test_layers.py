"""The package's layers import downward only, and no module imports itself back.

    floor 1  dtarl.tree, dtarl.axes, dtarl.timing,     (no JAX in tree/; engines price their
             dtarl.errors, dtarl.aot, dtarl.aotfile,   work in dtarl.tree.cost)
             dtarl.yamlconf
    floor 2  dtarl.model, dtarl.lora, dtarl.parallel.mesh
    floor 3  dtarl.advantages, dtarl.batch, dtarl.losses, dtarl.traces, dtarl.testing,
             dtarl.data, dtarl.rewards
    floor 4  dtarl.rollout, dtarl.engines
    floor 5  dtarl.rl, dtarl.parallel
    floor 6  dtarl.bench
    floor 7  dtarl.commands, dtarl.cli

A module may import its own floor or below. Every import counts, top-level or
inside a function, and ``from pkg import name`` counts as importing ``pkg.name``
when that is a module. The graph is read with ``ast``, so nothing is imported.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "dtarl"

FLOORS = {
    "dtarl.tree": 1,
    "dtarl.axes": 1,
    "dtarl.timing": 1,
    "dtarl.aot": 1,
    "dtarl.aotfile": 1,
    "dtarl.yamlconf": 1,
    "dtarl.errors": 1,
    "dtarl.model": 2,
    "dtarl.lora": 2,
    "dtarl.parallel.mesh": 2,
    "dtarl.advantages": 3,
    "dtarl.batch": 3,
    "dtarl.losses": 3,
    "dtarl.traces": 3,
    "dtarl.rewards": 3,
    "dtarl.testing": 3,
    "dtarl.data": 3,
    "dtarl.rollout": 4,
    "dtarl.engines": 4,
    "dtarl.rl": 5,
    "dtarl.parallel": 5,
    "dtarl.bench": 6,
    "dtarl.commands": 7,
    "dtarl.cli": 7,
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def floor(module: str) -> int | None:
    """The floor of ``module``: its longest prefix in FLOORS (None for ``dtarl`` itself)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        f = FLOORS.get(".".join(parts[:n]))
        if f is not None:
            return f
    return None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The dtarl modules that ``module`` imports (resolved to modules that exist)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base if is_pkg else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            names = [stem] + [f"{stem}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if not name.startswith("dtarl"):
                continue
            # Resolve to the longest existing module prefix.
            parts = name.split(".")
            for n in range(len(parts), 0, -1):
                candidate = ".".join(parts[:n])
                if candidate in modules:
                    if candidate != module:
                        out.add(candidate)
                    break
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: imports_of(m, p, modules) for m, p in modules.items()}


def test_every_module_has_a_floor():
    missing = [m for m in _modules() if m != "dtarl" and floor(m) is None]
    assert not missing, f"modules with no floor in FLOORS: {missing}"


def test_imports_go_downward():
    upward = []
    for mod, deps in _graph().items():
        f = floor(mod)
        for dep in deps:
            g = floor(dep)
            if f is not None and g is not None and g > f:
                upward.append(f"{mod} (floor {f}) imports {dep} (floor {g})")
    assert not upward, "upward imports:\n" + "\n".join(sorted(upward))


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            # A package's __init__ importing its own submodules is how packages
            # re-export; a submodule importing the package back is the cycle we
            # look for, so only the parent -> child edge is skipped.
            if dep.startswith(node + "."):
                continue
            if state.get(dep) == 1:
                return stack[stack.index(dep) :] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycles():
    cycle = find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_checker_reports_an_upward_import_and_a_cycle():
    graph = {"dtarl.tree.x": {"dtarl.engines.y"}, "dtarl.engines.y": {"dtarl.tree.x"}}
    assert find_cycle(graph) == ["dtarl.engines.y", "dtarl.tree.x", "dtarl.engines.y"]
    assert floor("dtarl.tree.x") < floor("dtarl.engines.y")


@pytest.mark.parametrize("package", ["dtarl.traces", "dtarl.tree", "dtarl.batch"])
def test_data_packages_import_no_jax(package):
    code = (
        f"import sys, {package}; "
        "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if m.startswith('jax'))"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


MAX_MODULE_LINES = 700  # issue #33: a module past this splits along a responsibility


def test_no_library_module_is_over_700_lines():
    long = {
        name: n
        for name, path in _modules().items()
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"
