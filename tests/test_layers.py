"""The layout's rules, checked over the import graph of the source files.

Layers run one way: a module imports only from its own package or from a
package of a lower layer (``LAYERS``), so there is no import cycle and no
upward import. ``kernels_pallas`` is a leaf: it imports nothing from jaxkv.
No private name (``_name``) crosses a module, and a private module
(``jaxkv._ops``) is imported only from inside its own top-level package.

The graph is read with ``ast`` from the files themselves (imports inside
functions included), so the test cannot be fooled by import order.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

#: package -> layer; a module may import its own package or a lower layer.
LAYERS = {
    "kernels_pallas": 0,
    "jaxkv.core": 1,  # the modules in CORE
    "jaxkv.alloc": 2,
    "jaxkv.pool": 3,
    "jaxkv.manager": 4,
    "jaxkv.prefix": 4,
    "jaxkv.nn": 5,
    "jaxkv.text": 5.5,  # tokenizer + chat template: reads GGUF through jaxkv.nn.gguf; serve uses it
    "jaxkv.serve": 6,
    "jaxkv": 7,  # the public face (jaxkv/__init__.py)
    "jaxkv.bench": 8,
    "jaxkv.demo": 8,
    "jaxkv.allocator_tour": 8,
}

#: The bottom of jaxkv: types, errors, shared idioms, host-path helpers, the
#: checks, and the alias module of the decode reference. One layer among them.
CORE = ("jaxkv.types", "jaxkv.errors", "jaxkv._ops", "jaxkv._host", "jaxkv.checks", "jaxkv.attention")

#: Imports allowed against the layering, each with its reason.
EXEMPT = {
    # PEP 562 aliases: jaxkv.nn.Engine resolves to jaxkv.serve.Engine on first
    # attribute access, after both packages are loaded (no import-time edge).
    ("jaxkv.nn", "jaxkv.serve"),
}

def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for top in ("jaxkv", "kernels_pallas"):
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _package(module: str) -> str:
    """The LAYERS key owning ``module`` (longest matching prefix)."""
    if module in CORE:
        return "jaxkv.core"
    best = None
    for key in LAYERS:
        if module == key or module.startswith(key + "."):
            if best is None or len(key) > len(best):
                best = key
    assert best is not None, f"{module} has no layer: add it to LAYERS"
    return best


def _imports(module: str) -> list[tuple[str, list[str], int]]:
    """``(imported module, names taken from it, line)`` of every import in the
    file, relative imports resolved."""
    tree = ast.parse(MODULES[module].read_text())
    is_package = MODULES[module].name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((alias.name, [], node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = [alias.name for alias in node.names]
            # ``from pkg import submodule`` imports the submodule.
            subs = [n for n in names if f"{base}.{n}" in MODULES]
            if len(subs) < len(names):
                out.append((base, [n for n in names if n not in subs], node.lineno))
            out.extend((f"{base}.{n}", [], node.lineno) for n in subs)
    return [(m, names, line) for m, names, line in out if m.split(".")[0] in ("jaxkv", "kernels_pallas")]


def test_every_module_has_a_layer():
    for module in MODULES:
        _package(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_run_down_the_layers(module):
    here = _package(module)
    for target, _, line in _imports(module):
        there = _package(target)
        if there == here or (here, there) in EXEMPT:
            continue
        assert LAYERS[there] < LAYERS[here], (
            f"{module}:{line} imports {target} ({there}, layer {LAYERS[there]}) from layer "
            f"{LAYERS[here]} ({here}): imports must run to lower layers")


def test_kernels_pallas_is_a_leaf():
    for module in MODULES:
        if module.startswith("kernels_pallas"):
            bad = [(t, line) for t, _, line in _imports(module) if t.split(".")[0] == "jaxkv"]
            assert not bad, f"{module} imports jaxkv: {bad}"


def test_no_import_cycle():
    graph = {m: set() for m in MODULES}
    for module in MODULES:
        for target, _, _ in _imports(module):
            if (_package(module), _package(target)) in EXEMPT:
                continue
            # importing a package runs its __init__: an edge to the package module
            while target not in MODULES and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in MODULES and target != module:
                graph[module].add(target)
    # A package's __init__ importing its own submodules is how packages work;
    # a cycle through the parent package is only a problem across packages.
    for module, targets in graph.items():
        graph[module] = {t for t in targets if not module.startswith(t + ".")}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m):
        state[m] = 1
        path.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(t):] + [t]))
            if t not in state:
                visit(t)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_name_crosses_a_module(module):
    top = module.split(".")[0]
    tree = ast.parse(MODULES[module].read_text())
    aliases = {}  # local name -> imported jaxkv/kernels module
    for target, names, line in _imports(module):
        private_module = any(part.startswith("_") for part in target.split(".")[1:])
        assert not private_module or target.split(".")[0] == top, (
            f"{module}:{line} imports the private module {target} of another package")
        private = [n for n in names if n.startswith("_") and not n.startswith("__")]
        assert not private, f"{module}:{line} imports private names {private} from {target}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in ("jaxkv", "kernels_pallas"):
                    aliases[alias.asname or alias.name.split(".")[0]] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                if f"{node.module}.{alias.name}" in MODULES:
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            raise AssertionError(f"{module}:{node.lineno} reads the private {aliases[node.value.id]}.{node.attr}")


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not any(p.startswith("_") for p in m.split("."))))
def test_public_modules_declare_all(module):
    tree = ast.parse(MODULES[module].read_text())
    declared = any(isinstance(node, (ast.Assign, ast.AnnAssign)) and any(
        getattr(t, "id", None) == "__all__" for t in (node.targets if isinstance(node, ast.Assign) else [node.target]))
                   for node in tree.body)
    declared = declared or any(isinstance(node, ast.ImportFrom) and any(a.name == "__all__" for a in node.names)
                               for node in tree.body)  # an alias module re-exports its target's
    runnable = any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) for node in tree.body)
    assert declared or runnable, f"{module} has no __all__"
