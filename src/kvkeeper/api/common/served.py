"""What the server serves, as the engine thread last published it: the handlers' only view of the engine.

The engine thread builds a :class:`ServedModels` (frozen) when the
:class:`~kvkeeper.api.engine_client.async_engine.AsyncEngine` is made and again after every command that may change
it (loading or unloading a LoRA adapter); handlers read ``AsyncEngine.served`` and never the engine itself, whose
attributes the engine thread may be changing.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...kvcache.namespace import Namespace
from .errors import APIError
from ...engine.handle import EngineHandle


@dataclass(frozen=True)
class ServedAdapter:
    """A loaded LoRA adapter: the ``model`` name requests select it by, its directory, its id (content hash)."""

    name: str
    path: str
    id: str


@dataclass(frozen=True)
class ServedModels:
    """The served model and its LoRA adapters.

    name: the id clients send as ``model`` (or omit).  root: the model's directory (or its name).
    max_model_len: the context window (tokens).  vocab_size: token ids are ``0..vocab_size-1`` (None: a
    stand-in engine without a model config).  namespace: the engine's default KV cache namespace.
    adapters: the loaded LoRA adapters, sorted by name.
    """

    name: str
    root: str
    max_model_len: int
    vocab_size: int | None
    namespace: Namespace
    adapters: tuple[ServedAdapter, ...] = ()

    @classmethod
    def of(cls, engine: EngineHandle, name: str | None = None) -> "ServedModels":
        """The snapshot of ``engine`` (an LLMEngine or a stand-in), served as ``name`` (default its model name).
        Call on the engine thread (or before it starts)."""
        mcfg = getattr(engine, "model_config", None)
        loras = getattr(engine, "loras", {})
        adapters = tuple(ServedAdapter(n, str(a.path), a.id) for n, a in sorted(loras.items()))
        name = name or engine.model_name
        return cls(name, str(getattr(engine, "model_path", name)), engine.context_length,
                   getattr(mcfg, "vocab_size", None), engine.namespace, adapters)

    def adapter(self, model: str | None) -> ServedAdapter | None:
        """The adapter a request's ``model`` selects (None: omitted or the served model's id); 404 naming the
        served ids for anything else."""
        if model is None or model == self.name:
            return None
        for a in self.adapters:
            if a.name == model:
                return a
        names = ", ".join([repr(self.name)] + [repr(a.name) for a in self.adapters])
        raise APIError(404, f"the model {model!r} does not exist; this server serves {names} (LoRA adapters "
                            "by their names)", type="not_found_error", param="model", code="model_not_found")
