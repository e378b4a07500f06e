"""Import direction of the kvcal package, and where its engines live.

Claims checked: every import of a ``kvcal`` module by a ``kvcal`` module — at top level or inside a
function, class or ``if TYPE_CHECKING`` block — goes to the same layer or a lower one of the map in
:mod:`kvcal._layers` (formats ← plan ← capture/search/kernels ← artifact/runtime/evaluate ←
export/report/api ← cli), every module is placed in that map, and neither the graph of imports between
modules nor the one between units (``kvcal.<subpackage or module>``, ``kvcal.engines.<name>``) has a cycle.

Engines (issue 41, "one engine, one room"): every module that names an engine lives in that engine's package,
``kvcal/engines/<name>/``, and no module outside an engine's package imports one (the floors reach an engine
only by name, through the registry :mod:`kvcal.engines`, which loads it with :mod:`importlib`). The rule,
read with :mod:`ast` (:func:`engine_names_in`): a module *names* engine ``E`` when a word of
:data:`ENGINE_WORDS` for ``E`` appears (case-insensitive, anywhere in the identifier) in

* its dotted module name;
* an import statement anywhere in it: the module imported, a name imported from it, or an alias;
* a name it defines: a function or class (at any depth), or a module-level assignment target.

Not read: string literals, comments and docstrings — an engine's name is data there (a CLI option such as
``--vllm-dtype``, a JSON key such as the artifact's ``"vllm"`` section, a row label ``vllm:fp8``, the engine's
source file cited as the source of a constant: ``vllm/v1/attention/backends/flash_attn.py``), and the floors
ask the registry for an engine by such a string; nor attribute names, parameters and local variables, which keep
the public Python API and CLI unchanged (``EvalConfig.vllm_dtypes``, ``MemoryResult.vllm``, ``recommend``'s
document keys). A module of ``kvcal/engines/<name>/`` names no other engine.

Imports are read with :mod:`ast` from the source files, so nothing is imported or executed; a wrong-way import
found only in a rarely called function fails the test as well.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import kvcal
from kvcal._layers import LAYERS, engine_of, layer_of, unit_of

PKG = Path(kvcal.__file__).parent

#: engine package name -> the words that name it in an identifier (case-insensitive substrings). Every package under
#: kvcal/engines/ must be listed (:func:`test_every_engine_package_has_its_words`): adding an engine adds its words.
ENGINE_WORDS: dict[str, tuple[str, ...]] = {
    "vllm": ("vllm",),
    "sglang": ("sglang",),
    "trtllm": ("trtllm", "tensorrt"),
    "llamacpp": ("llamacpp", "llama_cpp", "llama.cpp"),
}
_WORD = {w: name for name, words in ENGINE_WORDS.items() for w in words}
_WORD_RE = re.compile("|".join(re.escape(w) for w in sorted(_WORD, key=len, reverse=True)), re.I)


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
    ("kvcal.artifact", "products"), ("kvcal.engines.vllm.export", "front"), ("kvcal.cli", "cli"),
    ("kvcal.outputs", "base"), ("kvcal.corpus.jsonl", "stages"), ("kvcal.artifact.io", "products"),
    ("kvcal.cli.quality", "cli"), ("kvcal.planning", None), ("kvcal.checkpoint", None),
])
def test_layer_map_places_by_longest_prefix(module, layer):
    """Each module falls in the layer of its longest prefix: the split packages (outputs, corpus, artifact, cli) where
    _layers.py places them, ``kvcal.planning`` not in ``kvcal.plan`` (prefix match is by whole components), and
    ``kvcal.checkpoint`` (no such module) nowhere."""
    i = layer_of(module)
    assert (LAYERS[i][0] if i is not None else None) == layer


# ---- no cycle between modules --------------------------------------------------------------------------------------


def module_graph() -> dict[str, set[str]]:
    """``{module: {kvcal modules it imports}}`` read from the AST (self-imports left out)."""
    graph: dict[str, set[str]] = {}
    for mod, path in all_modules().items():
        graph[mod] = {t for _, t in kvcal_imports(path) if t != mod}
    return graph


def test_no_import_cycle_between_modules():
    """The graph of imports between modules (every kvcal module, the package ``__init__`` files included: a
    submodule importing its own package and the package importing it is a circle too) has no cycle. The circles
    issue 41 cut: formats.spec <-> formats.variants, capture.distributed <-> capture.run, the vLLM FP8 and NVFP4
    searches, the vLLM dtypes package <-> its modules (the GPU-only constants), kernels <-> kernels.triton_quant."""
    graph = module_graph()
    cycle = _cycle(graph)
    assert cycle is None, f"import cycle between modules: {' -> '.join(cycle)}"


# ---- engines: one room each ----------------------------------------------------------------------------------------


def engine_names_in(module: str, source: str) -> dict[str, list[str]]:
    """``{engine: [what names it]}`` for module ``module`` with source ``source``, by the rule of the module
    docstring: its dotted name, every import statement (module, names, aliases), every function or class it defines
    and its module-level assignment targets. Strings, comments, docstrings, attributes, parameters and locals are
    not read."""
    found: dict[str, list[str]] = {}

    def see(ident: str | None, what: str) -> None:
        for m in _WORD_RE.finditer(ident or ""):
            found.setdefault(_WORD[m.group(0).lower()], []).append(f"{what} {ident}")

    see(module, "module")
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                see(a.name, "import")
                see(a.asname, "import ... as")
        elif isinstance(node, ast.ImportFrom):
            see(node.module, "from")
            for a in node.names:
                see(a.name, "import")
                see(a.asname, "import ... as")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            see(node.name, "def")
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            for n in ast.walk(t):
                if isinstance(n, ast.Name):
                    see(n.id, "assigns")
    return found


def test_engine_rule_reads_what_it_says():
    """The reader of the rule on a hand-written module: imports (module, name, alias), definitions at any depth and
    module-level assignments name an engine; a string, a comment, a docstring, an attribute, a parameter and a local
    do not."""
    src = (
        '"""Cites vllm/v1/attention/backends/flash_attn.py."""\n'
        "import kvcal.engines  # vllm\n"
        "from kvcal.engines.vllm import plan\n"          # module path
        "from kvcal.export.rules import simulate_sglang\n"  # a name
        "from kvcal import x as trtllm_x\n"                # an alias
        "SGLANG_FILE = 'f.json'\n"                         # module-level assignment
        "def f(vllm_dtypes=()):\n"                         # a parameter: not read
        "    llamacpp_local = 'vllm'\n"                     # a local and a string: not read
        "    def tensorrt_helper(): pass\n"                 # a nested function: read
        "    return cfg.vllm\n"                             # an attribute: not read
    )
    got = engine_names_in("kvcal.example", src)
    assert sorted(got) == ["sglang", "trtllm", "vllm"]
    assert got["vllm"] == ["from kvcal.engines.vllm"]
    assert got["sglang"] == ["import simulate_sglang", "assigns SGLANG_FILE"]
    assert got["trtllm"] == ["import ... as trtllm_x", "def tensorrt_helper"]
    assert engine_names_in("kvcal.engines.llamacpp.export", "") == {"llamacpp": ["module kvcal.engines.llamacpp.export"]}


def test_every_engine_package_has_its_words():
    """Every package under kvcal/engines/ is an engine of ENGINE_WORDS (so the rule below knows the words that name
    it), and its facade sets ``NAME`` to the package name (the name the registry finds it by)."""
    packages = sorted(p.name for p in (PKG / "engines").iterdir() if (p / "__init__.py").is_file())
    assert packages, "no engine package under kvcal/engines/"
    assert set(packages) <= set(ENGINE_WORDS), f"add the words naming {sorted(set(packages) - set(ENGINE_WORDS))}"
    for name in packages:
        tree = ast.parse((PKG / "engines" / name / "__init__.py").read_text(encoding="utf-8"))
        values = {t.id: n.value for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
                  if isinstance(t, ast.Name)}
        assert isinstance(values.get("NAME"), ast.Constant) and values["NAME"].value == name, \
            f"kvcal/engines/{name}/__init__.py must set NAME = {name!r}"


def test_every_module_naming_an_engine_lives_in_its_room():
    """Every kvcal module that names an engine (rule: module docstring) lives under ``kvcal/engines/<that engine>/``;
    a module there names no other engine. Each offender is listed with what names which engine."""
    bad = []
    for mod, path in all_modules().items():
        home = engine_of(mod)
        for eng, why in engine_names_in(mod, path.read_text(encoding="utf-8")).items():
            if eng != home:
                bad.append(f"{path.relative_to(PKG.parent)} names {eng} ({'; '.join(why[:3])}) but lives "
                           + (f"in kvcal/engines/{home}/" if home else "outside kvcal/engines/") + f"; move it to "
                           f"kvcal/engines/{eng}/ or reach {eng} through kvcal.engines.engine({eng!r})")
    assert not bad, "modules naming an engine outside its package:\n" + "\n".join(bad)


def test_no_module_outside_an_engine_imports_one():
    """No module imports a module of an engine's package unless it is in that package: the floors (and the other
    engines) reach an engine only through the registry ``kvcal.engines`` (whatever the engine's name: this does not
    depend on ENGINE_WORDS)."""
    bad = []
    for mod, path in all_modules().items():
        for line, target in kvcal_imports(path):
            them = engine_of(target)
            if them is not None and them != engine_of(mod):
                bad.append(f"{path.relative_to(PKG.parent)}:{line}: {mod} imports {target}")
    assert not bad, "imports of an engine's package from outside it (use kvcal.engines.engine(name)):\n" + "\n".join(bad)


def test_the_registry_imports_no_engine():
    """``kvcal.engines`` (the registry, base layer) imports no engine package and nothing above the base layer: it
    finds engines on disk and loads one with importlib only when asked."""
    path = PKG / "engines" / "__init__.py"
    assert all(layer_of(t) == 0 and engine_of(t) is None for _, t in kvcal_imports(path)), kvcal_imports(path)
