"""A sequence: one request's tokens, its progress and its block table."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from ..kvcache.namespace import Namespace
from ..sampling.params import SamplingParams

if TYPE_CHECKING:  # annotations only: the engine sets these from lower layers
    from ..kvcache.compression import KVCompression, PrefillObserver
    from ..layers.lora import LoRAAdapter
    from ..sampling.processors import RequestProcessors
    from ..text.detokenizer import IncrementalDetokenizer

_ids = itertools.count()


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """Tokens (prompt then output), how many have KV in the cache, and where.

    num_computed: tokens processed (positions 0..num_computed-1); their K/V fill the first
        ``num_computed - kv_offset`` slots of the block table (kv_offset > 0 after KV compression).
    block_table: block ids holding those tokens, in order.
    block_hashes: chained prefix-cache hashes of the full blocks at the head of block_table.
    num_handed_over: tokens of KV a session gave the request before it was scheduled (its turn's reuse);
    reuse_source: where that KV came from (``session``, ``fork``, ``host``, ``disk``, ``import``; None: no
        hand-over, what it holds came from the prefix cache).
    num_cached_tokens: tokens whose KV the request held when first admitted (prefix-cache hits or a
        session's hand-over); None until then.
    num_cache_written: prompt tokens whose KV it stored in the prefix cache: its full prompt blocks that it
        registered first (:meth:`kvkeeper.kvcache.manager.KVCacheManager.commit`; a block another request had
        already stored under the same hash is not counted).
    kv_holder: called with the sequence when it finishes, to take its blocks over (a session's end of
        turn); None: the engine frees them.
    processors: its logits processors (:class:`kvkeeper.sampling.processors.RequestProcessors`), None
        when its sampling needs none; advanced with each token appended.
    prompt_logprobs: with ``params.prompt_logprobs``, one entry per prompt position (None for the first,
        which nothing predicts): ``{"token_id", "logprob", "rank", "top"}``, filled while it is prefilled.
    spec: its speculative decoding state (:class:`kvkeeper.spec_decode.metrics.SpecState`), None when it does not
        draft; spec_tokens: the draft tokens scheduled after its last token in the current step (scored as
        decode rows of their own; not in ``token_ids`` until accepted).
    """

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    namespace: Namespace
    num_prompt_tokens: int = 0
    seq_id: int = field(default_factory=lambda: next(_ids))
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_handed_over: int = 0
    reuse_source: str | None = None
    num_cached_tokens: int | None = None
    num_cache_written: int = 0
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    error: str | None = None
    stop_string: str | None = None
    max_total_tokens: int = 0  # prompt + output may not exceed this
    generator: torch.Generator | None = None
    detokenizer: IncrementalDetokenizer | None = None  # set by the output processor on its first token
    text: str = ""
    logprobs: list[dict] = field(default_factory=list)  # one entry per output token with params.logprobs
    processors: RequestProcessors | None = None
    prompt_logprobs: list[dict | None] | None = None
    first_logits: torch.Tensor | None = None  # (vocab,) float32, kept when the engine captures logits
    kv_holder: Callable[["Sequence"], None] | None = None
    lora: LoRAAdapter | None = None  # its LoRA adapter (its id is namespace.adapter)
    compression: KVCompression | None = None  # applied at the end of prefill
    observer: PrefillObserver | None = None  # while the prompt is being prefilled (compression's scores)
    kv_offset: int = 0  # prompt tokens dropped by compression: KV index = token index - kv_offset
    window_released: int = 0  # hybrid KV cache: leading blocks whose window blocks it gave back
    compressed: bool = False  # compression was applied to the current KV
    num_kv_dropped: int = 0  # tokens dropped by compression over the request's life
    num_preemptions: int = 0
    spec: "SpecState | None" = None  # kvkeeper.spec_decode.metrics.SpecState (not imported: no cycle)
    spec_tokens: list[int] = field(default_factory=list)
    t_arrival: float = field(default_factory=time.perf_counter)
    t_scheduled: float | None = None  # first admission by the scheduler (perf_counter s)
    t_first_token: float | None = None
    t_last_token: float | None = None
    t_finished: float | None = None

    def __post_init__(self):
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)

    @property
    def computes_whole_prompt(self) -> bool:
        """Whether its whole prompt must be computed, never taken from the prefix cache or a session: a
        compression policy that scores with every prompt query's attention (h2o, snapkv), or prompt
        logprobs (which need the logits of every prompt position)."""
        comp = self.compression
        return (comp is not None and comp.needs_attention) or self.params.prompt_logprobs is not None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status == SeqStatus.FINISHED
