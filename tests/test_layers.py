"""The layers of docs/design.md hold in the code.

The table of the design's "Layers" section is the one statement of which
module sits in which layer and what each layer may import; this test reads it
there, parses every module of ``hpccomm/`` with :mod:`ast` (imports inside
functions too, relative imports resolved) and fails on

* an import circle between modules (a strongly connected component of more
  than one module), with one circle through it and its import lines;
* an import from a layer that the importer's row does not name (a layer
  above its own, or a sibling it may not see);
* an import of another package's private (``_``-prefixed) name or module;
* an import of an ``hpccomm`` module that does not exist (an import inside a
  function runs only when the function does);
* a module that no row holds, a row whose path matches no module, and a row
  that may import a layer that is not an earlier row (the rows go bottom up).

The checker's functions take modules as source text, so the last tests run
them on a small made-up package with a circle, an upward import and a private
import, and demand that each is reported.
"""
from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DESIGN = os.path.join(ROOT, "docs", "design.md")
PACKAGE = "hpccomm"


# ---------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------
@dataclass
class Layer:
    name: str
    paths: List[str]
    may_import: Set[str]


def read_layers(text: str) -> List[Layer]:
    """The rows of the first table after ``## Layers``, bottom layer first.
    Raises ValueError for a table that is not a layering."""
    start = text.index("\n## Layers\n")
    end = text.find("\n## ", start + 1)
    section = text[start:end if end >= 0 else len(text)].splitlines()
    rows = [line for line in section if line.startswith("|")]
    if len(rows) < 3:
        raise ValueError("docs/design.md: no table in the Layers section")
    layers: List[Layer] = []
    for line in rows[2:]:                      # after the header and the |---| row
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3:
            raise ValueError(f"Layers table: {line!r} does not have 3 cells")
        name, paths, allowed = cells
        below = [layer.name for layer in layers]
        if allowed == "nothing":
            may = set()
        elif allowed == "all below":
            may = set(below)
        else:
            may = {a.strip() for a in allowed.split(",")}
            wrong = sorted(may - set(below))
            if wrong:
                raise ValueError(f"Layers table: {name!r} may import {wrong}, which "
                                 f"{'is' if len(wrong) == 1 else 'are'} not a layer below it")
        found = re.findall(r"`([^`]+)`", paths)
        if not found:
            raise ValueError(f"Layers table: {name!r} names no module")
        layers.append(Layer(name, found, may))
    return layers


def path_to_module(path: str, package: str = PACKAGE) -> Tuple[str, bool]:
    """``("hpccomm.collectives.transport", False)`` for
    ``collectives/transport.py``; ``(..., True)`` for a package path ``x/``
    (the package and everything in it); ``__init__.py`` is the package."""
    if path == "__init__.py":
        return package, False
    if path.endswith("/"):
        return ".".join([package] + path.strip("/").split("/")), True
    if not path.endswith(".py"):
        raise ValueError(f"Layers table: {path!r} is neither a .py file nor a package/")
    return ".".join([package] + path[:-3].split("/")), False


def assign(layers: List[Layer], modules, package: str = PACKAGE):
    """``(layer of each module, problems)``: the longest matching path wins."""
    owner: Dict[str, Tuple[int, str]] = {}     # module -> (match length, layer)
    problems: List[str] = []
    seen: Dict[str, str] = {}
    for layer in layers:
        for path in layer.paths:
            if path in seen:
                problems.append(f"Layers table: {path} is in {seen[path]!r} and {layer.name!r}")
            seen[path] = layer.name
            target, whole = path_to_module(path, package)
            hits = [m for m in modules
                    if m == target or (whole and m.startswith(target + "."))]
            if not hits:
                problems.append(f"Layers table: {path} (layer {layer.name!r}) matches no module")
            for m in hits:
                if m not in owner or len(target) > owner[m][0]:
                    owner[m] = (len(target), layer.name)
    for m in sorted(modules):
        if m not in owner:
            problems.append(f"{modules[m].path}: module {m} is in no layer of docs/design.md")
    return {m: name for m, (_, name) in owner.items()}, problems


# ---------------------------------------------------------------------------
# the modules and their imports
# ---------------------------------------------------------------------------
@dataclass
class Import:
    target: str                 # the module imported from (or the module itself)
    name: Optional[str]         # the name taken from it, None for the module
    line: int


@dataclass
class Module:
    name: str
    path: str                   # relative to the repository, for messages
    source: str
    is_package: bool
    imports: List[Import] = field(default_factory=list)


def read_package(root: str = ROOT, package: str = PACKAGE) -> Dict[str, Module]:
    """Every ``.py`` file under ``root/package``, by module name."""
    found = {}
    for folder, dirs, files in os.walk(os.path.join(root, package)):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                rel = os.path.relpath(path, root)
                parts = rel[:-3].split(os.sep)
                is_package = parts[-1] == "__init__"
                name = ".".join(parts[:-1] if is_package else parts)
                with open(path, encoding="utf-8") as fh:
                    found[name] = Module(name, rel, fh.read(), is_package)
    return found


def package_of(module: Module) -> str:
    return module.name if module.is_package else module.name.rpartition(".")[0]


def parse_imports(modules: Dict[str, Module], package: str = PACKAGE) -> List[str]:
    """Fill each module's ``imports`` with those of ``package`` (at any depth
    of the file); returns the imports of modules that do not exist."""
    missing = []
    for mod in modules.values():
        tree = ast.parse(mod.source, filename=mod.path)
        mod.imports = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == package or alias.name.startswith(package + "."):
                        mod.imports.append(Import(alias.name, None, node.lineno))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.name.split(".") if mod.is_package else mod.name.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if not (target == package or target.startswith(package + ".")):
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    if sub in modules:                       # a submodule, by name
                        mod.imports.append(Import(sub, None, node.lineno))
                    else:
                        mod.imports.append(Import(target, alias.name, node.lineno))
        for imp in mod.imports:
            if imp.target not in modules:
                missing.append(f"{mod.path}:{imp.line}: {mod.name} imports {imp.target}, "
                               f"which is no module of {package}")
    return missing


def graph(modules: Dict[str, Module]) -> Dict[str, Dict[str, int]]:
    """``importer -> {imported: first line}`` between known modules."""
    g: Dict[str, Dict[str, int]] = {m: {} for m in modules}
    for mod in modules.values():
        for imp in mod.imports:
            if imp.target in modules and imp.target != mod.name:
                g[mod.name].setdefault(imp.target, imp.line)
    return g


# ---------------------------------------------------------------------------
# the checks
# ---------------------------------------------------------------------------
def strongly_connected(g: Dict[str, Dict[str, int]]) -> List[List[str]]:
    """Tarjan's components, iteratively (no recursion limit)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    comps: List[List[str]] = []
    counter = 0
    for root in sorted(g):
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            advanced = False
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(g[w]))))
                    advanced = True
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                comps.append(sorted(comp))
    return comps


def one_circle(g: Dict[str, Dict[str, int]], comp: List[str]) -> List[str]:
    """A shortest circle from the component's first module back to it."""
    start, inside = comp[0], set(comp)
    parent: Dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(g[v]):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start] + path[::-1][1:] + [start]
                if w in inside and w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp + [comp[0]]


def circles(modules: Dict[str, Module]) -> List[str]:
    g = graph(modules)
    found = []
    for comp in strongly_connected(g):
        if len(comp) > 1:
            ring = one_circle(g, comp)
            steps = "\n".join(f"    {modules[a].path}:{g[a][b]}: {a} -> {b}"
                              for a, b in zip(ring, ring[1:]))
            found.append(f"import circle among {len(comp)} modules ({', '.join(comp)}):\n"
                         + steps)
    return found


def upward(modules: Dict[str, Module], layer_of: Dict[str, str],
           layers: List[Layer]) -> List[str]:
    allowed = {layer.name: layer.may_import for layer in layers}
    found = []
    for mod in modules.values():
        mine = layer_of.get(mod.name)
        for imp in mod.imports:
            theirs = layer_of.get(imp.target)
            if mine is None or theirs is None or theirs == mine or theirs in allowed[mine]:
                continue
            may = ", ".join(sorted(allowed[mine])) or "nothing"
            found.append(f"{mod.path}:{imp.line}: {mod.name} (layer {mine!r}) imports "
                         f"{imp.target} (layer {theirs!r}); {mine!r} may import only its own "
                         f"layer and: {may}")
    return found


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_imports(modules: Dict[str, Module]) -> List[str]:
    """Private names or modules taken from another package (a subpackage is
    another package)."""
    found = []
    for mod in modules.values():
        here = package_of(mod)
        for imp in mod.imports:
            parts = imp.target.split(".")
            owners = [(".".join(parts[:i]), parts[i]) for i in range(1, len(parts))
                      if is_private(parts[i])]
            if imp.name is not None and is_private(imp.name):
                target = modules.get(imp.target)
                owners.append((imp.target if target is None or target.is_package
                               else package_of(target), imp.name))
            for owner, private in owners:
                if owner != here:
                    found.append(f"{mod.path}:{imp.line}: {mod.name} imports the private "
                                 f"{private!r} of package {owner} ({imp.target})")
    return found


# ---------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------
def _load():
    with open(DESIGN, encoding="utf-8") as f:
        layers = read_layers(f.read())
    modules = read_package()
    missing = parse_imports(modules)
    layer_of, problems = assign(layers, modules)
    return layers, modules, missing, layer_of, problems


def _fail(what: str, found: List[str]):
    if found:
        pytest.fail(f"{len(found)} {what}:\n" + "\n".join(found), pytrace=False)


def test_every_module_is_in_one_layer_of_the_design():
    _, modules, _, layer_of, problems = _load()
    assert len(modules) > 100 and layer_of["hpccomm.codecs.rotation"] == "codecs"
    assert layer_of["hpccomm.collectives.transport"] == "transport"
    _fail("problems with the Layers table of docs/design.md", problems)


def test_no_import_of_a_missing_module():
    _fail("imports of modules that do not exist", _load()[2])


def test_no_import_circles():
    _fail("import circle(s)", circles(_load()[1]))


def test_no_import_from_a_layer_above():
    layers, modules, _, layer_of, _ = _load()
    _fail("import(s) against the layers of docs/design.md", upward(modules, layer_of, layers))


def test_no_private_import_across_packages():
    _fail("private import(s) across packages", private_imports(_load()[1]))


# the checker itself, on a made-up package --------------------------------------
TOY_TABLE = """
## Layers

| layer | modules (under `toy/`) | may import |
|---|---|---|
| low | `low.py` `util/` | nothing |
| mid | `mid/` | low |
| top | `top.py` `__init__.py` | all below |

## Next
"""

TOY = {
    "toy": ("toy/__init__.py", True, "from .top import run\n"),
    "toy.low": ("toy/low.py", False, "def f():\n    from .mid.a import g  # upward\n"),
    "toy.util": ("toy/util/__init__.py", True, ""),
    "toy.util.helpers": ("toy/util/helpers.py", False, "_secret = 1\n"),
    "toy.mid": ("toy/mid/__init__.py", True, ""),
    "toy.mid.a": ("toy/mid/a.py", False, "from . import b\nfrom ..util.helpers import _secret\n"),
    "toy.mid.b": ("toy/mid/b.py", False, "import toy.mid.c\n"),
    "toy.mid.c": ("toy/mid/c.py", False,
                  "from .. import util\n\n\ndef h():\n    from .a import g\n"),
    "toy.top": ("toy/top.py", False, "from toy.mid import a\nfrom toy.gone import x\n"),
}


def _toy():
    modules = {name: Module(name, path, src, pkg) for name, (path, pkg, src) in TOY.items()}
    missing = parse_imports(modules, package="toy")
    layers = read_layers(TOY_TABLE)
    layer_of, problems = assign(layers, modules, package="toy")
    return layers, modules, missing, layer_of, problems


def test_checker_reports_a_circle_through_a_function_level_import():
    found = circles(_toy()[1])
    assert len(found) == 1, found
    assert "toy.mid.a -> toy.mid.b" in found[0] and "toy.mid.b -> toy.mid.c" in found[0] \
        and "toy.mid.c -> toy.mid.a" in found[0], found[0]


def test_checker_reports_an_upward_import():
    layers, modules, _, layer_of, problems = _toy()
    assert not problems, problems
    assert layer_of == {"toy": "top", "toy.low": "low", "toy.util": "low",
                        "toy.util.helpers": "low", "toy.mid": "mid", "toy.mid.a": "mid",
                        "toy.mid.b": "mid", "toy.mid.c": "mid", "toy.top": "top"}
    found = upward(modules, layer_of, layers)
    assert len(found) == 1 and found[0].startswith("toy/low.py:2: toy.low (layer 'low') imports "
                                                   "toy.mid.a (layer 'mid')"), found


def test_checker_reports_a_private_import_across_packages_and_a_missing_module():
    _, modules, missing, _, _ = _toy()
    found = private_imports(modules)
    assert len(found) == 1 and "'_secret' of package toy.util" in found[0], found
    assert len(missing) == 1 and "toy.gone" in missing[0], missing


def test_checker_refuses_a_table_that_is_no_layering():
    with pytest.raises(ValueError, match="'low' may import \\['mid'\\], which is not a layer "
                                         "below it"):
        read_layers(TOY_TABLE.replace("| nothing |", "| mid |"))
    layers = read_layers(TOY_TABLE.replace("`top.py` ", "`top.py` `gone.py` "))
    _, problems = assign(layers, _toy()[1], package="toy")
    assert problems == ["Layers table: gone.py (layer 'top') matches no module"], problems
