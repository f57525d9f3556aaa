"""KV cache compression at the end of prefill: drop the prompt tokens a policy scores lowest.

A request may carry a :class:`KVCompression` (policy and ratio).  Its prompt is
prefilled as usual (the first output token still sees the whole prompt); right
after the step that completes the prefill, each layer keeps
``n_keep = int(L * (1 - ratio))`` of the ``L`` prompt tokens per KV head (at least
one) and decoding goes on over the compressed cache, as NVIDIA kvpress does for
its presses.

Policies (scores per layer, per KV head, per token; the highest are kept):

* ``streaming_llm`` -- StreamingLLM (Xiao et al., 2023, "Efficient Streaming Language
  Models with Attention Sinks"): the first ``n_sink`` tokens plus the most recent ones.
* ``h2o`` -- Heavy-Hitter Oracle (Zhang et al., 2023): half the budget to the most recent
  tokens, the other half to the tokens that received the most attention, summed over
  every prompt query and the query heads of the KV head's group.
* ``snapkv`` -- SnapKV (Li et al., 2024): the last ``window`` prompt tokens are an
  observation window and always kept; the others are scored by the attention the window's
  queries give them (summed over the window and the group's query heads), smoothed by an
  average pool of width ``kernel``, top-k per KV head.
* ``knorm`` -- key-norm (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy
  for KV Cache Compression"): keep the keys with the smallest L2 norm.

Positions.  RoPE is applied before keys enter the cache, so a kept key carries its
original position; after compression the sequence remembers how many tokens were
dropped (``Sequence.kv_offset``) and every later token gets its true position
(token index) while its K/V go to the next free slot (KV index = token index -
kv_offset).  Different KV heads may keep different tokens: slot ``j`` of head ``h``
holds the ``j``-th kept token of that head; attention over the cache does not need
the tokens' identities, only their keys (positions already applied) and values.

Reuse.  The compressed K/V are written to fresh blocks and the prompt's full blocks
are released (full ones stay in the prefix cache, still holding the uncompressed KV).
A compressed sequence's blocks are never registered in the prefix cache and a session
never hands compressed KV to a later request, so no request that expects the full
cache is ever given a compressed one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import InvalidRequestError

PREFILL_COMPRESSION_POLICIES = ("streaming_llm", "h2o", "snapkv", "knorm")  # a request's (KVCompression)
_QUERY_CHUNK = 128  # queries per attention-probability block while observing (bounds memory)


# ---- what the request policies (here) and the session policies (kvkeeper.sessions.compress) share -----------
def n_keep(length: int, ratio: float) -> int:
    """Entries kept per layer and KV head out of ``length`` when a fraction ``ratio`` in [0, 1) is dropped:
    ``max(1, int(length * (1 - ratio)))`` (kvpress's rule)."""
    return max(1, int(length * (1.0 - ratio)))


def streaming_llm_keep(length: int, k: int, n_sink: int, kv_heads: int) -> torch.Tensor:
    """StreamingLLM's selection: indices (kv_heads, k) int64, ascending, of the first ``min(n_sink, k)`` entries
    (attention sinks) and the last ``k - sink`` of ``length`` (k <= length), the same for every KV head."""
    sink = min(n_sink, k)
    idx = torch.cat([torch.arange(sink), torch.arange(length - (k - sink), length)])
    return idx.expand(kv_heads, k).clone()


def knorm_scores(keys: torch.Tensor) -> torch.Tensor:
    """Key-norm scores: keys (L, KVH, D) float -> (KVH, L) float32, the negated L2 norm (the smallest norms score
    highest; RoPE rotates pairs of channels, so a cached, rotated key has its unrotated norm)."""
    return -keys.float().norm(dim=-1).t()


def top_entries(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` highest-scoring entries per KV head: scores (KVH, L) -> indices (KVH, k) int64, ascending."""
    return torch.topk(scores, k, dim=1, sorted=False).indices.sort(dim=1).values


@dataclass(frozen=True)
class KVCompression:
    """What to drop at the end of prefill.

    policy: one of :data:`PREFILL_COMPRESSION_POLICIES`.  ratio: fraction of the prompt's tokens removed, in [0, 1).
    n_sink: streaming_llm sink tokens.  window / kernel: snapkv observation window and pooling width (tokens).
    Raises InvalidRequestError for an unknown policy or a ratio outside [0, 1).
    """

    policy: str
    ratio: float
    n_sink: int = 4
    window: int = 64
    kernel: int = 5

    def __post_init__(self):
        if self.policy not in PREFILL_COMPRESSION_POLICIES:
            raise InvalidRequestError(f"unknown KV compression policy {self.policy!r}; choose one of "
                                      f"{', '.join(PREFILL_COMPRESSION_POLICIES)}")
        if not (0.0 <= self.ratio < 1.0):
            raise InvalidRequestError(f"compression ratio must be in [0, 1) (the fraction of prompt tokens "
                                      f"dropped), got {self.ratio}")

    def n_keep(self, length: int) -> int:
        """Tokens kept out of ``length`` (:func:`n_keep`)."""
        return n_keep(length, self.ratio)

    @property
    def needs_attention(self) -> bool:
        return self.policy in ("h2o", "snapkv")


class PrefillObserver:
    """Collects, during a sequence's prefill, the attention statistics its policy scores with.

    ``acc[layer]``: (KVH, L) float32 -- attention each key received (h2o: from every query;
    snapkv: from the observation window's queries).  L is the KV length at the end of prefill.
    """

    def __init__(self, comp: KVCompression, length: int, num_layers: int, num_kv_heads: int):
        self.comp = comp
        self.length = length
        self.acc = [torch.zeros(num_kv_heads, length) for _ in range(num_layers)] if comp.needs_attention else None

    def observe(self, layer: int, q: torch.Tensor, k: torch.Tensor, offset: int, scale: float) -> None:
        """q (n, H, D): queries at KV indices offset..offset+n-1; k (ctx, KVH, D): every key so far."""
        if self.acc is None:
            return
        n, H, D = q.shape
        ctx, kvh = k.shape[0], k.shape[1]
        first = 0
        if self.comp.policy == "snapkv":  # only the observation window's queries count
            first = max(0, self.length - min(self.comp.window, self.length) - offset)
        if first >= n:
            return
        kk = k.float().permute(1, 2, 0)  # (KVH, D, ctx)
        g = H // kvh
        acc = self.acc[layer]
        for a in range(first, n, _QUERY_CHUNK):
            b = min(n, a + _QUERY_CHUNK)
            qq = q[a:b].float().view(b - a, kvh, g, D).permute(1, 0, 2, 3).reshape(kvh, (b - a) * g, D)
            s = torch.bmm(qq, kk) * scale  # (KVH, rows * g, ctx)
            qpos = (torch.arange(a, b) + offset).repeat_interleave(g)
            s.masked_fill_(torch.arange(ctx)[None, :] > qpos[:, None], float("-inf"))
            acc[:, :ctx] += torch.softmax(s, dim=-1).sum(dim=1)


def select(comp: KVCompression, obs: PrefillObserver | None, layer: int, keys: torch.Tensor) -> torch.Tensor:
    """Indices (KVH, n_keep) int64, ascending, of the tokens each KV head keeps.

    keys: (L, KVH, D) the layer's cached keys (dequantized), L the prompt's KV length.
    """
    L, kvh = keys.shape[0], keys.shape[1]
    k = comp.n_keep(L)
    if k >= L:
        return torch.arange(L).expand(kvh, L).clone()
    if comp.policy == "streaming_llm":
        return streaming_llm_keep(L, k, comp.n_sink, kvh)
    if comp.policy == "knorm":
        scores = knorm_scores(keys)
    elif comp.policy == "h2o":
        recent = k // 2
        scores = obs.acc[layer][:, :L].clone()
        scores[:, L - recent:] = float("inf")  # the recent half is always kept
    else:  # snapkv
        w = min(comp.window, L)
        if k <= w:
            return torch.arange(L - k, L).expand(kvh, k).clone()
        prefix = obs.acc[layer][:, : L - w]
        if comp.kernel > 1 and prefix.shape[1] > 0:
            prefix = F.avg_pool1d(prefix[:, None], comp.kernel, stride=1, padding=comp.kernel // 2,
                                  count_include_pad=False)[:, 0, : L - w]
        scores = torch.cat([prefix, torch.full((kvh, w), float("inf"))], dim=1)
    return top_entries(scores, k)
