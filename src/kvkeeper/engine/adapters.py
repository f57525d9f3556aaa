"""The LoRA adapter registry of an engine: load, list, unload, and the adapter a request runs under.

Adapters are PEFT directories read by :mod:`kvkeeper.layers.lora`.  Each has a content id
(``LoRAAdapter.id``) that goes into the cache namespace (:class:`~kvkeeper.kvcache.namespace.Namespace`
``adapter``), so KV computed under one adapter is never reused under another, nor under a reloaded one.
"""

from __future__ import annotations

import dataclasses

from ..errors import InvalidRequestError
from ..kvcache.namespace import Namespace
from ..layers.lora import LoRAAdapter, load_adapter
from ..models.registry import capabilities


class AdapterRegistry:
    """The loaded adapters of one runner (``loaded``: name -> :class:`LoRAAdapter`).

    base_name: the base model's name (no adapter may take it); runner: the
    :class:`~kvkeeper.worker.runner.ModelRunner` whose model the adapters apply to.
    """

    def __init__(self, base_name: str | None, runner):
        self.base_name = base_name
        self.runner = runner
        self.loaded: dict[str, LoRAAdapter] = {}

    def load(self, name: str, path, replace: bool = False) -> LoRAAdapter:
        """Load the adapter directory ``path`` under ``name`` (call between steps).  Raises
        :class:`InvalidRequestError` for a name already loaded (without ``replace``), the base model's
        name, a model family without LoRA, or an adapter that cannot be read or does not fit the model."""
        if name in self.loaded and not replace:
            raise InvalidRequestError(f"the LoRA adapter {name!r} has already been loaded; unload it first",
                                      param="lora_name")
        if name == self.base_name:
            raise InvalidRequestError(f"{name!r} is the base model's name; give the adapter another name",
                                      param="lora_name")
        caps = capabilities(self.runner.cfg)
        if not caps.lora:
            raise InvalidRequestError(f"LoRA adapters apply to Llama-family models; {caps.refusal('lora')}")
        adapter = load_adapter(name, path, self.runner.cfg, self.runner.device, self.runner.dtype)
        self.runner.enable_lora()
        self.loaded[name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        """Forget the adapter ``name``; raises InvalidRequestError when none of that name is loaded."""
        if self.loaded.pop(name, None) is None:
            raise InvalidRequestError(f"the LoRA adapter {name!r} cannot be found", param="lora_name")

    def namespace(self, name: str, base: Namespace) -> Namespace:
        """``base`` under the loaded adapter ``name``; raises InvalidRequestError naming it when it is not
        loaded."""
        if name not in self.loaded:
            raise InvalidRequestError(f"the LoRA adapter {name!r} is not loaded (loaded: "
                                      f"{', '.join(sorted(self.loaded)) or 'none'})", param="model")
        return dataclasses.replace(base, adapter=self.loaded[name].id)

    def resolve(self, namespace: Namespace, lora: str | None) -> tuple[Namespace, LoRAAdapter | None]:
        """(namespace, adapter or None) of a request: ``lora`` names an adapter, or the namespace's
        ``adapter`` is a loaded adapter's id.  Raises InvalidRequestError for an adapter that is not loaded
        and for a ``lora`` that conflicts with the namespace's adapter."""
        if lora is not None:
            wanted = self.namespace(lora, namespace)
            if namespace.adapter and namespace.adapter != wanted.adapter:
                raise InvalidRequestError(f"lora={lora!r} conflicts with the namespace's adapter "
                                          f"{namespace.adapter!r}", param="lora")
            namespace = wanted
        if not namespace.adapter:
            return namespace, None
        for a in self.loaded.values():
            if a.id == namespace.adapter:
                return namespace, a
        raise InvalidRequestError(f"the LoRA adapter {namespace.adapter!r} is not loaded (unloaded or replaced)",
                                  param="model")
