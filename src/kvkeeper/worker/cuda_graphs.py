"""CUDA graphs of the decode step: captured once per batch size, replayed with the batch padded up.

A decode-only step (every sequence adds one token) runs the whole model plus the LM head on static
input buffers: token ids (N,), positions (N,), slots (N,), block tables (N, W) and context lengths
(N,), N = the largest captured size and W = the blocks of a ``max_model_len`` sequence.  A batch of
``n`` sequences replays the graph of the smallest captured size ``>= n`` (:func:`pick_batch_size`);
the padding rows get slot -1 (the store kernel skips them) and context length 0 (attention outputs
zeros for them), and their logits are dropped.  The split-K factor of decode attention is fixed at
capture (from ``max_model_len``), since a graph replays fixed launch grids.

Eager fallback: no graph on a CPU device, with the PyTorch attention path (its shapes depend on the
step), for a batch larger than the largest size, a block table wider than W, or a size whose capture
failed (the error is logged once).  As in vLLM and SGLang, graphs are captured largest first so that
smaller ones reuse the same memory pool.
"""

from __future__ import annotations

import logging

import torch

from ..attention.metadata import AttentionMetadata

log = logging.getLogger(__name__)

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def pick_batch_size(n: int, sizes=BATCH_SIZES) -> int | None:
    """The smallest size in ``sizes`` that holds ``n`` sequences, or None when ``n`` is larger than all."""
    if n < 1:
        raise ValueError(f"a decode batch holds at least one sequence, got {n}")
    for s in sorted(sizes):
        if s >= n:
            return s
    return None


def sizes_up_to(max_num_seqs: int, sizes=BATCH_SIZES) -> tuple[int, ...]:
    """The sizes needed for batches of up to ``max_num_seqs`` sequences (one past it, padded)."""
    top = pick_batch_size(max_num_seqs, sizes) or max(sizes)
    return tuple(s for s in sorted(sizes) if s <= top)


class DecodeGraphs:
    """Static decode buffers plus one captured graph per batch size (see the module docstring).

    runner: a :class:`~kvkeeper.worker.runner.ModelRunner` on the triton attention backend.
    max_model_len: longest sequence (tokens) a replay must handle; fixes W and the split-K factor.
    """

    def __init__(self, runner, max_model_len: int, sizes=BATCH_SIZES):
        from ..attention.triton_backend import choose_num_splits  # noqa: F401  (the kernel path must be importable)

        self.runner = runner
        self.sizes = tuple(sorted(sizes))
        self.max_blocks = -(-max_model_len // runner.block_size)
        self.max_model_len = max_model_len
        n, dev = self.sizes[-1], runner.device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int64, device=dev)
        self.context_lens = torch.zeros(n, dtype=torch.int64, device=dev)
        self.decode_indices = torch.arange(n, dtype=torch.int64, device=dev)
        self.graphs: dict[int, object] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.failed: dict[int, str] = {}
        self.pool = None
        self.replays = 0
        self.eager_steps = 0

    def num_splits(self, size: int) -> int:
        from ..attention.triton_backend import choose_num_splits

        return choose_num_splits(size, self.runner.cfg.num_kv_heads, self.max_model_len)

    def fill(self, size: int, input_ids, positions, slots, block_tables, context_lens) -> None:
        """Copy a batch of n <= size sequences into the static buffers; rows n..size-1 become padding."""
        n, w = block_tables.shape
        if n > size or w > self.max_blocks:
            raise ValueError(f"batch of {n} sequences with {w} blocks does not fit size {size} x {self.max_blocks}")
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(slots)
        self.context_lens[:n].copy_(context_lens)
        self.block_tables[:n, :w].copy_(block_tables)
        self.block_tables[:n, w:].zero_()
        if n < size:
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slots[n:size].fill_(-1)
            self.context_lens[n:size].zero_()
            self.block_tables[n:size].zero_()

    def forward_static(self, size: int) -> torch.Tensor:
        """The captured computation: model plus LM head on the first ``size`` rows -> float32 logits (size, vocab)."""
        meta = AttentionMetadata(
            slot_mapping=self.slots[:size], decode_indices=self.decode_indices[:size],
            decode_block_tables=self.block_tables[:size], decode_context_lens=self.context_lens[:size],
            backend="triton", decode_num_splits=self.num_splits(size),
        )
        model = self.runner.model
        hidden = model(self.input_ids[:size], self.positions[:size], self.runner.kv_store, meta)
        return model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self, max_num_seqs: int | None = None) -> None:
        """Capture one graph per size (up to the one that holds ``max_num_seqs``), largest first."""
        sizes = self.sizes if max_num_seqs is None else sizes_up_to(max_num_seqs, self.sizes)
        for size in sorted(sizes, reverse=True):
            try:
                self.fill(size, *self._empty_batch())
                torch.cuda.synchronize()
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):  # warm-up: compiles the kernels, settles the allocator
                    for _ in range(2):
                        self.forward_static(size)
                torch.cuda.current_stream().wait_stream(s)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool):
                    out = self.forward_static(size)
                if self.pool is None:
                    self.pool = g.pool()
                self.graphs[size], self.outputs[size] = g, out
            except Exception as e:  # noqa: BLE001  (any failure: this size runs eagerly)
                self.failed[size] = f"{type(e).__name__}: {e}"
                log.warning("CUDA graph capture failed for batch size %d (%s); it runs eagerly", size, e)
        torch.cuda.synchronize()

    def _empty_batch(self):
        dev = self.runner.device
        z = torch.zeros(1, dtype=torch.int64, device=dev)
        return z, z, torch.full((1,), -1, dtype=torch.int64, device=dev), torch.zeros(1, 1, dtype=torch.int64, device=dev), z

    def can_replay(self, n: int, width: int) -> int | None:
        """The captured size a batch of n sequences with ``width``-block tables replays, or None (eager)."""
        size = pick_batch_size(n, self.sizes)
        if size is None or width > self.max_blocks or size not in self.graphs:
            return None
        return size

    def replay(self, size: int, input_ids, positions, slots, block_tables, context_lens) -> torch.Tensor:
        """Run the graph of ``size`` on a batch of n sequences; returns float32 logits (n, vocab) (a view)."""
        n = block_tables.shape[0]
        self.fill(size, input_ids, positions, slots, block_tables, context_lens)
        self.graphs[size].replay()
        self.replays += 1
        return self.outputs[size][:n]
