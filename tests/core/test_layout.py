"""The package's shape, checked from its source: one package per backend, no import circles (imports inside
functions included), no upward imports, no branch on a backend's name outside the registry (each backend's
differences live in its adapter), and no module past 800 lines."""

import ast
import os
import re

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")
PACKAGE = os.path.join(SRC, "distkeras")
BACKENDS = ("tensorflow", "jax", "torch", "mxnet", "cntk")
#: Modules that use the backends; a backend never imports them.
ABOVE_BACKENDS = {"distkeras.api", "distkeras.launch.command", "distkeras.cli", "distkeras.callbacks", "distkeras.demo",
                  "distkeras.__main__"}


def modules():
    found = {}
    for folder, _, names in os.walk(PACKAGE):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, SRC)[:-3].replace(os.sep, ".")
                found[dotted[:-len(".__init__")] if dotted.endswith(".__init__") else dotted] = path
    return found


def imports(module, path, top_level_only):
    """The distkeras modules ``module`` imports (``from . import x`` resolved to ``x`` when it is a module)."""
    known = modules()
    tree = ast.parse(open(path).read())
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                candidate = target + "." + alias.name
                found.add(candidate if candidate in known else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name in known and name != module}


def test_each_backend_is_one_package_with_its_adapter():
    for name in BACKENDS:
        folder = os.path.join(PACKAGE, "backends", name)
        assert os.path.isfile(os.path.join(folder, "__init__.py")) and os.path.isfile(os.path.join(folder, "adapter.py"))
    from distkeras import backends

    assert backends.REGISTRY == {name: "distkeras.backends.{}.adapter:{}".format(name, cls) for name, cls in zip(
        BACKENDS, ("TensorFlowAdapter", "JaxAdapter", "TorchAdapter", "MXNetAdapter", "CNTKAdapter"))}
    flat = [n for n in os.listdir(os.path.join(PACKAGE, "backends")) if n.endswith(".py")]
    assert sorted(flat) == ["__init__.py", "agreement.py", "base.py", "batchnorm.py", "datawatch.py", "keras_model.py", "policies.py",
                            "verifying.py"]


def circle(top_level_only):
    """The first import circle found, as ``a -> b -> a``, or None (a submodule importing its parents aside)."""
    graph = {m: {t for t in imports(m, p, top_level_only) if not m.startswith(t + ".")} for m, p in modules().items()}
    state = {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return " -> ".join(stack[stack.index(nxt):] + [nxt])
            if nxt not in state:
                found = visit(nxt, stack + [nxt])
                if found:
                    return found
        state[node] = "done"
        return None

    for module in sorted(graph):
        if module not in state:
            found = visit(module, [module])
            if found:
                return found
    return None


def test_no_import_circles():
    """Module-level imports form no cycle (a package's ``__init__`` running its submodules' parents aside)."""
    found = circle(top_level_only=True)
    assert found is None, "import circle: " + str(found)


def test_no_import_circles_through_function_level_imports_either():
    """Nor do imports inside functions: a late import defers a cost (a framework, a plugin), not a dependency;
    two modules that import each other, however late, are one idea in two files. Imports by string (the backend
    registry's and the environments' ``"module:Class"`` names, importlib) are the registries' job and don't count."""
    found = circle(top_level_only=False)
    assert found is None, "import circle (move the code to where it belongs): " + str(found)


def test_the_circle_check_sees_function_level_imports():
    used = imports("distkeras.api", modules()["distkeras.api"], False)
    assert "distkeras.errors" in used and "distkeras.environments.ray" in used


#: A module grows past this many lines only by splitting by idea (docs/contributing.md has the map).
MAX_LINES = 800


def test_no_module_past_800_lines():
    too_long = {}
    for path in modules().values():
        with open(path) as handle:
            lines = sum(1 for _ in handle)
        if lines > MAX_LINES:
            too_long[os.path.relpath(path, PACKAGE).replace(os.sep, "/")] = lines
    assert not too_long, "modules past {} lines (split them by idea): {}".format(MAX_LINES, too_long)


def test_backends_import_nothing_above_them_and_nothing_of_each_other():
    for module, path in modules().items():
        if not module.startswith("distkeras.backends."):
            continue
        used = imports(module, path, False)
        assert not used & ABOVE_BACKENDS, (module, used & ABOVE_BACKENDS)
        parts = module.split(".")
        if len(parts) > 3:  # inside a backend's package: no other backend's package
            others = {u for u in used if u.startswith("distkeras.backends.") and u.split(".")[2] in BACKENDS
                      and u.split(".")[2] != parts[2]}
            assert not others, (module, others)


def test_no_branch_on_a_backend_name_outside_its_adapter():
    """What differs between backends is an adapter method, not an ``if backend == "mxnet"`` somewhere else."""
    pattern = re.compile(r"""(==|!=|\bin)\s*\(?\s*["'](tensorflow|jax|torch|mxnet|cntk)["']|["'](tensorflow|jax|torch|mxnet|cntk)["']\s*(==|!=)""")
    offenders = []
    for module, path in modules().items():
        if module.startswith("distkeras.backends.") and module.split(".")[2] in BACKENDS:
            continue  # a backend's own package may name itself
        for number, line in enumerate(open(path), 1):
            if pattern.search(line.split("#")[0]):
                offenders.append("{}:{}: {}".format(os.path.relpath(path, SRC), number, line.strip()))
    assert not offenders, "\n".join(offenders)

