"""Start-up checks of the kernels against the PyTorch reference, and the random steps they (and tests) use.

* :func:`self_check`: one mixed and one decode-only attention step on small random paged caches of the
  model's shapes, through a kernel backend ("triton" or "cpu", dispatched by
  :mod:`kvkeeper.attention.selector`) and through the reference; the runner runs it before trusting a
  backend and falls back to the reference on an error or a mismatch.
* :func:`qmm_self_check`: the C++ block matmul (:mod:`kvkeeper.weights.formats`) on random 4- and 8-bit
  blocks against the float64 product of the dequantized weights and the int8-rounded activations.

Kernel modules never import this module; it imports them (the Triton module lazily, inside the dispatch).
"""

from __future__ import annotations

import torch

from ..kvcache.formats.base import PagedKV, parse_kv_format
from ..attention import reference as attention, selector as attention_backend
from ..kernels import cpu as cpu_kernels
from ..layers import quantized
from ..attention.metadata import AttentionMetadata, PrefillSpan


def random_step(seqs, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, fmt,
                dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", seed: int = 0,
                extra_cols: int = 0):
    """One step over a random paged cache, twice (one copy per path).

    seqs: list of (context_len, q_len).  Each sequence gets distinct, shuffled blocks (plus
    ``extra_cols`` unused table entries); its first context_len - q_len tokens are already in the
    cache (random K/V written through :meth:`PagedKV.write`); the q_len new tokens are ``k``, ``v``.
    fmt: a KV format or its name.  Returns (q (T, H, D), k, v (T, KVH, D) in ``dtype``, cache_a,
    cache_b (identical contents), meta_a, meta_b (identical :class:`AttentionMetadata`)).
    """
    dev = torch.device(device)
    g = torch.Generator().manual_seed(seed)
    fmt = parse_kv_format(fmt)
    bs = block_size
    need = [-(-c // bs) for c, _ in seqs]
    nblocks = sum(need) + 3 + extra_cols * len(seqs)
    perm = torch.randperm(nblocks, generator=g)
    cache = PagedKV(nblocks, bs, num_kv_heads, head_dim, fmt, dev)
    tables, used = [], 0
    for (c, ql), n in zip(seqs, need):
        t = perm[used: used + n + extra_cols].to(dev)
        tables.append(t)
        used += n + extra_cols
        old = c - ql
        if old:
            i = torch.arange(old, device=dev)
            cache.write(torch.randn(old, num_kv_heads, head_dim, generator=g).to(dev),
                        torch.randn(old, num_kv_heads, head_dim, generator=g).to(dev), t[i // bs] * bs + i % bs)
    T = sum(ql for _, ql in seqs)
    q = torch.randn(T, num_heads, head_dim, generator=g).to(dev, dtype)
    k = torch.randn(T, num_kv_heads, head_dim, generator=g).to(dev, dtype)
    v = torch.randn(T, num_kv_heads, head_dim, generator=g).to(dev, dtype)
    slots, prefills, dec_idx, dec_bt, dec_len = [], [], [], [], []
    start = 0
    for (c, ql), t in zip(seqs, tables):
        i = torch.arange(c - ql, c, device=dev)
        slots.append(t[i // bs] * bs + i % bs)
        if ql == 1:
            dec_idx.append(start)
            dec_bt.append(t)
            dec_len.append(c)
        else:
            prefills.append(PrefillSpan(start, ql, c, t))
        start += ql

    def meta():
        m = AttentionMetadata(slot_mapping=torch.cat(slots), prefills=list(prefills))
        if dec_idx:
            table = torch.zeros(len(dec_bt), max(len(b) for b in dec_bt), dtype=torch.int64, device=dev)
            for j, b in enumerate(dec_bt):
                table[j, : len(b)] = b
            m.decode_indices = torch.tensor(dec_idx, device=dev)
            m.decode_block_tables = table
            m.decode_context_lens = torch.tensor(dec_len, device=dev)
            m.decode_max_len = max(dec_len)
        return m

    cache2 = PagedKV(nblocks, bs, num_kv_heads, head_dim, fmt, dev)
    if fmt.kivi:  # packed blocks, scales, mins and the 16-bit window: a raw block copy
        ids = list(range(nblocks))
        cache2.write_blocks(ids, cache.read_blocks(ids))
        return q, k, v, cache, cache2, meta(), meta()
    for a, b in ((cache2.k, cache.k), (cache2.v, cache.v), (cache2.k_scale, cache.k_scale),
                 (cache2.v_scale, cache.v_scale)):
        if a is not None:
            a.copy_(b)
    return q, k, v, cache, cache2, meta(), meta()


SELF_CHECK_TOL = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def self_check(num_heads: int, num_kv_heads: int, head_dim: int, fmt, dtype: torch.dtype,
               device: torch.device | str, block_size: int, backend: str = "triton") -> float:
    """Run a mixed step (a decode token at 37 tokens plus a 20-token chunk over 30 cached tokens) and a
    decode-only step (37 and 50 tokens) through ``backend`` and through the PyTorch reference on small
    random caches of the model's shapes (:func:`random_step`).

    Returns the larger max |kernel - reference| / max |reference| of the two steps (compare it with
    ``SELF_CHECK_TOL[dtype]``).  For Triton it compiles the variants the model will use, so it costs little extra.
    """
    worst = 0.0
    for seqs in ([(37, 1), (50, 20)], [(37, 1), (50, 1)]):
        q, k, v, c_ref, c_tk, m_ref, m_tk = random_step(seqs, num_heads, num_kv_heads, head_dim, block_size, fmt,
                                                        dtype, device)
        m_ref.backend, m_tk.backend = "torch", backend
        want = attention.paged_attention(q, k, v, c_ref, m_ref, head_dim**-0.5).float()
        got = attention_backend.paged_attention(q, k, v, c_tk, m_tk, head_dim**-0.5).float()
        worst = max(worst, (got - want).abs().max().item() / max(want.abs().max().item(), 1e-6))
    return worst


QMM_SELF_CHECK_TOL = 1e-5  # relative; float32 accumulation of exact int32 block sums


def qmm_self_check(k: int = 96, n: int = 40, m: int = 3, seed: int = 0) -> float:
    """Max relative error of the C++ block matmul against float64 on random 4- and 8-bit blocks.

    The reference multiplies the dequantized weights by the activations as the kernel rounds them (int8 per
    row and block of 32, ``quantize_activations``), so the only difference left is float32 rounding.
    """
    mod = cpu_kernels.load()
    if mod is None:
        raise RuntimeError(f"the CPU kernels are unavailable ({cpu_kernels.unavailable_reason()})")
    g = torch.Generator().manual_seed(seed)
    worst = 0.0
    for bits in (4, 8):
        u = torch.randint(0, 1 << bits, (n, k), generator=g, dtype=torch.int32)
        d = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half()
        mm = (torch.randn(n, k // 32, generator=g) * 0.05).half()
        pw = quantized.pack_blocks(u, d, mm, bits, f"random {bits}-bit")
        x = torch.randn(m, k, generator=g)
        y = mod.qmm(x, pw.qs, pw.sc, bits, n).double()
        xq, dx, _ = mod.quantize_activations(x)
        xd = (xq.double().view(m, -1, 32) * dx.double()[..., None]).view(m, k)
        want = xd @ pw.dequantize().double().T
        worst = max(worst, ((y - want).abs().max() / want.abs().max()).item())
    return worst
