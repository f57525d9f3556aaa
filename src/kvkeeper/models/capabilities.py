"""What a model family supports: one declaration per family class, read through the registry.

Each family class (:class:`~kvkeeper.models.llama.LlamaForCausalLM` and its subclasses) carries a
``capabilities`` class attribute; :func:`kvkeeper.models.registry.capabilities` returns the one of a
configuration's architecture.  Code that depends on the family asks for a capability here instead of
naming an architecture:

==========================  =========================================================================
``kv_layout``               "standard" (K and V per KV head), "latent" (one MLA latent row per token) or
                            "hybrid" (sliding-window layers, next to full ones or all of them)
``weight_formats``          the ``--quantization`` formats it runs ("none", "int8", "int4", "gguf")
``attention_backends``      the attention backends it runs; None: every one ("auto" picks among them)
``kv_compression``          prompt KV compression (:mod:`kvkeeper.kvcache.compression`) applies
``fused_decode``            the fused C++ decode step (:mod:`kvkeeper.worker.fused_decode`) runs its layers
``cuda_graphs``             decode steps may be captured as CUDA graphs (:mod:`kvkeeper.worker.cuda_graphs`)
``lora``                    LoRA adapters (:mod:`kvkeeper.layers.lora`) apply to its projections
``gguf_permuted_qk``        llama.cpp's converter permuted its q/k rows (undone when reading a GGUF file)
``gguf_in_place``           a GGUF file's matrices run in place over the file's memory map
                            (:mod:`kvkeeper.layers.gguf_linear`) instead of dequantized at load
==========================  =========================================================================

``why_not`` explains, per capability name, why a family lacks it; refusals quote it (:meth:`Capabilities.refusal`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

KV_LAYOUTS = ("standard", "latent", "hybrid")
WEIGHT_FORMATS = ("none", "int8", "int4", "gguf")


@dataclass(frozen=True)
class Capabilities:
    """One family's declaration (see the module docstring for each field)."""

    family: str
    kv_layout: str = "standard"
    weight_formats: tuple[str, ...] = WEIGHT_FORMATS
    attention_backends: tuple[str, ...] | None = None
    kv_compression: bool = True
    fused_decode: bool = True
    cuda_graphs: bool = True
    lora: bool = True
    gguf_permuted_qk: bool = False
    gguf_in_place: bool = False
    why_not: dict[str, str] = field(default_factory=dict, hash=False)

    def __post_init__(self):
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout {self.kv_layout!r}: choose one of {', '.join(KV_LAYOUTS)}")
        unknown = set(self.weight_formats) - set(WEIGHT_FORMATS)
        if unknown or "none" not in self.weight_formats:
            raise ValueError(f"weight_formats {self.weight_formats}: a subset of {WEIGHT_FORMATS} with 'none'")

    def refusal(self, capability: str) -> str:
        """Why this family lacks ``capability`` (a field name): its ``why_not`` entry, else
        "<family> models"."""
        return self.why_not.get(capability, f"{self.family} models")

    def replace(self, **changes) -> "Capabilities":
        """A copy with ``changes`` (for a subclass that differs in a field or two)."""
        return dataclasses.replace(self, **changes)
