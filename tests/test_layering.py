"""The folders are layers and every import points down (README, "Architecture").

batch -> {backends, reference} -> engine -> properties -> search -> harness -> benchmarks.
Backends and references are peers: neither imports the other, so nothing under test shares code with the
oracle. Function-local imports count too (they are how cycles used to hide), and no module may sit in an
import cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"batch": 0, "backends": 1, "reference": 1, "engine": 3, "properties": 4, "search": 5, "harness": 6,
          "benchmarks": 7}


def project_modules() -> dict[str, Path]:
    mods = {}
    for top in LAYERS:
        for path in (ROOT / top).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


def imports(path: Path, name: str, known: dict[str, Path]) -> set[str]:
    """Project modules imported anywhere in the file (module level or inside functions)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def graph() -> dict[str, set[str]]:
    known = project_modules()
    return {name: imports(path, name, known) for name, path in known.items()}


def test_every_import_points_down_or_sideways_within_a_folder():
    upward = []
    for mod, deps in graph().items():
        for dep in deps:
            a, b = mod.split(".")[0], dep.split(".")[0]
            if a != b and LAYERS[b] >= LAYERS[a]:
                upward.append(f"{mod} -> {dep}")
    assert not upward, "imports against the layering:\n" + "\n".join(sorted(upward))


def test_no_import_cycles():
    g = graph()
    state: dict[str, int] = {}
    cycles: list[str] = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(g[m]):
            if state.get(d) == 1:
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_check_sees_function_local_imports(tmp_path):
    # The rule would be toothless if imports inside functions were skipped: they are how cycles used to hide.
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from engine.model import run_layers\n")
    assert imports(f, "backends.m", project_modules()) == {"engine.model"}
