"""The package's import arrows, read from the source (imports inside functions included): they run one way, the
loop imports neither Triton nor the engine, and only trtspec/triton/ imports Triton's Python backend utilities."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "trtspec"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """trtspec module -> the trtspec modules it imports (a package import counts as its __init__)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(
                        package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                    )
                targets.add(base)
                targets |= {f"{base}.{a.name}" for a in node.names}
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def external_imports(name: str) -> set[str]:
    path = next(p for p in PACKAGE.rglob("*.py") if _module_name(p) == name)
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle, each as the path that closes it (depth-first, one per back edge)."""
    found, state, stack = [], {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_no_import_circle():
    graph = import_graph()
    # a package's __init__ importing its own submodules is not an arrow back up
    edges = {m: {t for t in ts if not (m.startswith(t + ".") and t in graph)} for m, ts in graph.items()}
    assert cycles(edges) == []


def test_the_checker_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]


def test_the_loop_imports_neither_triton_nor_the_engine():
    graph = import_graph()
    for name in graph:
        if name.startswith("trtspec.orchestrator"):
            assert not any(t.startswith(("trtspec.engine", "trtspec.triton")) for t in graph[name]), name
            assert not external_imports(name) & {"triton_python_backend_utils", "tritonclient", "torch"}, name


def test_only_the_triton_adapters_import_pb_utils():
    for name in import_graph():
        if "triton_python_backend_utils" in external_imports(name):
            assert name.startswith("trtspec.triton."), name


def test_the_bench_arithmetic_needs_no_server_client_or_framework():
    import subprocess
    import sys

    code = (
        "import sys, trtspec.bench.arithmetic, trtspec.bench.tuning; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'tritonclient', 'torch', 'numpy', 'transformers', "
        "'rich'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
