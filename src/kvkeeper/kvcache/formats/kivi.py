"""KIVI int4 / int2 KV: packed, asymmetric codes with a 16-bit window of recent tokens.

**int4 / int2 (KIVI).**  Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache"
(ICML 2024): keys quantized *per channel* over a group of tokens, values *per token* in groups of channels,
asymmetric (``x ~ q * scale + min``, q in 0..2^bits-1, round to nearest), the most recent tokens kept in
16 bits until their group fills.  The layout in the paged cache (one :class:`KiviPagedKV`):

* key group = one block of tokens.  A block is *closed* when its last slot is written: its keys are quantized
  per (KV head, channel) over the block's tokens, its values per (token, KV head, group of ``group_v``
  channels).  Closing depends on the block's own tokens only, so a full block's bytes are a function of its
  tokens (what the prefix cache and sessions share) whatever the order of the writes.
* ``k``, ``v``: (num_blocks, block_size, num_kv_heads, head_dim * bits / 8) uint8, packed little end first
  (int4: channel 2j in the low nibble of byte j, 2j+1 in the high one; int2: channel 4j + i in bits 2i..2i+1);
  ``k_scale``, ``k_min``: (num_blocks, num_kv_heads, head_dim) float16 (per block and channel);
  ``v_scale``, ``v_min``: (num_blocks, block_size, num_kv_heads, head_dim / group_v) float16.
* the 16-bit window: a block not yet full is *open*; its tokens live in a bounded side pool of 16-bit
  blocks, ``res_k``, ``res_v``: (residual_blocks, block_size, num_kv_heads, head_dim) bfloat16, and
  ``res_of`` (num_blocks,) int32 names each block's residual block (-1: closed).  The own-block rule: a query
  reads the block of its own position in 16 bits, earlier blocks from their codes, in prefill as in decode; a
  block closed by a write keeps its 16-bit copy for the rest of that step (``res_of = -2 - residual block``, a
  *kept* block: closed to every reader but the attention of its own queries), released at the layer's next
  write.  Measured on SmolLM2-135M at 4,096 tokens (transformers simulation of the rule,
  2026-12-06): int4 perplexity +0.83% over bf16 with the rule, +2.03% without it.  Normally a sequence's last,
  partial block is its open one; the readers (reference and kernels) accept open blocks anywhere in a block
  table, so a window of several blocks straddling a block boundary (a block reopened by a rewrite, e.g. a
  rejected draft token, next to the new tail) reads correctly.  Rewriting a slot of a closed block reopens it
  (its tokens dequantized into the window: lossy, as any re-quantization).  When every residual block is
  taken, the least recently written open block is closed early (quantized over the tokens it holds).
* ``group_v``: 64 for int4 (a 64-dim head: one group per token and head), 32 for int2 (KIVI's group).

Bytes per token for SmolLM2-135M (30 layers, 3 KV heads, head_dim 64), K plus V, closed blocks, block_size 16:
int4 7,560 (32 + 32 packed, 16 of key scale/min per channel amortised over 16 tokens, 4 of value scale/min:
0.328x bf16); int2 5,040 (0.219x); at block_size 32 int4 takes 6,840 (0.297x), int2 4,320 (0.188x).  The
16-bit window adds ``residual_blocks`` (default min(num_blocks, 128)) blocks of 16-bit K and V per layer.
"""

from __future__ import annotations

import torch

from .base import MIN_SCALE, RESIDUAL_DTYPE, SCALE_DTYPE, KVFormat, PagedKV, kivi_group_v, zeros

__all__ = ["KiviPagedKV", "kivi_dequantize_keys", "kivi_dequantize_values", "kivi_quantize_keys",
           "kivi_quantize_values", "pack", "quantize_asym", "unpack"]


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (..., D) integers in 0..2^bits-1 -> (..., D * bits / 8) uint8 (channel order: low bits first)."""
    per = 8 // bits
    q = q.to(torch.uint8).view(*q.shape[:-1], q.shape[-1] // per, per)
    out = q[..., 0].clone()
    for i in range(1, per):
        out |= q[..., i] << (bits * i)
    return out


def unpack(p: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., B) uint8 -> codes (..., B * 8 / bits) uint8 (the inverse of :func:`pack`)."""
    per, mask = 8 // bits, (1 << bits) - 1
    return torch.stack([(p >> (bits * i)) & mask for i in range(per)], dim=-1).flatten(-2)


def quantize_asym(x: torch.Tensor, dim: int, qmax: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric quantization over ``dim``: x float -> (codes uint8 like x, scale, min) with scale and min float16
    of x's shape without ``dim`` (``x ~ codes * scale + min``; round to nearest, codes clamped to 0..qmax)."""
    xf = x.float()
    mn = xf.amin(dim=dim).to(SCALE_DTYPE)
    mx = xf.amax(dim=dim)
    scale = ((mx - mn.float()) / qmax).clamp_min(MIN_SCALE).to(SCALE_DTYPE)
    q = ((xf - mn.float().unsqueeze(dim)) / scale.float().unsqueeze(dim)).round_().clamp_(0, qmax).to(torch.uint8)
    return q, scale, mn


def kivi_quantize_keys(k: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys of whole blocks (n, T, KVH, D) float, T <= block_size tokens -> (packed (n, T, KVH, D*bits/8) uint8,
    scale (n, KVH, D), min (n, KVH, D) float16): per channel over the block's T tokens (KIVI's key grouping)."""
    q, s, m = quantize_asym(k, 1, fmt.qmax)
    return pack(q, fmt.bits), s, m


def kivi_quantize_values(v: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Values (..., KVH, D) float -> (packed (..., KVH, D*bits/8) uint8, scale, min (..., KVH, D/group) float16):
    per token in groups of channels (KIVI's value grouping)."""
    d = v.shape[-1]
    g = kivi_group_v(fmt, d)
    q, s, m = quantize_asym(v.reshape(*v.shape[:-1], d // g, g), -1, fmt.qmax)
    return pack(q.flatten(-2), fmt.bits), s, m


def kivi_dequantize_keys(p: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, bits: int,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed (n, T, KVH, B), scale and min (n, KVH, D) -> keys (n, T, KVH, D) in ``dtype`` (``q * scale + min``
    in float32)."""
    q = unpack(p, bits).float()
    return (q * scale.float().unsqueeze(1) + mn.float().unsqueeze(1)).to(dtype)


def kivi_dequantize_values(p: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, bits: int,
                           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed (..., KVH, B), scale and min (..., KVH, D/g) -> values (..., KVH, D) in ``dtype``."""
    q = unpack(p, bits).float()
    ng = scale.shape[-1]
    q = q.view(*q.shape[:-1], ng, q.shape[-1] // ng)
    return (q * scale.float().unsqueeze(-1) + mn.float().unsqueeze(-1)).flatten(-2).to(dtype)


class KiviPagedKV(PagedKV, layout="kivi"):
    """One layer's KV in a KIVI format (int4 / int2: Liu et al., 2024): packed closed blocks plus a 16-bit window
    of open blocks.  Tensors, shapes and the closing rule: the module docstring.  Same methods as
    :class:`PagedKV`; block payloads (:meth:`read_blocks`) carry the packed bytes and scales as they are plus,
    for open blocks, their 16-bit tokens (``fill`` (n,) int16 tokens held, ``open`` (n,) bool, ``res_k`` /
    ``res_v`` (number open, block_size, KVH, D) bfloat16), so an offload round trip is bit-exact.

    residual_blocks: size of the 16-bit window's pool (default min(num_blocks, 128)).  Raises ValueError for an
    MLA latent cache (values=False) or a head_dim that is not a multiple of 8.

    The own-block rule: a query reads its own block (the block of its position) from the 16-bit window, every
    earlier block from its codes, in prefill and decode alike.  A block closed by a write therefore keeps its
    16-bit copy for the rest of that step (``kept``: ``res_of[block] = -2 - window index``; to everything but the
    attention it is a closed block) so that the step's queries in it read it as a decode token would; the copies
    are released by the next write (or move) of this layer, or first when the pool runs short.  When the pool has
    no free block for such a copy, the block's queries read its codes instead (deterministic, but not the rule).
    """

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, fmt: KVFormat,
                 device: torch.device | str = "cpu", layer_idx: int = 0, values: bool = True,
                 residual_blocks: int | None = None):
        if not values:
            raise ValueError(f"KV dtype {fmt.name} (KIVI) needs K and V heads; an MLA latent cache takes bf16, "
                             "int8 or fp8")
        self.fmt = fmt
        self.layer_idx = layer_idx
        self.bits = fmt.bits
        self.group_v = kivi_group_v(fmt, head_dim)
        self._head_dim = head_dim
        nb, bs, kvh, d = num_blocks, block_size, num_kv_heads, head_dim
        pb = d * fmt.bits // 8
        self.k = zeros((nb, bs, kvh, pb), torch.uint8, device)
        self.v = zeros((nb, bs, kvh, pb), torch.uint8, device)
        self.k_scale = torch.ones((nb, kvh, d), dtype=SCALE_DTYPE, device=device)
        self.k_min = torch.zeros((nb, kvh, d), dtype=SCALE_DTYPE, device=device)
        self.v_scale = torch.ones((nb, bs, kvh, d // self.group_v), dtype=SCALE_DTYPE, device=device)
        self.v_min = torch.zeros((nb, bs, kvh, d // self.group_v), dtype=SCALE_DTYPE, device=device)
        r = min(nb, 128) if residual_blocks is None else residual_blocks
        if r < 1:
            raise ValueError(f"residual_blocks must be >= 1, got {r}")
        self.res_k = torch.zeros((r, bs, kvh, d), dtype=RESIDUAL_DTYPE, device=device)
        self.res_v = torch.zeros((r, bs, kvh, d), dtype=RESIDUAL_DTYPE, device=device)
        self.res_of = torch.full((nb,), -1, dtype=torch.int32)  # residual block of each open block, -1: closed
        self.fill = torch.zeros(nb, dtype=torch.int16)  # tokens written (an open block) or quantized (closed)
        self._owner = [-1] * r  # block of each residual block
        self._free = list(range(r - 1, -1, -1))
        self._tick = [0] * r  # last write, for closing the least recently written block when the pool is full
        self._clock = 0
        self.kept: set[int] = set()  # closed blocks whose 16-bit copy stays for this step (the own-block rule)

    @property
    def head_dim(self) -> int:
        return self._head_dim

    @property
    def latent(self) -> bool:
        return False

    def write_latent(self, rows, slots):
        raise ValueError("an MLA latent cache cannot be stored in a KIVI format")

    # ---- the 16-bit window -------------------------------------------------------------------------------
    def _alloc(self, block: int, busy: set) -> int:
        if not self._free and self.kept:  # a kept copy goes first: its block's codes are already written
            self._release(self.kept.pop())
        if not self._free:
            cands = [(t, i) for i, t in enumerate(self._tick) if self._owner[i] not in busy]
            if not cands:
                raise RuntimeError(f"KIVI 16-bit window full: {len(self._tick)} residual blocks all written in one "
                                   "step; raise residual_blocks")
            _, i = min(cands)
            self._close(self._owner[i])
        i = self._free.pop()
        self._owner[i] = block
        self.res_of[block] = i
        return i

    def _drop_kept(self) -> None:
        """Release the 16-bit copies kept for the last step's own-block reads (their blocks are closed)."""
        while self.kept:
            self._release(self.kept.pop())

    def _end_kept(self, written: torch.Tensor) -> None:
        """Before a write: a kept block written again (e.g. after rejected draft tokens) reopens from its exact
        16-bit copy; the other kept copies are released.  written: the blocks (n,) the write touches."""
        if not self.kept:
            return
        for b in set(written.tolist()) & self.kept:
            self.kept.discard(b)
            self.res_of[b] = -2 - int(self.res_of[b])
        self._drop_kept()

    def _keep(self, block: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Attach a 16-bit copy k, v (block_size, KVH, D) to a block just closed, if the pool has a free block."""
        if not self._free:
            return
        i = self._free.pop()
        self._owner[i] = block
        self.res_of[block] = -2 - i  # kept: closed, its copy read by its own queries only
        self.res_k[i] = k.to(RESIDUAL_DTYPE)
        self.res_v[i] = v.to(RESIDUAL_DTYPE)
        self._tick[i] = self._clock
        self.kept.add(block)

    def _release(self, block: int) -> None:
        self.kept.discard(block)
        i = int(self.res_of[block])
        if i <= -2:
            i = -2 - i
        if i >= 0:
            self._owner[i] = -1
            self._free.append(i)
            self.res_of[block] = -1

    def _close(self, block: int, keep: bool = False) -> None:
        """Quantize an open block's tokens (its ``fill`` first ones) into its packed storage; free its window, or
        with ``keep`` leave it attached for this step (the own-block rule)."""
        i, n = int(self.res_of[block]), int(self.fill[block])
        if n > 0:
            self._store_closed(torch.tensor([block]), self.res_k[i: i + 1, :n], self.res_v[i: i + 1, :n])
        if keep:
            self.res_of[block] = -2 - i
            self.kept.add(block)
        else:
            self._release(block)

    def _store_closed(self, blocks: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize k, v (n, T, KVH, D) of ``blocks`` (n,) into their first T slots (keys per channel over T)."""
        T = k.shape[1]
        kp, ks, km = kivi_quantize_keys(k, self.fmt)
        vp, vs, vm = kivi_quantize_values(v, self.fmt)
        idx = blocks.to(self.k.device)
        if T == self.k.shape[1]:
            self.k.index_copy_(0, idx, kp)
            self.v.index_copy_(0, idx, vp)
            self.v_scale.index_copy_(0, idx, vs)
            self.v_min.index_copy_(0, idx, vm)
        else:
            for j, b in enumerate(blocks.tolist()):
                self.k[b, :T] = kp[j]
                self.v[b, :T] = vp[j]
                self.v_scale[b, :T] = vs[j]
                self.v_min[b, :T] = vm[j]
        self.k_scale.index_copy_(0, idx, ks)
        self.k_min.index_copy_(0, idx, km)
        self.fill[blocks] = T

    def _dequant_blocks(self, blocks: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of whole blocks (n,) as held (packed dequantized, open blocks from the window): (n, bs, KVH, D)."""
        idx = blocks.to(self.k.device)
        k = kivi_dequantize_keys(self.k.index_select(0, idx), self.k_scale.index_select(0, idx),
                                 self.k_min.index_select(0, idx), self.bits, dtype)
        v = kivi_dequantize_values(self.v.index_select(0, idx), self.v_scale.index_select(0, idx),
                                   self.v_min.index_select(0, idx), self.bits, dtype)
        r = self.res_of[blocks.cpu()]
        open_ = (r >= 0).nonzero().flatten()
        if open_.numel():
            ri = r[open_].long().to(self.k.device)
            k[open_.to(k.device)] = self.res_k.index_select(0, ri).to(dtype)
            v[open_.to(v.device)] = self.res_v.index_select(0, ri).to(dtype)
        return k, v

    def close_all(self) -> None:
        """Close every open block (quantize the tokens it holds): e.g. before measuring closed-block bytes."""
        self._drop_kept()
        for b in [o for o in self._owner if o >= 0]:
            self._close(b)

    # ---- writes -----------------------------------------------------------------------------------------
    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store new keys/values k, v (T, KVH, D) into their slots (T,) int64 (distinct): a block whose every slot
        is written here is quantized at once (keeping a 16-bit copy for this step); other tokens go to their block's
        window, a block whose last slot is written is closed.  A sequence appends in order: a block holds the tokens
        up to the last slot written (a rewrite truncates it there; one into a closed block reopens it, dequantized)."""
        bs, slots_c = self.k.shape[1], slots.cpu()
        self._end_kept(slots_c // bs)
        if slots.numel() == 0:
            return
        if slots.numel() <= 8 and self._append_decode(k, v, slots_c.tolist()):
            return
        order = torch.argsort(slots_c)
        ss = slots_c[order]
        blocks = ss // bs
        ub, counts = torch.unique_consecutive(blocks, return_counts=True)
        full = counts == bs
        per_tok_full = full.repeat_interleave(counts)
        if bool(full.any()):
            fb = ub[full]
            sel = order[per_tok_full].to(k.device)
            # rounded to the window's 16 bits first: a block's bytes do not depend on how its tokens were written
            kf = k.index_select(0, sel).to(RESIDUAL_DTYPE).float().view(len(fb), bs, *k.shape[1:])
            vf = v.index_select(0, sel).to(RESIDUAL_DTYPE).float().view(len(fb), bs, *v.shape[1:])
            for b in fb[self.res_of[fb] >= 0].tolist():
                self._release(b)
            self._store_closed(fb, kf, vf)
            for j, b in enumerate(fb.tolist()):  # this step's queries in these blocks read them in 16 bits
                self._keep(b, kf[j], vf[j])
        if bool(full.all()):
            return
        busy = set(ub[~full].tolist())
        self._clock += 1
        pos = 0
        for b, n, f in zip(ub.tolist(), counts.tolist(), full.tolist()):
            if f:
                pos += n
                continue
            toks = order[pos: pos + n]
            offs = (ss[pos: pos + n] - b * bs)
            pos += n
            r = int(self.res_of[b])
            fresh = int(offs[0]) == 0
            if r < 0:
                held = None
                if not fresh and int(self.fill[b]):  # a write into a closed block: reopen it (tokens dequantized)
                    held = self._dequant_blocks(torch.tensor([b]), RESIDUAL_DTYPE)
                r = self._alloc(b, busy)
                if held is not None:
                    self.res_k[r], self.res_v[r] = held[0][0], held[1][0]
            elif fresh:
                self.fill[b] = 0
            t = toks.to(k.device)
            o = offs.to(self.res_k.device)
            self.res_k[r].index_copy_(0, o, k.index_select(0, t).to(RESIDUAL_DTYPE))
            self.res_v[r].index_copy_(0, o, v.index_select(0, t).to(RESIDUAL_DTYPE))
            self.fill[b] = int(offs[-1]) + 1  # a sequence appends in order: a write at o ends its block at o
            self._tick[r] = self._clock
            if int(self.fill[b]) == bs:
                self._close(b, keep=True)

    def _append_decode(self, k: torch.Tensor, v: torch.Tensor, slots: list[int]) -> bool:
        """The decode case of :meth:`write` without tensor bookkeeping: each token appended to its own open block
        (distinct blocks, each slot the block's next one).  Returns False, writing nothing, for anything else."""
        bs = self.k.shape[1]
        at = [divmod(x, bs) for x in slots]
        if len({b for b, _ in at}) != len(at):
            return False
        rows = []
        for b, o in at:
            r = int(self.res_of[b])
            if r < 0 or o == 0 or o != int(self.fill[b]):
                return False
            rows.append(r)
        self._clock += 1
        for j, ((b, o), r) in enumerate(zip(at, rows)):
            self.res_k[r, o] = k[j]
            self.res_v[r, o] = v[j]
            self.fill[b] = o + 1
            self._tick[r] = self._clock
            if o + 1 == bs:
                self._close(b, keep=True)
        return True

    # ---- reads ------------------------------------------------------------------------------------------
    def gather(self, block_table: torch.Tensor, length: int, dtype: torch.dtype):
        k, v = self._dequant_blocks(block_table, dtype)
        kvh, d = k.shape[2], k.shape[3]
        return k.reshape(-1, kvh, d)[:length], v.reshape(-1, kvh, d)[:length]

    def gather_keys(self, block_table: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
        return self.gather(block_table, length, dtype)[0]

    def gather_for_reference(self, block_table: torch.Tensor, length: int, dtype: torch.dtype):
        """What the reference attention needs for the own-block rule: (k, v) (length, KVH, D) as held (codes; an
        open block from its window), (kw, vw) (length, KVH, D) from the 16-bit window of an open or kept block
        (zeros where a block has none) and ``has`` (length,) bool: the key's block has such a copy."""
        blocks = block_table.cpu()
        k, v = self._dequant_blocks(blocks, dtype)  # as held: codes, an open block from its window
        r = self.res_of[blocks]
        has = r != -1
        kw, vw = torch.zeros_like(k), torch.zeros_like(v)
        if bool(has.any()):
            ri = torch.where(r >= 0, r, -2 - r)[has].long().to(self.k.device)
            kw[has.to(k.device)] = self.res_k.index_select(0, ri).to(dtype)
            vw[has.to(k.device)] = self.res_v.index_select(0, ri).to(dtype)
        bs, kvh, d = k.shape[1], k.shape[2], k.shape[3]
        flat = lambda x: x.reshape(-1, kvh, d)[:length]  # noqa: E731
        return flat(k), flat(v), flat(kw), flat(vw), has.repeat_interleave(bs)[:length]

    def gather_padded(self, block_tables: torch.Tensor, dtype: torch.dtype):
        B, nb = block_tables.shape
        k, v = self._dequant_blocks(block_tables.reshape(-1), dtype)
        bs, kvh, d = k.shape[1], k.shape[2], k.shape[3]
        return (k.view(B, nb * bs, kvh, d).transpose(1, 2), v.view(B, nb * bs, kvh, d).transpose(1, 2))

    def gather_keys_padded(self, block_tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.gather_padded(block_tables, dtype)[0]

    def read_slots(self, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """K and V at global slot ids (n,) int64 as float32 CPU tensors (n, KVH, D), as held (dequantized)."""
        bs = self.k.shape[1]
        s = slots.cpu()
        ub, inv = torch.unique(s // bs, return_inverse=True)
        k, v = self._dequant_blocks(ub, torch.float32)
        off = (s % bs).to(k.device)
        return {"k": k[inv.to(k.device), off].cpu(), "v": v[inv.to(k.device), off].cpu()}

    def copy_tokens(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Per KV head, copy the token in slot ``src[h, j]`` to slot ``dst[j]``: src (KVH, n), dst (n,) int64.
        A KIVI block's keys share per-channel scales, so the tokens are dequantized and written again (the
        destination blocks re-quantized: lossy, unlike the other formats' raw copies)."""
        kvh = self.k.shape[2]
        heads = torch.arange(kvh)
        rows = self.read_slots(src.reshape(-1))
        n = src.shape[1]
        k = rows["k"].view(kvh, n, kvh, -1)[heads, :, heads].transpose(0, 1)  # (n, KVH, D)
        v = rows["v"].view(kvh, n, kvh, -1)[heads, :, heads].transpose(0, 1)
        self.write(k, v, dst)

    # ---- whole blocks --------------------------------------------------------------------------------------
    def _parts(self) -> dict[str, torch.Tensor]:
        return {"k": self.k, "v": self.v, "k_scale": self.k_scale, "k_min": self.k_min, "v_scale": self.v_scale,
                "v_min": self.v_min}

    def nbytes(self) -> int:
        """Bytes this layer's tensors hold: packed blocks, scales and mins, and the 16-bit window's pool."""
        return sum(t.nbytes for t in self._parts().values()) + self.res_k.nbytes + self.res_v.nbytes

    def bytes_per_token(self) -> int:
        """Bytes one token slot of a closed block takes in this layer (the window's pool not counted)."""
        return round(sum(t.nbytes for t in self._parts().values()) / (self.k.shape[0] * self.k.shape[1]))

    def move_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole blocks ``src[i]`` to ``dst[i]`` (packed bytes, scales, and an open block's 16-bit tokens, raw);
        all sources are read before any destination is written."""
        self._drop_kept()
        src_c, dst_c = src.cpu(), dst.cpu()
        for t in self._parts().values():
            t[dst] = t[src]
        r = self.res_of[src_c]
        fill = self.fill[src_c].clone()
        open_ = (r >= 0).nonzero().flatten()
        rk = self.res_k[r[open_].long()].clone()
        rv = self.res_v[r[open_].long()].clone()
        for b in dst_c.tolist():
            self._release(b)
        self.fill[dst_c] = fill
        busy = set(dst_c.tolist())
        for j, i in enumerate(open_.tolist()):
            b = int(dst_c[i])
            ri = self._alloc(b, busy)
            self.res_k[ri], self.res_v[ri] = rk[j], rv[j]
            self._tick[ri] = self._clock

    def read_blocks(self, block_ids) -> dict[str, torch.Tensor]:
        """Raw copies of whole blocks: the parts of :meth:`_parts` ((n, ...) as stored) plus ``fill`` (n,) int16,
        ``open`` (n,) bool and the open blocks' 16-bit tokens ``res_k`` / ``res_v`` (m, block_size, KVH, D)."""
        idx = torch.as_tensor(block_ids, dtype=torch.int64)
        out = {name: t.index_select(0, idx.to(t.device)).cpu() for name, t in self._parts().items()}
        r = self.res_of[idx]
        open_ = r >= 0
        out["fill"] = self.fill[idx].clone()
        out["open"] = open_.clone()
        ri = r[open_].long().to(self.res_k.device)
        out["res_k"] = self.res_k.index_select(0, ri).cpu()
        out["res_v"] = self.res_v.index_select(0, ri).cpu()
        for j, f in enumerate(out["fill"][open_].tolist()):  # rows past the tokens held: zeros, not stale bytes
            out["res_k"][j, f:] = 0
            out["res_v"][j, f:] = 0
        return out

    def write_blocks(self, block_ids, tensors: dict[str, torch.Tensor]) -> None:
        """Write blocks read by :meth:`read_blocks` into ``block_ids`` (bit-exact; open blocks get a window)."""
        self.check_blocks(len(block_ids), tensors)
        self._drop_kept()
        idx = torch.as_tensor(block_ids, dtype=torch.int64)
        for name, dst in self._parts().items():
            dst.index_copy_(0, idx.to(dst.device), tensors[name].to(dst.device))
        for b in idx.tolist():
            self._release(b)
        self.fill[idx] = tensors["fill"]
        busy = set(idx.tolist())
        for j, i in enumerate(tensors["open"].nonzero().flatten().tolist()):
            ri = self._alloc(int(idx[i]), busy)
            self.res_k[ri] = tensors["res_k"][j].to(self.res_k.device)
            self.res_v[ri] = tensors["res_v"][j].to(self.res_v.device)

    def check_blocks(self, n: int, tensors: dict[str, torch.Tensor], extra: frozenset[str] = frozenset()) -> None:
        super().check_blocks(n, tensors, extra | {"fill", "open", "res_k", "res_v"})
        op, fill = tensors["open"], tensors["fill"]
        if op.dtype != torch.bool or tuple(op.shape) != (n,) or fill.dtype != torch.int16 or tuple(fill.shape) != (n,):
            raise ValueError(f"layer {self.layer_idx}: fill/open must be ({n},) int16 / bool")
        m = int(op.sum())
        for name in ("res_k", "res_v"):
            src, want = tensors[name], (m, *self.res_k.shape[1:])
            if src.dtype != RESIDUAL_DTYPE or tuple(src.shape) != want:
                raise ValueError(f"layer {self.layer_idx} {name}: got {src.dtype} {tuple(src.shape)}, this cache "
                                 f"needs {RESIDUAL_DTYPE} {want}")
