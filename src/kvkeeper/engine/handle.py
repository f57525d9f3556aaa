"""The engine's boundary with the layers above it: what they may call on an engine (:class:`EngineHandle`) and on
its KV (:class:`KVHandle`, ``engine.kv``), and what the engine calls on what holds KV between requests
(:class:`KVHolder`, a session manager; :class:`KVHolders`: the engine asks them to release blocks under pressure,
the scheduler's ``reclaim``, and lists their blocks for the validators and telemetry).

What the layers above the engine (sessions/, diagnostics/, eval/, cli/, api/, cluster/) may call on an engine:

:class:`EngineHandle` is a :class:`typing.Protocol`: :class:`~kvkeeper.engine.llm_engine.LLMEngine` satisfies it
structurally, and every ``engine`` parameter above the engine is annotated with it.  Its KV is one object,
``engine.kv`` (:class:`~kvkeeper.engine.kv_access.KVAccess`, typed here by :class:`KVHandle`): the KV store, the KV
holders, sequences' KV, blocks held outside sequences, compaction and pool figures.  The model runner, the block
pool and the KV manager are not part of either (``tests/test_ownership.py`` refuses ``engine.runner``,
``engine.pool`` and ``engine.kv.manager`` outside engine/, worker/ and spec_decode/); the KV tensors are reached
through ``engine.kv.store``.  ``scheduler`` is still read by telemetry (preemption counts).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Protocol

import torch

from ..kvcache.compression import KVCompression
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


class KVHandle(Protocol):
    """An engine's KV as the layers above see it (``engine.kv``; shapes and errors: the methods of
    :class:`~kvkeeper.engine.kv_access.KVAccess`).  Sizes in blocks and bytes; block ids index the pool."""

    holders: list[KVHolder]  # the registered KV holders (a server checks it wires one engine once)

    @property
    def store(self) -> KVStore: ...
    def numerics(self) -> dict: ...
    @property
    def bytes_per_token(self) -> int: ...
    def require_uniform(self, what: str) -> None: ...

    # ---- holders
    def add_holder(self, holder: KVHolder) -> None: ...
    def reclaim(self, n_blocks: int) -> int: ...
    def holdings(self) -> Iterator[tuple[str, Sequence]]: ...
    def offloaded_blocks(self) -> int: ...

    # ---- a sequence's KV (an evaluation's own sequence, a session's turn)
    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool: ...
    def release_out_of_window(self, seq: Sequence) -> int: ...
    def free(self, seq: Sequence) -> int: ...
    def truncate(self, seq: Sequence, num_tokens: int) -> None: ...
    def commit(self, seq: Sequence) -> None: ...
    def write_outside_scheduler(self, seq: Sequence, n: int, logits: str = "none") -> torch.Tensor | None: ...
    def compress_prompt(self, seq: Sequence) -> bool: ...

    # ---- blocks held outside sequences (forks, holds)
    @property
    def num_free_blocks(self) -> int: ...
    def allocate_blocks(self, n: int) -> list[int] | None: ...
    def share_blocks(self, block_ids: list[int]) -> list[int]: ...
    def free_blocks(self, block_ids: list[int]) -> None: ...
    def shared_blocks(self, block_ids: list[int]) -> list[int]: ...

    # ---- the pool
    def compact(self, evict_cache: bool = False) -> dict: ...
    def evict_cached(self) -> int: ...
    @property
    def num_evictions(self) -> int: ...
    def hold_prefix(self, namespace: Namespace, token_ids: list[int], ttl_s: float) -> int: ...
    def prefix_tokens(self) -> tuple[int, int]: ...
    def stats(self) -> dict: ...
    def describe(self) -> str: ...
    def pool_stats(self) -> PoolStats: ...


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
    kv: KVHandle  # the KV: store, holders, sequences' KV, blocks, pool figures (kvkeeper.engine.kv_access)
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
    def prefill_private(self, ids: torch.Tensor, positions: torch.Tensor, chunk: int = 512, logits: str = "none",
                        num_layers: int | None = None, lora=None) -> tuple[torch.Tensor | None, KVStore]: ...
    @property
    def numerics(self) -> dict: ...
    @property
    def speculation_supported(self) -> bool: ...
    def describe(self) -> str: ...
    def stats(self) -> dict: ...
