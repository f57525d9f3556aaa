"""The package's shape: imports flow down the layers docs/architecture.md states, no import cycle, short
functions, no repeated code.

Imports are read with ``ast`` from every module, at module level and inside functions alike.
The layer order is parsed from the layer table of docs/architecture.md (the one statement of it);
a module may import its own layer or lower ones, never a higher one.
"""

from __future__ import annotations

import ast
import functools
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from tests.utils.paths import ROOT

SRC = ROOT / "src"
PKG = "kvkeeper"
MAX_FUNCTION_LINES = 60
# parts (folders, or single modules) whose functions stay short
SHORT_FUNCTION_DIRS = ("engine", "sessions", "api", "cluster", "kvcache/store.py", "kvcache/formats")
LAYER_DOC = ROOT / "docs" / "architecture.md"
MAX_MODULES_PER_FOLDER = 12  # *.py files of one folder, __init__.py included
# the engine class's module plus the modules of every class it inherits from within engine/ (its mixins), in lines
ENGINE_CLASS = ("engine.llm_engine", "LLMEngine")
MAX_ENGINE_LINES = 300
# api/'s packages every endpoint may import, lowest first; an endpoint package imports no other endpoint package
API_SHARED = ("common", "engine_client")
# the one exception, named: an endpoint that is another vendor's wire format over an endpoint's conversion (the
# Anthropic Messages API converts its body into a chat body and goes through chat's one conversion, as vLLM's
# anthropic serving does over its chat serving); it may import that endpoint, nothing else may
API_WIRE_FORMATS = {"anthropic": "chat"}


def read_layers(readme: Path) -> dict[str, int]:
    """{top-level part of the package: layer number} from docs/architecture.md's table between the layer markers."""
    text = readme.read_text(encoding="utf-8")
    m = re.search(r"<!-- layers:begin -->(.*?)<!-- layers:end -->", text, re.S)
    assert m, f"{readme.name} lacks the layer table (<!-- layers:begin --> ... <!-- layers:end -->)"
    layers: dict[str, int] = {}
    for line in m.group(1).splitlines():
        row = re.match(r"\|\s*(\d+)\s*\|([^|]*)\|", line)
        if row:
            for name in re.findall(r"`([\w.]+)`", row.group(2)):
                layers[name] = int(row.group(1))
    assert layers, f"the layer table of {readme.name} has no rows"
    return layers


@functools.lru_cache(maxsize=None)
def parse_source(text: str) -> ast.Module:
    """``ast.parse(text)``, once per distinct text: several tests walk every module of the package (read only)."""
    return ast.parse(text)


def parse_file(path: Path) -> ast.Module:
    return parse_source(path.read_text(encoding="utf-8"))


def module_imports(src: Path, pkg: str) -> dict[str, set[str]]:
    """{module: modules of the package it imports}, module-level and function-level imports alike (a fresh copy:
    a caller may change it; computed once per content of the files, which five tests read)."""
    stamp = tuple((str(p), p.read_text(encoding="utf-8")) for p in sorted((src / pkg).rglob("*.py")))
    return {name: set(targets) for name, targets in _module_imports(src, pkg, stamp).items()}


@functools.lru_cache(maxsize=None)
def _module_imports(src: Path, pkg: str, stamp: tuple) -> dict[str, frozenset[str]]:
    mods: dict[str, tuple[Path, bool]] = {}
    for path in sorted((src / pkg).rglob("*.py")):
        rel = path.relative_to(src).with_suffix("")
        is_pkg = rel.name == "__init__"
        name = ".".join(rel.parent.parts if is_pkg else rel.parts)
        mods[name] = (path, is_pkg)
    graph: dict[str, frozenset[str]] = {}
    for name, (path, is_pkg) in mods.items():
        targets = set()
        for node in ast.walk(parse_file(path)):
            if isinstance(node, ast.Import):
                cands = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = name if is_pkg else name.rsplit(".", 1)[0]
                for _ in range(max(node.level - 1, 0)):
                    base = base.rsplit(".", 1)[0]
                mod = (base + ("." + node.module if node.module else "")) if node.level else (node.module or "")
                cands = [mod] + [f"{mod}.{a.name}" for a in node.names]
            else:
                continue
            for c in cands:
                if c in mods and c != name and not c.startswith(name + ".") and not name.startswith(c + "."):
                    targets.add(c)
        graph[name] = frozenset(targets)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def part_of(module: str, pkg: str) -> str:
    """The top-level part a module belongs to: ``kvkeeper.engine.scheduler`` -> ``engine``; the root -> ``kvkeeper``."""
    parts = module.split(".")
    return pkg if len(parts) == 1 else parts[1]


def layer_violations(graph: dict[str, set[str]], layers: dict[str, int], pkg: str) -> list[str]:
    """Imports of a higher layer than the importer's; parts missing from the table are reported too."""
    bad = []
    for mod, targets in sorted(graph.items()):
        p = part_of(mod, pkg)
        if p not in layers:
            bad.append(f"{mod}: its part {p!r} has no layer in the layer table")
            continue
        for t in sorted(targets):
            q = part_of(t, pkg)
            if q in layers and layers[q] < layers[p]:
                bad.append(f"{mod} (layer {layers[p]}) imports {t} (layer {layers[q]}, above it)")
    return bad


def long_functions(root: Path, limit: int) -> list[str]:
    """Functions over ``limit`` lines in the module ``root`` or in every module below the folder ``root``."""
    out = []
    for path in ([root] if root.is_file() else sorted(root.rglob("*.py"))):
        for node in ast.walk(parse_file(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    out.append(f"{path}:{node.lineno} {node.name} ({n} lines)")
    return out


# ---- the package ----------------------------------------------------------------------------


def test_no_import_cycle():
    assert find_cycles(module_imports(SRC, PKG)) == []


def test_imports_follow_the_documented_layers():
    assert layer_violations(module_imports(SRC, PKG), read_layers(LAYER_DOC), PKG) == []


def test_an_upward_import_in_the_real_package_is_caught():
    """The real table and graph: one injected upward import (the block pool importing the engine) is reported."""
    graph = module_imports(SRC, PKG)
    assert "kvkeeper.kvcache.block_pool" in graph and "kvkeeper.engine.llm_engine" in graph
    graph["kvkeeper.kvcache.block_pool"] = graph["kvkeeper.kvcache.block_pool"] | {"kvkeeper.engine.llm_engine"}
    bad = layer_violations(graph, read_layers(LAYER_DOC), PKG)
    assert bad == ["kvkeeper.kvcache.block_pool (layer 9) imports kvkeeper.engine.llm_engine (layer 4, above it)"]


def test_every_part_of_the_package_has_a_layer():
    parts = {p.name if p.is_dir() else p.stem for p in (SRC / PKG).iterdir()
             if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.stem != "__init__")}
    assert parts - set(read_layers(LAYER_DOC)) == set()


@pytest.mark.parametrize("part", SHORT_FUNCTION_DIRS)
def test_functions_are_short(part):
    assert long_functions(SRC / PKG / part, MAX_FUNCTION_LINES) == []


def package_folders(root: Path) -> list[Path]:
    """Every folder under ``root`` (``root`` included) that holds a Python module."""
    return sorted({p.parent for p in root.rglob("*.py")})


def module_count(folder: Path) -> int:
    """The modules of one folder: its ``*.py`` files, ``__init__.py`` included (not those of its subfolders)."""
    return len(list(folder.glob("*.py")))


@pytest.mark.parametrize("folder", [str(d.relative_to(SRC)) for d in package_folders(SRC / PKG)])
def test_folders_hold_at_most_12_modules(folder):
    """A folder of the package holds at most 12 modules (group more into subpackages, as api/ does by endpoint)."""
    n = module_count(SRC / folder)
    assert n <= MAX_MODULES_PER_FOLDER, f"{folder} holds {n} modules (at most {MAX_MODULES_PER_FOLDER})"


def _base_refs(tree: ast.Module, pkg: str,
               module: str) -> tuple[dict[str, ast.ClassDef], dict[str, tuple[str, str]]]:
    """A module's own classes ({name: ClassDef}) and its module-level ``from`` imports of the package ``pkg``
    ({local name: (dotted module relative to the package root, imported name)}); ``module`` is dotted, relative to
    the package root (``engine.llm_engine``)."""
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    imports: dict[str, tuple[str, str]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            parts = module.split(".")[:-node.level] + (node.module.split(".") if node.module else [])
        elif node.module and node.module.split(".")[0] == pkg:
            parts = node.module.split(".")[1:]
        else:
            continue
        for alias in node.names:
            imports[alias.asname or alias.name] = (".".join(parts), alias.name)
    return classes, imports


def inherited_modules(pkg_dir: Path, module: str, cls: str, within: str) -> list[Path]:
    """The module of class ``cls`` of ``module`` (dotted, relative to ``pkg_dir``) and the modules of every class it
    inherits from, directly or not, that live in the subpackage ``within`` (its mixins); base classes are resolved
    with ``ast`` through each module's own classes and its ``from`` imports (``Base``, ``mod.Base``)."""
    found: list[Path] = []
    todo, seen = [(module, cls)], set()
    while todo:
        mod, name = todo.pop()
        path = pkg_dir / (mod.replace(".", "/") + ".py")
        if (mod, name) in seen or not (mod == within or mod.startswith(within + ".")) or not path.is_file():
            continue
        seen.add((mod, name))
        classes, imports = _base_refs(parse_file(path), pkg_dir.name, mod)
        if name not in classes:  # re-exported here: follow the import
            todo += [imports[name]] if name in imports else []
            continue
        found += [path] if path not in found else []
        for base in classes[name].bases:
            if isinstance(base, ast.Name):
                todo.append((mod, base.id) if base.id in classes else imports.get(base.id, ("", "")))
            elif isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name) and base.value.id in imports:
                target, sub = imports[base.value.id]  # ``from . import mixins`` then ``mixins.Base``
                todo.append((f"{target}.{sub}" if target else sub, base.attr))
    return found


def test_the_engine_with_its_mixins_is_at_most_300_lines():
    """llm_engine.py plus the modules of the classes LLMEngine inherits from within engine/ (a mixin moves lines
    out of the file, not out of the engine): at most 300 lines.  The engine's KV is an object it owns (engine.kv)."""
    mods = inherited_modules(SRC / PKG, *ENGINE_CLASS, within="engine")
    assert mods and mods[0].name == "llm_engine.py"
    lines = {str(m.relative_to(SRC)): len(m.read_text(encoding="utf-8").splitlines()) for m in mods}
    assert sum(lines.values()) <= MAX_ENGINE_LINES, f"the engine is {sum(lines.values())} lines: {lines}"


def cross_endpoint_imports(graph: dict[str, set[str]], api: str, shared: tuple[str, ...],
                           wire_formats: dict[str, str] | None = None) -> list[str]:
    """Imports from one endpoint package of ``api`` (a folder below it other than ``shared``) into another, but
    those of ``wire_formats`` ({endpoint: the endpoint it converts into})."""
    def endpoint(mod: str) -> str | None:
        rest = mod[len(api) + 1:].split(".") if mod.startswith(api + ".") else []
        return rest[0] if len(rest) > 1 and rest[0] not in shared else None

    allowed = set((wire_formats or {}).items())
    return [f"{m} imports {t}" for m, targets in sorted(graph.items()) for t in sorted(targets)
            if endpoint(m) is not None and endpoint(t) is not None and endpoint(m) != endpoint(t)
            and (endpoint(m), endpoint(t)) not in allowed]


def test_api_endpoints_import_no_other_endpoint():
    """A route module takes shared helpers from api/common (or api/engine_client), never from another endpoint."""
    assert cross_endpoint_imports(module_imports(SRC, PKG), f"{PKG}.api", API_SHARED, API_WIRE_FORMATS) == []


def api_upward_imports(graph: dict[str, set[str]], api: str, order: tuple[str, ...]) -> list[str]:
    """Imports of a package of ``api`` from one later in ``order`` (lowest first) or from an endpoint package, by a
    module of a package in ``order``: the shared packages sit below the endpoints and in that order."""
    def pkg(mod: str) -> str | None:
        rest = mod[len(api) + 1:].split(".") if mod.startswith(api + ".") else []
        return rest[0] if len(rest) > 1 else None

    bad = []
    for m, targets in sorted(graph.items()):
        if pkg(m) in order:
            for t in sorted(targets):
                q = pkg(t)
                if q is not None and q != pkg(m) and (q not in order or order.index(q) > order.index(pkg(m))):
                    bad.append(f"{m} imports {t}")
    return bad


def test_api_shared_packages_import_no_endpoint():
    """api/common imports no other api package, api/engine_client only api/common."""
    assert api_upward_imports(module_imports(SRC, PKG), f"{PKG}.api", API_SHARED) == []


def test_no_repeated_code_in_the_package():
    """The library's `duplicates` tool (a machine tool, not a Python package) over all of src/kvkeeper: skipped
    where it is absent."""
    tool = shutil.which("duplicates")
    if tool is None:
        pytest.skip("the `duplicates` command is not on this machine")
    out = subprocess.run([tool, "--repo", str(SRC / PKG), "--seconds", "60"], capture_output=True, text=True,
                         timeout=120).stdout
    assert out.startswith("no duplicates"), out


def documented_modules(doc: Path) -> set[str]:
    """Module paths (relative to ``src/kvkeeper``) that docs/architecture.md's package tree names.

    The tree is the code block under ``## The package``: a line ``  folder/  ...`` opens that folder's entry, one
    indented further (``    chat/``) a subfolder of the entry above it; a line starting at the first level with
    anything else is the package root's; every ``name.py`` on an entry's lines is read as ``folder/name.py``."""
    text = doc.read_text(encoding="utf-8")
    m = re.search(r"^## The package\n.*?```\n(.*?)```", text, re.S | re.M)
    assert m, f"{doc.name} lacks the package tree (a code block under '## The package')"
    found: set[str] = set()
    stack: list[tuple[int, str]] = []  # (indent, folder path) of the entries open above this line
    folder = ""
    for line in m.group(1).splitlines():
        head = re.match(r"( {2,})(\S+/)\s", line)
        if head and not head.group(2).startswith("src/"):
            while stack and stack[-1][0] >= len(head.group(1)):
                stack.pop()
            folder = (stack[-1][1] if stack else "") + head.group(2)
            stack.append((len(head.group(1)), folder))
        elif re.match(r"  \S", line):
            stack, folder = [], ""
        found |= {folder + name + ".py" for name in re.findall(r"\b(\w+)\.py\b", line)}
    return found


def package_modules(pkg_dir: Path) -> set[str]:
    return {p.relative_to(pkg_dir).as_posix() for p in pkg_dir.rglob("*.py") if p.name != "__init__.py"}


def test_every_module_is_listed_in_the_architecture_page():
    missing = package_modules(SRC / PKG) - documented_modules(LAYER_DOC)
    assert missing == set(), f"add these modules to docs/architecture.md's package tree: {sorted(missing)}"


# ---- the checks themselves can fail -----------------------------------------------------------


def _fake_package(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp_path / "fake" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path


def test_an_upward_import_inside_a_function_is_caught(tmp_path):
    src = _fake_package(tmp_path, {
        "__init__.py": "",
        "engine/__init__.py": "",
        "engine/core.py": "def f():\n    from ..sessions.manager import M\n    return M\n",
        "sessions/__init__.py": "",
        "sessions/manager.py": "from ..engine.core import f\nM = 1\n",
    })
    graph = module_imports(src, "fake")
    assert graph["fake.engine.core"] == {"fake.sessions.manager"}
    assert find_cycles(graph) == [["fake.engine.core", "fake.sessions.manager"]]
    bad = layer_violations(graph, {"fake": 1, "sessions": 2, "engine": 3}, "fake")
    assert bad == ["fake.engine.core (layer 3) imports fake.sessions.manager (layer 2, above it)"]
    missing = layer_violations(graph, {"fake": 1, "sessions": 2}, "fake")
    assert "fake.engine.core: its part 'engine' has no layer in the layer table" in missing


def test_a_long_function_is_caught(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    src = _fake_package(tmp_path, {"mod.py": "def long():\n" + body + "    return 0\n"})
    assert len(long_functions(src, MAX_FUNCTION_LINES)) == 1


def test_a_crowded_folder_is_caught(tmp_path):
    src = _fake_package(tmp_path, {f"api/m{i}.py": "" for i in range(MAX_MODULES_PER_FOLDER)} | {
        "api/__init__.py": "", "api/chat/__init__.py": "", "api/chat/route.py": "", "__init__.py": ""})
    assert [str(d.relative_to(src)) for d in package_folders(src / "fake")] == ["fake", "fake/api", "fake/api/chat"]
    assert module_count(src / "fake" / "api") == MAX_MODULES_PER_FOLDER + 1  # over: the real test fails on it
    assert module_count(src / "fake" / "api" / "chat") == 2


def test_an_engine_mixin_is_counted(tmp_path):
    src = _fake_package(tmp_path, {
        "__init__.py": "", "engine/__init__.py": "", "kvcache/__init__.py": "",
        "engine/core.py": "from .kv_mixin import KVMixin as Mixin\nfrom . import more\n"
                          "from ..kvcache.base import Outside\nfrom fake.engine.stats import Stats\n"
                          "class Local:\n    pass\n"
                          "class Engine(Mixin, more.More, Local, Outside, Stats, object):\n    pass\n",
        "engine/kv_mixin.py": "from .deep import Deep\nclass KVMixin(Deep):\n    pass\n",
        "engine/deep.py": "class Deep:\n    pass\n",
        "engine/more.py": "class More:\n    pass\n",
        "engine/stats.py": "class Stats:\n    pass\n",
        "engine/unused.py": "class Unused:\n    pass\n",
        "kvcache/base.py": "class Outside:\n    pass\n",
    })
    got = inherited_modules(src / "fake", "engine.core", "Engine", within="engine")
    assert sorted(p.name for p in got) == ["core.py", "deep.py", "kv_mixin.py", "more.py", "stats.py"]
    assert got[0].name == "core.py"
    alone = _fake_package(tmp_path / "alone", {"engine/core.py": "class Engine:\n    pass\n"})
    assert [p.name for p in inherited_modules(alone / "fake", "engine.core", "Engine", "engine")] == ["core.py"]


def test_an_import_between_endpoints_is_caught(tmp_path):
    src = _fake_package(tmp_path, {
        "__init__.py": "", "api/__init__.py": "", "api/common/__init__.py": "", "api/common/rules.py": "",
        "api/chat/__init__.py": "",
        "api/chat/route.py": "from ..common.rules import x\nfrom ..completions.route import y\n",
        "api/completions/__init__.py": "", "api/completions/route.py": "from ..common import rules\n",
    })
    assert cross_endpoint_imports(module_imports(src, "fake"), "fake.api", API_SHARED) == [
        "fake.api.chat.route imports fake.api.completions.route"]
    # a named wire format may import the endpoint it converts into, and only that one, only that way round
    assert cross_endpoint_imports(module_imports(src, "fake"), "fake.api", API_SHARED, {"chat": "completions"}) == []
    assert cross_endpoint_imports(module_imports(src, "fake"), "fake.api", API_SHARED, {"completions": "chat"}) != []


def test_an_upward_import_in_api_is_caught(tmp_path):
    src = _fake_package(tmp_path, {
        "__init__.py": "", "api/__init__.py": "", "api/common/__init__.py": "",
        "api/common/rules.py": "from ..engine_client.loop import L\n",
        "api/engine_client/__init__.py": "", "api/engine_client/loop.py": "from ..common.rules import x\nL = 1\n",
        "api/chat/__init__.py": "", "api/chat/route.py": "",
        "api/engine_client/hook.py": "from ..chat.route import y\n",
    })
    assert api_upward_imports(module_imports(src, "fake"), "fake.api", API_SHARED) == [
        "fake.api.common.rules imports fake.api.engine_client.loop",
        "fake.api.engine_client.hook imports fake.api.chat.route"]


def test_the_layer_table_is_read(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("x\n<!-- layers:begin -->\n| layer | parts |\n|---|---|\n| 1 | `api`, `cli` |\n| 2 | `engine` |\n"
                      "<!-- layers:end -->\n")
    assert read_layers(readme) == {"api": 1, "cli": 1, "engine": 2}


def llm_engine_calls(root: Path, allowed: Path) -> list[str]:
    """``LLMEngine(...)`` calls (by name or attribute) in the Python files under root, as 'path:line'."""
    calls = []
    for p in sorted(root.rglob("*.py")):
        text = p.read_text(encoding="utf-8")
        if p == allowed or "LLMEngine" not in text:  # no such name, no such call: not parsed
            continue
        for node in ast.walk(parse_source(text)):
            f = node.func if isinstance(node, ast.Call) else None
            if (isinstance(f, ast.Name) and f.id == "LLMEngine") or (isinstance(f, ast.Attribute) and
                                                                     f.attr == "LLMEngine"):
                calls.append(f"{p.relative_to(root)}:{node.lineno}")
    return calls


def test_tests_build_their_engines_through_make_engine(tmp_path):
    """Every in-process engine of the suite gets its two defaults (float32 weights, validators every step) from
    tests/utils/engines.py's make_engine; an engine built directly in a test file would silently run without them."""
    tests = ROOT / "tests"
    calls = llm_engine_calls(tests, tests / "utils" / "engines.py")
    assert calls == [], f"build engines with tests.utils.engines.make_engine(...), not LLMEngine(...): {calls}"
    (tmp_path / "test_x.py").write_text("import kvkeeper\nLLMEngine(1)\n# LLMEngine(\nkvkeeper.LLMEngine()\n")
    assert llm_engine_calls(tmp_path, tests / "utils" / "engines.py") == ["test_x.py:2", "test_x.py:4"]


def test_a_module_missing_from_the_architecture_page_is_caught(tmp_path):
    doc = tmp_path / "architecture.md"
    doc.write_text("# A\n\n## The package\n\n```\nsrc/kvkeeper/\n  api/            app.py\n    chat/         route.py (the route),\n"
                   "                  serving.py\n  errors.py       errors\n```\n")
    pkg = _fake_package(tmp_path, {"__init__.py": "", "errors.py": "", "api/__init__.py": "",
                                   "api/chat/__init__.py": "", "api/chat/route.py": "", "api/chat/serving.py": "",
                                   "api/chat/protocol.py": ""}) / "fake"
    assert documented_modules(doc) == {"api/app.py", "api/chat/route.py", "api/chat/serving.py", "errors.py"}
    assert package_modules(pkg) - documented_modules(doc) == {"api/chat/protocol.py"}
