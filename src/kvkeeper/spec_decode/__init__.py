"""Speculative decoding (``--speculative-config``) from the conversation itself: draft tokens from what the sequence already holds, verify
them in one engine step, keep what the target model would have produced.

Draft sources (cheapest first; only method "suffix" drafts from other requests, and only from those of the same
cache namespace, so no draft crosses a tenant or a cache salt):

* **Predicted Outputs** (OpenAI's ``prediction``): the text the client expects back (a file being edited),
  tokenized once; a pointer follows the output through it and re-synchronises after a divergence on the first
  later occurrence of the output's last n-gram (``prompt_lookup_max`` down to 1 token).
* **Prompt lookup** (``method: "ngram"``, as vLLM's n-gram proposer and transformers' prompt lookup decoding,
  Saxena 2023): the longest suffix n-gram of the sequence's own tokens (prompt, which holds the session's earlier
  turns, plus output), ``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens, looked up among its earlier
  occurrences (the latest one followed by a whole draft's worth of tokens, else the latest); the tokens that followed
  it are the draft.  An incremental index keeps this
  O(n-gram sizes) per token.
* **Suffix** (``method: "suffix"``, as vLLM names it; SuffixDecoding, Oliaro et al., 2024): prompt lookup first,
  then, when the sequence's own tokens hold no match, a suffix tree over the earlier requests of the *same cache
  namespace* (model, adapter, tenant and cache salt: :class:`SuffixTable`, one per namespace, never shared across
  tenants or namespaces): their prompts (the part the prefix cache did not already hold: a session's new turn) and
  outputs, with each continuation's frequency; the draft follows the most frequent continuation while its
  estimated probability is at least ``suffix_decoding_min_token_prob``.

Verification (:func:`verify`): a decode row carrying k drafts is scored in one step as k + 1 decode rows of the
sequence (token i attends to the cache through itself; every row's K/V is written before any row's attention, so
the rows see the drafts before them), which on the default CPU path runs inside the fused decode step and, the
kernels being batch invariant (issue 26), gives each row's logits bit for bit as plain decoding would.  Tokens are
then taken row by row exactly as plain decoding takes them (processors, logprobs, stop strings, EOS, max_tokens)
until a row's token differs from the draft it scored: the accepted drafts plus one token from the first rejected
row (or the bonus row after the last draft) are emitted.  With temperature > 0 a draft is accepted with the
standard speculative-sampling rule (:func:`kvkeeper.sampling.sampler.speculative_sample`), so the output
distribution is the target model's.

Adaptive (:class:`Drafter`), from a cost model: a step of R decode rows takes about ``base + per_row * R`` seconds
(:class:`StepCost`, fitted online to the engine's decode-only steps: on this CPU a row's quantized matmuls make
``per_row`` a large share of a step, on a GPU it is small).  Each sequence keeps a decayed estimate ``a`` of the chance
that its next draft token is accepted given the previous one was (:attr:`SpecState.rate`; prior 1/2, 4/5 for a
prediction), so k drafts bring E(k) = 1 + a + ... + a^k tokens.  Its draft length is the k (at most
``num_speculative_tokens``) that makes the step's tokens per second highest, the other S - 1 sequences of the step
making one token each: (S - 1 + E(k)) / (base + per_row * (S + k)) (:meth:`Drafter.length`).  A single stream whose
drafts are accepted drafts long ones; a large batch is compute-bound (its step time grows with every row) and drafts
nothing.  Until the step timings fit it, a row costs :data:`ROW_COST` of a one-row step (measured on the
embedded model on this CPU: 19 ms for one row, about 2.6 ms more per row).  A sequence whose estimate admits no draft
pauses drafting for ``PAUSE_TOKENS`` output tokens (doubling
each time, up to ``MAX_PAUSE_TOKENS``), then tries again from the prior.  vLLM's ``disable_by_batch_size`` stays as
a hard gate.

The modules, one concept each (vLLM's ``v1/spec_decode`` shape): :mod:`.config` (``SpeculativeConfig``),
:mod:`.ngram_proposer` (prompt lookup: ``NgramIndex``), :mod:`.suffix_proposer` (``SuffixTable``),
:mod:`.prediction_proposer` (Predicted Outputs), :mod:`.cost_model` (``StepCost``, the draft length),
:mod:`.metrics` (``SpecStats``, a sequence's ``SpecState``), :mod:`.drafter` (``Drafter``: proposes and records),
:mod:`.verify` (the verify rows' tokens).  It sits beside the engine (layer table of docs/architecture.md): it
reads :class:`kvkeeper.engine.sequence.Sequence`; the engine's step calls it.
"""
