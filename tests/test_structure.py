"""The package reads top-down: no import circle among remat's modules (python/remat, and kernels/ as
remat.kernels), counting every import, also those inside functions (a lazy import that breaks a
circle at run time still ties the two modules together). The layers: remat.patch (the entry) ->
remat.planning.model_plan (the whole-model planner) -> remat.replacement (one layer configuration applied)
-> remat.models (families) -> remat.nn (modules) -> remat.hf, remat.sequences (glue) ->
remat.functional -> remat.autograd -> remat.ops."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ((ROOT / "python" / "remat", "remat"), (ROOT / "kernels", "remat.kernels"))


def module_files():
    """{module name: path} of every Python module of remat."""
    files = {}
    for top, prefix in PACKAGES:
        for path in top.rglob("*.py"):
            parts = path.relative_to(top).with_suffix("").parts
            name = ".".join((prefix, *parts))
            files[name.removesuffix(".__init__")] = path
    return files


def imports(files):
    """{module: the remat modules it imports}, a package's submodules named where ``from package
    import name`` takes a module (the built modules, the extension remat._C and setup.py's
    remat._build_info, count as modules of their own, built or not)."""
    known = set(files) | {"remat._C", "remat._build_info"}

    def resolve(name):
        while name not in known and "." in name:
            name = name.rsplit(".", 1)[0]
        return name if name in known else None

    graph = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(resolve(alias.name) for alias in node.names if alias.name.startswith("remat"))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
                if base.startswith("remat"):
                    found.update(resolve(f"{base}.{alias.name}") or resolve(base) for alias in node.names)
        graph[module] = found - {None, module}
    return graph


def circles(graph):
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_finder_sees_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle_in_remat():
    files = module_files()
    assert {"remat.patch", "remat.planning.model_plan", "remat.replacement", "remat.nn.layers", "remat.hf",
            "remat.kernels.attention"} <= set(files)
    graph = imports(files)
    assert "remat.replacement" in graph["remat.planning.model_plan"]
    assert "remat.planning.model_plan" in graph["remat.patch"]
    assert circles(graph) == []
