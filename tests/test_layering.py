"""Import direction of the kvcal package.

Claim checked: every import of a ``kvcal`` module by a ``kvcal`` module — at top level or inside a
function, class or ``if TYPE_CHECKING`` block — goes to the same layer or a lower one of the map in
:mod:`kvcal._layers` (formats ← plan ← capture/search/kernels ← artifact/runtime/evaluate ←
export/report/api ← cli), every module is placed in that map, and the graph of imports between
units (``kvcal.<subpackage or module>``) has no cycle. Imports are read with :mod:`ast` from the
source files, so nothing is imported or executed; a wrong-way import found only in a rarely
called function fails the test as well.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvcal
from kvcal._layers import LAYERS, layer_of, unit_of

PKG = Path(kvcal.__file__).parent


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_module(dotted: str) -> bool:
    """True when ``dotted`` names a module or package file under ``kvcal/``."""
    p = PKG.parent.joinpath(*dotted.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def kvcal_imports(path: Path, source: str | None = None, module: str | None = None) -> list[tuple[int, str]]:
    """``(line, imported kvcal module)`` for every import statement anywhere in ``path``.

    ``from kvcal.x import y`` counts as an import of ``kvcal.x.y`` when ``y`` is a submodule,
    else of ``kvcal.x``; relative imports are resolved against the importing module.
    ``source``/``module`` override the file's text and dotted name (for the parser's own test)."""
    me = module or module_name(path)
    pkg_parts = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
    text = path.read_text(encoding="utf-8") if source is None else source
    out = []
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "kvcal"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg_parts[: len(pkg_parts) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "kvcal":
                continue
            for a in node.names:
                sub = f"{mod}.{a.name}"
                out.append((node.lineno, sub if is_module(sub) else mod))
    return out


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def test_parser_sees_every_kind_of_import():
    """The reader must not miss a lazy or relative import: a hand-written module with one of each."""
    src = (
        "import os\n"
        "import kvcal.errors\n"                          # line 2: plain import
        "from kvcal.plan import SidePlan\n"              # line 3: from-import of a name
        "from kvcal.formats import trellis as tr\n"      # line 4: from-import of a submodule
        "from . import objectives\n"                     # line 5: relative, submodule
        "from ..artifact import config_hash\n"           # line 6: relative, parent package
        "def f():\n"
        "    from kvcal.kernels.attn_error import key_kl\n"  # line 8: function-level
        "class C:\n"
        "    def g(self):\n"
        "        import kvcal.report.markdown\n"         # line 11: method-level
    )
    got = kvcal_imports(PKG / "search" / "example.py", source=src, module="kvcal.search.example")
    assert sorted(got) == [
        (2, "kvcal.errors"), (3, "kvcal.plan"), (4, "kvcal.formats.trellis"), (5, "kvcal.search.objectives"),
        (6, "kvcal.artifact"), (8, "kvcal.kernels.attn_error"), (11, "kvcal.report.markdown"),
    ]


def test_every_module_is_placed():
    """Every module of the kvcal package (read from the source tree) has a layer in kvcal/_layers.py
    LAYERS."""
    unplaced = [m for m in all_modules() if layer_of(m) is None]
    assert not unplaced, f"add these modules to kvcal/_layers.py LAYERS: {unplaced}"


def test_no_wrong_way_import():
    """No kvcal module imports (per the AST, anywhere in the file) a kvcal module of a higher layer of the
    LAYERS map; each offending import is listed with file and line."""
    names = [n for n, _ in LAYERS]
    bad = []
    for mod, path in all_modules().items():
        me = layer_of(mod)
        for line, target in kvcal_imports(path):
            them = layer_of(target)
            if me is not None and them is not None and them > me:
                bad.append(f"{path.relative_to(PKG.parent)}:{line}: {mod} ({names[me]}) imports "
                           f"{target} ({names[them]})")
    assert not bad, "wrong-way imports (a module may only import its own layer or lower ones):\n" + "\n".join(bad)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a node list, or ``None`` (recursive depth-first search; the unit graph has ~25 nodes)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                c = visit(m)
                if c:
                    return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            c = visit(n)
            if c:
                return c
    return None


def test_cycle_finder_finds_a_cycle():
    """The cycle finder used below returns the hand-worked cycle a -> b -> c -> a of a three-node ring and
    None for a chain."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle_between_units():
    """The graph of imports between units (kvcal.<subpackage or module>, the kvcal root excluded) read from
    the AST has no cycle."""
    graph: dict[str, set[str]] = {}
    for mod, path in all_modules().items():
        u = unit_of(mod)
        for _, target in kvcal_imports(path):
            t = unit_of(target)
            if t != u and u != "kvcal" and t != "kvcal":
                graph.setdefault(u, set()).add(t)
    assert _cycle(graph) is None, f"import cycle between units: {' -> '.join(_cycle(graph))}"


@pytest.mark.parametrize("module,layer", [
    ("kvcal", "base"), ("kvcal.formats.quant", "formats"), ("kvcal.plan", "plan"),
    ("kvcal.search.optimizer", "stages"), ("kvcal.kernels.attn_error", "stages"),
    ("kvcal.artifact", "products"), ("kvcal.export.vllm", "front"), ("kvcal.cli", "cli"),
    ("kvcal.outputs", "base"), ("kvcal.corpus.jsonl", "stages"), ("kvcal.artifact.io", "products"),
    ("kvcal.cli.quality", "cli"), ("kvcal.planning", None), ("kvcal.checkpoint", None),
])
def test_layer_map_places_by_longest_prefix(module, layer):
    """Each module falls in the layer of its longest prefix: the split packages (outputs, corpus, artifact, cli) where
    _layers.py places them, ``kvcal.planning`` not in ``kvcal.plan`` (prefix match is by whole components), and
    ``kvcal.checkpoint`` (no such module) nowhere."""
    i = layer_of(module)
    assert (LAYERS[i][0] if i is not None else None) == layer
