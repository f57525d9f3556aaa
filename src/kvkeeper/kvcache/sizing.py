"""KV cache sizing: how many blocks a byte budget holds, and the window blocks of a hybrid cache.

A block holds ``block_size`` tokens of every layer's KV (values plus scales, :meth:`KVFormat.bytes_per_token`).
A hybrid cache (a model with sliding-window layers, see :mod:`kvkeeper.kvcache.block_pool`) gives the
sliding layers their own, smaller set of *window blocks*: enough for every running sequence's window plus a
prefill chunk, but at most half the byte budget (and no more than there are blocks); the full layers get
the rest.  A model whose every layer slides (Mistral) keeps all its KV in window blocks (``num_blocks`` of them,
else the budget's, up to the same room for every running sequence's window plus a chunk); its blocks are then
bookkeeping without KV storage.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidRequestError
from ..model_config import ModelConfig
from .formats.base import KVFormat


@dataclass(frozen=True)
class KVSizing:
    """What the pool is sized for: ``budget_bytes`` of KV (ignored with ``num_blocks``), ``block_size``
    (tokens), ``num_blocks`` (a fixed count, or None: from the budget), and for a hybrid cache the
    scheduler's ``max_num_seqs`` and ``max_num_batched_tokens`` (tokens a step may prefill)."""

    budget_bytes: int
    block_size: int
    num_blocks: int | None = None
    max_num_seqs: int = 1
    max_num_batched_tokens: int = 0


def bytes_per_block(kv_format: KVFormat, mcfg: ModelConfig, block_size: int, num_layers: int | None = None) -> int:
    """Bytes of one block of ``num_layers`` layers (default: all) in ``kv_format``."""
    parts, heads, dim = mcfg.kv_layout
    return kv_format.bytes_per_token(mcfg.num_layers if num_layers is None else num_layers, heads, dim,
                                     parts, block_size=block_size) * block_size


def blocks_for_budget(kv_format: KVFormat, mcfg: ModelConfig, budget_bytes: int, block_size: int) -> int:
    """Blocks of every layer that ``budget_bytes`` holds; raises :class:`InvalidRequestError` when it holds
    none."""
    per_block = bytes_per_block(kv_format, mcfg, block_size)
    if budget_bytes < per_block:
        raise InvalidRequestError(f"kv_cache_bytes={budget_bytes} is smaller than one block ({per_block} bytes)")
    return budget_bytes // per_block


def kv_blocks(kv_format: KVFormat, mcfg: ModelConfig, sizing: KVSizing, hybrid: bool) -> tuple[int, int | None]:
    """(blocks, window blocks or None) for ``sizing``; ``hybrid``: give sliding-window layers window blocks
    (ignored when the model has no sliding layer).  Raises :class:`InvalidRequestError` for a budget too
    small for one block."""
    bs = sizing.block_size
    n_slide = sum(mcfg.is_sliding_layer(i) for i in range(mcfg.num_layers))
    if not (hybrid and n_slide and mcfg.sliding_window):
        return sizing.num_blocks or blocks_for_budget(kv_format, mcfg, sizing.budget_bytes, bs), None
    if n_slide == mcfg.num_layers:
        return _all_sliding_blocks(kv_format, mcfg, sizing)
    want = sizing.max_num_seqs * (-(-(mcfg.sliding_window + sizing.max_num_batched_tokens) // bs) + 1)
    if sizing.num_blocks:
        return sizing.num_blocks, max(1, min(want, sizing.num_blocks))
    layer_block = bytes_per_block(kv_format, mcfg, bs, num_layers=1)
    budget, n_full = sizing.budget_bytes, mcfg.num_layers - n_slide
    window_blocks = max(1, min(want, budget // 2 // (n_slide * layer_block)))
    blocks = (budget - window_blocks * n_slide * layer_block) // (n_full * layer_block) if n_full else 0
    if blocks < 1:
        raise InvalidRequestError(f"kv_cache_bytes={budget} is too small for a hybrid KV cache "
                                  f"({window_blocks} window blocks leave no room for one block)")
    return blocks, min(window_blocks, blocks)


def _all_sliding_blocks(kv_format: KVFormat, mcfg: ModelConfig, sizing: KVSizing) -> tuple[int, int]:
    """(blocks, window blocks) of a model whose every layer slides (Mistral): all the KV is in window blocks,
    ``num_blocks`` of them, else what the budget holds up to room for ``max_num_seqs`` windows plus a prefill chunk
    each.  Blocks hold no KV, only block-table and prefix-cache bookkeeping: enough for every sequence the window
    blocks hold to reach the context length (a sequence holds a window's worth of window blocks for each
    ``window`` tokens of blocks before it, hence ``window_blocks * (ceil(context / window) + 2)``), and no more
    than ``max_num_seqs`` whole contexts plus the window blocks."""
    bs, window, ctx = sizing.block_size, mcfg.sliding_window, mcfg.context_length
    want = sizing.max_num_seqs * (-(-(window + sizing.max_num_batched_tokens) // bs) + 1)
    window_blocks = sizing.num_blocks or min(want, blocks_for_budget(kv_format, mcfg, sizing.budget_bytes, bs))
    per_window = max(1, window // bs) * bs  # tokens of window blocks a sequence past its window holds at least
    blocks = min(window_blocks * (-(-ctx // per_window) + 2), sizing.max_num_seqs * -(-ctx // bs) + window_blocks)
    return max(blocks, window_blocks), window_blocks
