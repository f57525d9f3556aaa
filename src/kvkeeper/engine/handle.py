"""The engine's boundary with the layers above it: what they may call on an engine (:class:`EngineHandle`), and
what the engine calls on what holds KV between requests (:class:`KVHolder`, a session manager; :class:`KVHolders`:
the engine asks them to release blocks under pressure, the scheduler's ``reclaim``, and lists their blocks for the
validators and telemetry).

What the layers above the engine (sessions/, diagnostics/, eval/, cli/, api/, cluster/) may call on an engine:

:class:`EngineHandle` is a :class:`typing.Protocol`: :class:`~kvkeeper.engine.llm_engine.LLMEngine` satisfies it
structurally, and every ``engine`` parameter above the engine is annotated with it.  Its model runner and block pool
are not part of it (``tests/test_ownership.py`` refuses ``engine.runner`` and ``engine.pool`` outside engine/,
worker/ and spec_decode/); the KV tensors are reached through ``kv_store``.  ``kv`` (the KV manager) and
``scheduler`` are still read by a few evaluations and telemetry (block allocation for an evaluation's own sequence,
preemption counts).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Protocol

import torch

from ..kvcache.compression import KVCompression
from ..kvcache.manager import KVCacheManager
from ..kvcache.namespace import Namespace
from ..kvcache.store import KVStore
from ..kvcache.telemetry import PoolStats
from ..model_config import ModelConfig
from ..sampling.params import SamplingParams
from .config import EngineConfig
from .input_processor import InputProcessor
from .outputs import RequestOutput
from .scheduler import Scheduler
from .sequence import Sequence


class KVHolder(Protocol):
    """Something that holds KV blocks between requests (``kvkeeper.sessions.SessionManager``)."""

    def kv_holdings(self) -> Iterable[tuple[str, Sequence]]:
        """(owner name, sequence) for every block table it holds."""

    def reclaim(self, n_blocks: int) -> int:
        """Release about ``n_blocks`` pool blocks (offload or unpin idle state); returns how many it released."""

    def offloaded_blocks(self) -> int:
        """Blocks' worth of KV it keeps outside the pool (host memory, disk)."""


class KVHolders(list):
    """The registered holders, in registration order (a list of :class:`KVHolder`)."""

    def reclaim(self, n_blocks: int) -> int:
        """Ask the holders, in order, to release about ``n_blocks`` pool blocks; returns how many they released."""
        freed = 0
        for h in self:
            if freed >= n_blocks:
                break
            freed += h.reclaim(n_blocks - freed)
        return freed

    def kv_holdings(self) -> Iterator[tuple[str, Sequence]]:
        """(owner name, sequence) of every holder's block tables (``session:<id>``)."""
        for h in self:
            yield from h.kv_holdings()

    def offloaded_blocks(self) -> int:
        """Blocks' worth of KV the holders keep outside the pool (host memory and disk tiers)."""
        return sum(h.offloaded_blocks() for h in self)


class EngineHandle(Protocol):
    """An engine as the layers above see it (shapes and errors: the methods of :class:`LLMEngine`)."""

    config: EngineConfig
    model_config: ModelConfig
    model_name: str
    tokenizer: Any
    inputs: InputProcessor  # rendering and checks (thread-safe): render_prompt, encode_rendered, ...
    namespace: Namespace
    context_length: int  # tokens
    block_size: int  # tokens per KV block
    loras: dict
    eos_token_ids: set[int]
    kv_events: Any  # the KV event publisher, None when off
    memory_estimate: Any
    step_hooks: list[Callable[[], object]]
    first_token_hooks: list[Callable[[Sequence, torch.Tensor], None]]
    capture_first_logits: bool
    holders: list[KVHolder]  # the registered KV holders (a server checks it wires one engine once)
    kv: KVCacheManager  # an evaluation's own sequence: allocate, free, release_out_of_window
    scheduler: Scheduler  # counters (preemptions, running, waiting)

    # ---- requests and the step loop
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, namespace: Namespace | None = None,
                    compression: KVCompression | None = None, *, strict_max_tokens: bool = False,
                    max_new_tokens: int | None = None, lora: str | None = None) -> Sequence: ...
    def has_request(self, request_id: str) -> bool: ...
    def abort(self, request_id: str) -> None: ...
    def has_unfinished(self) -> bool: ...
    def step(self) -> list[Sequence]: ...
    def run_until_done(self, seqs: list[Sequence]) -> None: ...
    def generate(self, prompts: list, params=None, namespace: Namespace | None = None,
                 compression: KVCompression | None = None, lora=None) -> list[RequestOutput]: ...

    # ---- prompts, adapters, namespaces
    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **chat) -> list[int]: ...
    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **chat) -> str: ...
    def load_lora(self, name: str, path, replace: bool = False): ...
    def unload_lora(self, name: str) -> None: ...
    def lora_namespace(self, name: str, base: Namespace | None = None) -> Namespace: ...
    def isolated_namespace(self, tag: str = "", base: Namespace | None = None) -> Namespace: ...

    # ---- the model outside the scheduler (evaluations, audits, session compression)
    def write_kv_outside_scheduler(self, seq: Sequence, n: int, logits: str = "none") -> torch.Tensor | None: ...
    def prefill_private(self, ids: torch.Tensor, positions: torch.Tensor, chunk: int = 512, logits: str = "none",
                        num_layers: int | None = None, lora=None) -> tuple[torch.Tensor | None, KVStore]: ...
    @property
    def numerics(self) -> dict: ...
    @property
    def speculation_supported(self) -> bool: ...
    def describe(self) -> str: ...
    def stats(self) -> dict: ...

    # ---- KV: holders, the store, blocks, figures (kvkeeper.engine.kv_access)
    @property
    def kv_store(self) -> KVStore: ...
    @property
    def kv_bytes_per_token(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def num_evictions(self) -> int: ...
    def require_uniform_kv(self, what: str) -> None: ...
    def add_kv_holder(self, holder: KVHolder) -> None: ...
    def reclaim(self, n_blocks: int) -> int: ...
    def kv_holdings(self) -> Iterator[tuple[str, Sequence]]: ...
    def offloaded_blocks(self) -> int: ...
    def compact(self, evict_cache: bool = False) -> dict: ...
    def evict_cached(self) -> int: ...
    def free_kv(self, seq: Sequence) -> None: ...
    def truncate_kv(self, seq: Sequence, num_tokens: int) -> None: ...
    def commit_kv(self, seq: Sequence) -> None: ...
    def compress_prompt_kv(self, seq: Sequence) -> bool: ...
    def allocate_kv_blocks(self, n: int) -> list[int] | None: ...
    def share_kv_blocks(self, block_ids: list[int]) -> list[int]: ...
    def free_kv_blocks(self, block_ids: list[int]) -> None: ...
    def shared_kv_blocks(self, block_ids: list[int]) -> list[int]: ...
    def pool_stats(self) -> PoolStats: ...
