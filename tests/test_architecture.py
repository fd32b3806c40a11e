"""The house rules, as tests: which room may import which, no import cycles,
and the SDK and the controller import without torch.

Rooms (README, Layout): ``protos`` and ``policies`` are the shared core;
``controller`` is the service; ``worker.sdk`` is what an engine embeds,
``worker.sim`` the simulated fleet, ``worker.reference`` the reference
engine; ``bench`` and ``specctl`` sit on top. Imports only run downward:
nothing in the product imports ``bench`` or ``specctl``, the controller
never imports ``worker``, and the SDK and the policies never import the
controller, the simulator or the reference engine. Every import counts,
function-local ones included (they hide cycles and upward imports alike).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("protos", "policies", "controller", "worker", "bench", "specctl")

# room -> rooms it must never import (prefix match on the module name)
FORBIDDEN = {
    "protos": ("policies", "controller", "worker", "bench", "specctl"),
    "policies": ("controller", "worker", "bench", "specctl"),
    "worker.sdk": ("controller", "worker.sim", "worker.reference", "bench", "specctl"),
    "controller": ("worker", "bench", "specctl"),
    "worker.sim": ("controller", "worker.reference", "bench", "specctl"),
    "worker.reference": ("controller", "worker.sim", "bench", "specctl"),
    "bench": ("specctl",),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def product_modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            out[module_name(path)] = path
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Our modules ``name`` imports anywhere in its file (TYPE_CHECKING blocks excepted)."""
    tree = ast.parse(path.read_text(), str(path))
    type_only = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_only.update(id(n) for n in ast.walk(node))
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base_parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for target in targets:
            # The longest known module the target names (``from a.b import c``: a.b.c or a.b).
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = product_modules()
    known = set(modules)
    return {name: imports_of(name, path, known) for name, path in modules.items()}


def room(module: str) -> str | None:
    for prefix in sorted(FORBIDDEN, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return prefix
    return None


def test_no_import_runs_upward(graph) -> None:
    wrong = []
    for module, targets in graph.items():
        r = room(module)
        if r is None:
            continue
        for target in sorted(targets):
            if any(target == f or target.startswith(f + ".") for f in FORBIDDEN[r]):
                wrong.append(f"{module} imports {target}")
    assert not wrong, "\n".join(wrong)


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Components of more than one module (Kosaraju, iterative: no recursion limit to raise)."""
    order: list[str] = []
    seen: set[str] = set()
    for start in sorted(edges):
        if start in seen:
            continue
        seen.add(start)
        stack = [(start, iter(sorted(edges.get(start, ()))))]
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                order.append(node)
            elif child not in seen:
                seen.add(child)
                stack.append((child, iter(sorted(edges.get(child, ())))))
    reverse: dict[str, set[str]] = defaultdict(set)
    for node, targets in edges.items():
        for target in targets:
            reverse[target].add(node)
    assigned: set[str] = set()
    components = []
    for node in reversed(order):
        if node in assigned:
            continue
        component, todo = [], [node]
        assigned.add(node)
        while todo:
            current = todo.pop()
            component.append(current)
            for prev in reverse[current]:
                if prev not in assigned:
                    assigned.add(prev)
                    todo.append(prev)
        if len(component) > 1:
            components.append(sorted(component))
    return components


def test_no_import_cycles(graph) -> None:
    # A package's __init__ re-exporting its own submodules is not a cycle worth reporting.
    edges = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in graph.items()}
    cycles = strongly_connected(edges)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


BLOCK_HEAVY = """
import importlib, pkgutil, sys

class Blocked:
    heavy = ("torch", "transformers", "accelerate", "gguf", "matplotlib")

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.heavy:
            raise ImportError(f"{name} is blocked: this room must import without it")
        return None

sys.meta_path.insert(0, Blocked())
for root in sys.argv[1:]:
    package = importlib.import_module(root)
    for info in pkgutil.walk_packages(package.__path__, root + "."):
        importlib.import_module(info.name)
print("imported", " ".join(sys.argv[1:]))
"""


@pytest.mark.parametrize("rooms", [("worker.sdk", "policies", "protos"), ("controller",)])
def test_rooms_import_without_torch(rooms) -> None:
    result = subprocess.run([sys.executable, "-c", BLOCK_HEAVY, *rooms], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


# Import name -> the distribution that provides it (only those the rooms use).
DISTRIBUTION = {"google": "protobuf", "grpc": "grpcio", "grpc_health": "grpcio-health-checking",
                "grpc_reflection": "grpcio-reflection", "grpc_tools": "grpcio-tools", "yaml": "PyYAML",
                "prometheus_client": "prometheus-client", "safetensors": "transformers",
                "llama_cpp": "llama-cpp-python"}
# room -> the extras that install it (besides the core dependencies)
EXTRAS = {"protos": (), "policies": (), "worker.sdk": ("sdk",), "worker.sdk.integrations": ("sdk", "llamacpp"), "worker.sim": (), "controller": ("controller",),
          "worker.reference": ("worker",), "bench": ("bench",), "specctl": ("controller", "worker", "bench")}


def _requirements(extras: tuple[str, ...]) -> set[str]:
    import re
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional = project["optional-dependencies"]
    names, todo, seen = set(), list(extras), set()
    reqs = list(project["dependencies"])
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for req in optional[extra]:
            inner = re.fullmatch(r"specctl\[([\w,]+)\]", req)
            if inner:
                todo.extend(inner.group(1).split(","))
            else:
                reqs.append(req)
    for req in reqs:
        names.add(re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower())
    return names


def test_each_rooms_extra_installs_what_it_imports() -> None:
    stdlib = set(sys.stdlib_module_names)
    ours = set(PACKAGES)
    missing = []
    for module, path in product_modules().items():
        r = next((p for p in sorted(EXTRAS, key=len, reverse=True) if module == p or module.startswith(p + ".")),
                 None)
        if r is None or path.name.endswith(".pyi"):
            continue
        installed = _requirements(EXTRAS[r])
        if r == "protos" and module == "protos.generate":
            installed |= _requirements(("dev",))  # regenerating the code is a developer's job
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                tops = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                tops = [(node.module or "").split(".")[0]]
            else:
                continue
            for top in tops:
                if top in stdlib or top in ours or not top:
                    continue
                dist = DISTRIBUTION.get(top, top).lower()
                if dist not in installed:
                    missing.append(f"{module} imports {top} ({dist}), not in the core or extras {EXTRAS[r]}")
    assert not missing, "\n".join(sorted(set(missing)))
