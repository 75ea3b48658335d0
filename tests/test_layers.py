"""The package's import structure: `erpo_jax.tools` has no import circle,
`erpo_jax.runtime` (meshes, run directories, processes) imports nothing above
it, and the advantage formulas (`rl/advantages.py`) import nothing from the
package, so the estimator registry (`rl/estimators.py`) that imports them is
not imported back. Every import counts, those inside functions too: a circle through a
function-level import still ties the modules together."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "erpo_jax"


def _module(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the erpo_jax modules it imports (a package import names the
    package's __init__; `from pkg import mod` names the submodule)."""
    modules = {_module(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("erpo_jax")}
            elif isinstance(node, ast.ImportFrom) and node.module \
                    and node.module.startswith("erpo_jax"):
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    deps.add(sub if sub in modules else node.module)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def _cycles(graph: dict[str, set[str]], within: str) -> list[list[str]]:
    nodes = {n for n in graph if n.startswith(within)}
    found, state = [], {}

    def visit(n, stack):
        state[n] = "open"
        for d in sorted(graph[n] & nodes):
            if state.get(d) == "open":
                found.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d, stack + [d])
        state[n] = "done"

    for n in sorted(nodes):
        if n not in state:
            visit(n, [n])
    return found


def test_tools_have_no_import_circle():
    graph = import_graph()
    assert "erpo_jax.tools.presets" in graph["erpo_jax.tools.demo"]
    assert _cycles(graph, "erpo_jax.tools") == []


def test_the_cycle_finder_finds_a_circle():
    graph = {"erpo_jax.tools.a": {"erpo_jax.tools.b"}, "erpo_jax.tools.b": {"erpo_jax.tools.a"}}
    assert _cycles(graph, "erpo_jax.tools") == [["erpo_jax.tools.a", "erpo_jax.tools.b",
                                                 "erpo_jax.tools.a"]]


def test_runtime_imports_nothing_above_it():
    above = ("erpo_jax.model", "erpo_jax.train", "erpo_jax.rl", "erpo_jax.rollout",
             "erpo_jax.tools", "erpo_jax.cli", "erpo_jax.data", "erpo_jax.rewards")
    graph = import_graph()
    upward = {m: sorted(d for d in deps if d.startswith(above))
              for m, deps in graph.items() if m.startswith("erpo_jax.runtime")}
    assert {m: d for m, d in upward.items() if d} == {}


def test_advantage_formulas_do_not_import_the_estimator_registry():
    """One list of estimators, in the registry: rl/estimators.py registers the
    formulas of rl/advantages.py and is the only look-up by name, so the
    formulas import neither it nor anything else of the package (no circle)."""
    graph = import_graph()
    assert "erpo_jax.rl.advantages" in graph["erpo_jax.rl.estimators"]
    assert "erpo_jax.rl.estimators" not in graph["erpo_jax.rl.advantages"]
    assert graph["erpo_jax.rl.advantages"] == set()


def test_the_rollout_layer_imports_nothing_of_the_trainer():
    """A run's config becomes an engine in one place, `rollout.engine.engine_for`,
    which the Trainer's programs and the evaluator both call: the rollout
    layer imports nothing of train, rl or tools, and the evaluator does not
    import the programs (the evaluate <-> programs circle it once made)."""
    above = ("erpo_jax.train", "erpo_jax.rl", "erpo_jax.tools", "erpo_jax.cli")
    graph = import_graph()
    upward = {m: sorted(d for d in deps if d.startswith(above))
              for m, deps in graph.items() if m.startswith("erpo_jax.rollout")}
    assert {m: d for m, d in upward.items() if d} == {}
    assert "erpo_jax.rollout.engine" in graph["erpo_jax.train.evaluate"]
    assert "erpo_jax.train.programs" not in graph["erpo_jax.train.evaluate"]
