"""Who may run the model and who may touch the KV tensors, read with ``ast`` from every module.

* The model runs in one place: :meth:`kvkeeper.worker.runner.ModelRunner.forward` (plus the runner's own
  execution paths, the fused C++ decode step and the CUDA graphs, and the model / layer classes calling
  their submodules).  Elsewhere, calling ``*.model(...)``, ``*.model.forward(...)``, ``*.compute_logits(...)``
  or even reading ``*.runner.model`` is a violation.
* The per-layer KV tensors belong to :class:`kvkeeper.kvcache.store.KVStore`.  Outside ``kvcache/`` (and the
  code that must read one layer's cache inside the forward pass: attention kernels, layers, models, the
  worker, the C++ kernels' loader) no module reads ``.kv_caches``, a cache's ``.k_scale`` / ``.v_scale``, a
  cache object's ``.k`` / ``.v`` (an expression naming a cache, a KV or a layer of the store), or builds a
  ``PagedKV`` itself.
* Outside ``engine/``, ``worker/`` and ``spec_decode/`` no module reads an engine's ``.runner`` (any ``.runner``:
  the engine's model runner is the only one), an engine's ``.pool`` or its KV manager ``.manager`` (an expression
  naming an engine: ``engine.pool``, ``engine.kv.pool``, ``engine.kv.manager``); they call the engine's methods
  (:class:`kvkeeper.engine.handle.EngineHandle`) and its KV's (``engine.kv``,
  :class:`kvkeeper.engine.handle.KVHandle`), ``engine.kv.store`` for the KV tensors.
* A layer of the store is the store's own: outside ``kvcache/`` and the forward-pass parts no module calls
  ``.layer(i)`` on a store (``store.layer(i).write(...)``, ``engine.kv.store.layer(i).anything(...)``); it calls
  the store's methods, which take the layer index.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG_DIR = ROOT / "src" / "kvkeeper"

# where the model's forward may be called: the runner, its own execution paths, the model / layer classes
MODEL_CALL_ALLOWED = ("worker/runner.py", "worker/fused_decode.py", "worker/cuda_graphs.py", "models/", "layers/")
# where a layer's KV tensors may be touched: their owner and the code that reads a layer's cache in the forward
KV_TENSOR_ALLOWED = ("kvcache/", "attention/", "layers/", "models/", "worker/", "kernels/")
# where an engine's runner and block pool may be read: the engine itself, the worker, speculative decoding; the
# pool's own layer (kvcache/: its validators and block map read the pool they check); the fault injectors, whose
# job is to break the engine's internals on purpose (diagnostics/faults.py: tests only)
ENGINE_INSIDE_ALLOWED = ("engine/", "worker/", "spec_decode/", "kvcache/", "diagnostics/faults.py")

_SCALE_ATTRS = {"k_scale", "v_scale"}
_CACHE_LIKE = re.compile(r"cache|kv|layer\(", re.I)
_ENGINE_LIKE = re.compile(r"(^|[._])eng(ine)?$|engine", re.I)
_STORE_LIKE = re.compile(r"store|kv", re.I)


def _allowed(rel: str, allow: tuple[str, ...]) -> bool:
    return any(rel == a or (a.endswith("/") and rel.startswith(a)) for a in allow)


def _chain_has(node: ast.AST, name: str) -> bool:
    """Whether an attribute chain (``a.b.c``) names ``name`` anywhere in it."""
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        if isinstance(node, ast.Attribute) and node.attr == name:
            return True
        node = node.value if not isinstance(node, ast.Call) else node.func
    return isinstance(node, ast.Name) and node.id == name


def model_calls(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) for every model forward call or runner.model access in a module's tree."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if f.attr == "model":
                out.append((node.lineno, f"{ast.unparse(f)}(...)"))
            elif f.attr == "forward" and _chain_has(f.value, "model"):
                out.append((node.lineno, f"{ast.unparse(f)}(...)"))
            elif f.attr == "compute_logits":
                out.append((node.lineno, f"{ast.unparse(f)}(...)"))
        if isinstance(node, ast.Attribute) and node.attr == "model" and _chain_has(node.value, "runner"):
            out.append((node.lineno, ast.unparse(node)))
    return sorted(set(out))


def kv_tensor_accesses(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) for every direct access of the KV tensors in a module's tree."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            base = ast.unparse(node.value)
            if node.attr == "kv_caches" or node.attr in _SCALE_ATTRS:
                out.append((node.lineno, ast.unparse(node)))
            elif node.attr in ("k", "v") and _CACHE_LIKE.search(base):
                out.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name == "PagedKV":
                out.append((node.lineno, "PagedKV(...)"))
    return sorted(set(out))


def engine_reach_ins(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) for every ``.runner`` (on anything) and every ``.pool`` or ``.manager`` (the KV manager behind
    ``engine.kv``) of an expression naming an engine."""
    return sorted({(n.lineno, ast.unparse(n)) for n in ast.walk(tree)
                   if isinstance(n, ast.Attribute) and (n.attr == "runner" or (
                       n.attr in ("pool", "manager") and _ENGINE_LIKE.search(ast.unparse(n.value))))})


def store_layer_calls(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) for every ``.layer(...)`` call on an expression naming a store or a KV (a layer's handle taken
    from the store: ``store.layer(i).write(...)``, ``layer = engine.kv.store.layer(i)``)."""
    return sorted({(n.lineno, ast.unparse(n)) for n in ast.walk(tree)
                   if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "layer"
                   and _STORE_LIKE.search(ast.unparse(n.func.value))})


def violations(pkg_dir: Path) -> list[str]:
    """Every breach of the four rules in the package under ``pkg_dir``, as 'path:line: what (rule)'."""
    bad = []
    for path in sorted(pkg_dir.rglob("*.py")):
        rel = path.relative_to(pkg_dir).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if not _allowed(rel, MODEL_CALL_ALLOWED):
            bad += [f"{rel}:{line}: {what} (the model runs only in ModelRunner.forward)"
                    for line, what in model_calls(tree)]
        if not _allowed(rel, KV_TENSOR_ALLOWED):
            bad += [f"{rel}:{line}: {what} (KV tensors belong to kvcache.store.KVStore)"
                    for line, what in kv_tensor_accesses(tree)]
            bad += [f"{rel}:{line}: {what} (a store's layers are the store's: call its methods)"
                    for line, what in store_layer_calls(tree)]
        if not _allowed(rel, ENGINE_INSIDE_ALLOWED):
            bad += [f"{rel}:{line}: {what} (outside the engine, call the engine's methods and engine.kv's)"
                    for line, what in engine_reach_ins(tree)]
    return bad


def test_the_model_runs_only_in_the_runner_and_only_kvcache_owns_the_kv_tensors():
    assert violations(PKG_DIR) == []


# ---- the checks themselves can fail -----------------------------------------------------------


def _fake_package(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp_path / "fake" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path / "fake"


def test_a_model_call_outside_the_runner_is_caught(tmp_path):
    pkg = _fake_package(tmp_path, {
        "__init__.py": "",
        "eval/ppl.py": "def f(runner, ids, pos, meta):\n"
                       "    h = runner.model(ids, pos, None, meta)\n"
                       "    return runner.model.compute_logits(h)\n",
        "engine/core.py": "def g(self, x):\n    m = self.runner.model\n    return m.forward(x)\n",
        "worker/runner.py": "class R:\n    def forward(self, x):\n        return self.model.compute_logits(self.model(x))\n",
    })
    bad = violations(pkg)
    assert any(b.startswith("eval/ppl.py:2: runner.model(...)") for b in bad), bad
    assert any(b.startswith("eval/ppl.py:3: runner.model.compute_logits(...)") for b in bad), bad
    assert any(b.startswith("engine/core.py:2: self.runner.model") for b in bad), bad
    assert not any(b.startswith("worker/") for b in bad), bad  # the allow-list holds


def test_a_kv_tensor_access_outside_kvcache_is_caught(tmp_path):
    pkg = _fake_package(tmp_path, {
        "__init__.py": "",
        "sessions/offload.py": "def f(engine, i):\n"
                               "    for cache in engine.runner.kv_caches:\n"
                               "        yield cache.k, cache.v_scale\n"
                               "    yield engine.kv.store.layer(i).v\n",
        "diagnostics/audit.py": "from ..kvcache.formats.base import PagedKV\n"
                                "def g(args):\n    return PagedKV(1, 2, 3, 4, None), args.k\n",
        "kvcache/formats/base.py": "class PagedKV:\n    def nbytes(self):\n        return self.k.nbytes + self.k_scale.nbytes\n",
    })
    bad = violations(pkg)
    for want in ("sessions/offload.py:2: engine.runner.kv_caches", "sessions/offload.py:3: cache.k ",
                 "sessions/offload.py:3: cache.v_scale", "sessions/offload.py:4: engine.kv.store.layer(i).v",
                 "sessions/offload.py:2: engine.runner (outside", "diagnostics/audit.py:3: PagedKV(...)"):
        assert any(b.startswith(want) for b in bad), (want, bad)
    assert not any("args.k" in b for b in bad), bad  # .k of something that is no cache is no KV access
    assert not any(b.startswith("kvcache/") for b in bad), bad


def test_an_engine_reach_in_outside_the_engine_is_caught(tmp_path):
    pkg = _fake_package(tmp_path, {
        "__init__.py": "",
        "eval/ppl.py": "def f(engine, eng):\n"
                       "    r = engine.runner\n"
                       "    n = eng.pool.num_free\n"
                       "    return self.engine.pool.evictions, r\n"
                       "def g(engine, sessions):\n"
                       "    engine.kv.manager.allocate(None, 1)\n"
                       "    return engine.kv.pool.num_free, sessions.manager, engine.kv.free(None)\n",
        "api/admin.py": "async def g(request):\n"
                        "    return await request.app.state.engine.call(lambda eng: eng.pool.evict_cached())\n",
        "sessions/fork.py": "def h(engine, seq):\n    return engine.fork_kv(seq), seq.pool\n",
        "engine/core.py": "def k(self):\n    return self.runner.kv_store, self.pool\n",
        "worker/runner.py": "def m(engine):\n    return engine.pool\n",
        "spec_decode/verify.py": "def n(engine):\n    return engine.runner\n",
    })
    bad = violations(pkg)
    for want in ("eval/ppl.py:2: engine.runner (outside", "eval/ppl.py:3: eng.pool (outside",
                 "eval/ppl.py:4: self.engine.pool (outside", "api/admin.py:2: eng.pool (outside",
                 "eval/ppl.py:6: engine.kv.manager (outside", "eval/ppl.py:7: engine.kv.pool (outside"):
        assert any(b.startswith(want) for b in bad), (want, bad)
    assert not any("sessions.manager" in b or "kv.free" in b for b in bad), bad  # no engine's manager; engine.kv
    assert not any(b.startswith("sessions/") for b in bad), bad  # seq.pool names no engine
    assert not any(b.startswith(("engine/", "worker/", "spec_decode/")) for b in bad), bad  # the allow-list holds


def test_a_store_layer_call_outside_kvcache_is_caught(tmp_path):
    pkg = _fake_package(tmp_path, {
        "__init__.py": "",
        "eval/intervention.py": "def f(store, engine, k, v, slots, i):\n"
                                "    store.layer(i).write(k, v, slots)\n"
                                "    engine.kv.store.layer(i).copy_tokens(slots, slots)\n"
                                "    lay = engine.kv.store.layer(0)\n"
                                "    return model.layer(i), lay\n",
        "kvcache/surgery.py": "def g(store, i, k, v, s):\n    store.layer(i).write(k, v, s)\n",
        "attention/cpu.py": "def h(kv_store, i):\n    return kv_store.layer(i).read_slots(None)\n",
    })
    bad = violations(pkg)
    for want in ("eval/intervention.py:2: store.layer(i) (a store's", "eval/intervention.py:3: engine.kv.store.layer(i)",
                 "eval/intervention.py:4: engine.kv.store.layer(0)"):
        assert any(b.startswith(want) for b in bad), (want, bad)
    assert not any("model.layer" in b for b in bad), bad  # a layer of something that is no store
    assert not any(b.startswith(("kvcache/", "attention/")) for b in bad), bad  # the allow-list holds
