"""``kvkeeper eval intervene``: the published cache "hotfixes" (:mod:`kvkeeper.kvcache.intervention`) measured.

Two measurements, each run once without an intervention (the baseline) and once per policy:

* **long document** (:func:`document_perplexity`): the first ``context`` tokens of a text, prefilled sentence by
  sentence as one sequence; at each sentence boundary the policy rewrites the sentence just finished (the text's
  first sentence is the anchor, the fresh recompute's context); every token after the anchor is scored, each
  predicted from the cache as the policy left it.  Reported: perplexity and its change against the baseline.
* **terminology** (:func:`terms_runs`): the WMT21 EN-FR documents translated as sessions (one segment a turn,
  greedy, the glossary condition, :mod:`kvkeeper.eval.term_translate`) with the policy applied at the end of each
  turn; scored with the WMT21 terminology metrics (:func:`kvkeeper.eval.terms.score`: term accuracy,
  consistency, ...), and the turns whose tokens equal the baseline's counted.

Sentence boundaries in a text (:func:`sentence_ends`): after a token whose text ends with ``.``, ``!`` or ``?``
(closing quotes or brackets after it allowed) when the next token starts with white space.
"""

from __future__ import annotations

import math
import time

import torch

from ..engine.sequence import Sequence
from ..errors import InvalidRequestError
from .intervention import KVIntervention, intervene
from ..sampling.params import SamplingParams
from ..engine.handle import EngineHandle

_CLOSERS = "\"')]\u201d\u2019"


def sentence_ends(tokenizer, ids: list[int]) -> list[int]:
    """Token indices where a sentence ends (exclusive: the next sentence starts there), in order, ending with
    ``len(ids)``."""
    texts = [tokenizer.decode([t]) for t in ids]
    ends = []
    for i in range(len(ids) - 1):
        t = texts[i].rstrip(_CLOSERS)
        if t.endswith((".", "!", "?")) and texts[i + 1][:1].isspace():
            ends.append(i + 1)
    if not ends or ends[-1] != len(ids):
        ends.append(len(ids))
    return ends


@torch.inference_mode()
def document_perplexity(engine: EngineHandle, ids: list[int], policy: KVIntervention | None, chunk: int = 512) -> dict:
    """Perplexity of ``ids`` prefilled sentence by sentence, ``policy`` (None: the baseline) applied to each
    sentence once it is complete, the first sentence being the anchor.

    Every token after the first sentence is scored (``len - anchor`` predictions), in float32.
    Returns ``{"ppl", "nll_mean", "scored_tokens", "sentences", "anchor_tokens", "interventions",
    "intervention_ms", "seconds"}`` (intervention_ms: the policy's wall time summed).
    Raises InvalidRequestError when the text has fewer than two sentences or does not fit the context or the KV pool.
    """
    n = len(ids)
    if n > engine.model_config.context_length:
        raise InvalidRequestError(f"{n} tokens exceed the model's context window of {engine.model_config.context_length}")
    ends = sentence_ends(engine.tokenizer, ids)
    if len(ends) < 2:
        raise InvalidRequestError("the text needs at least two sentences (the first is the anchor); use a longer "
                                  "--context")
    anchor = ends[0]
    seq = Sequence("intervene-ppl", list(ids), SamplingParams(max_tokens=1), engine.isolated_namespace("intervene"))
    targets = torch.tensor(ids[1:] + [0], dtype=torch.int64)
    nll, scored, count, ms = 0.0, 0, 0, 0.0
    t0 = time.perf_counter()
    if not engine.kv.allocate(seq, n):
        raise InvalidRequestError(f"{n} tokens do not fit the {engine.kv.num_free_blocks} free KV blocks; raise "
                                  "--kv-cache-bytes")
    try:
        start = 0
        for end in ends:
            while seq.num_computed < end:
                c = seq.num_computed
                m = min(chunk, end - c)
                logits = engine.kv.write_outside_scheduler(seq, m, "prompt")  # (m, vocab)
                seq.num_computed += m
                a, b = max(c, anchor - 1), min(c + m, n - 1)  # rows predicting tokens anchor .. n-1
                if b > a:
                    lp = torch.log_softmax(logits[a - c: b - c].float().cpu(), dim=-1)
                    nll -= float(lp.gather(1, targets[a:b, None]).sum().double())
                    scored += b - a
            if policy is not None and start >= anchor and end < n:
                ms += intervene(engine, seq, start, end, anchor, policy, chunk)["ms"]
                count += 1
            start = end
    finally:
        engine.kv.free(seq)
    mean = nll / scored
    return {"ppl": math.exp(mean), "nll_mean": mean, "scored_tokens": scored, "sentences": len(ends),
            "anchor_tokens": anchor, "interventions": count, "intervention_ms": ms,
            "seconds": time.perf_counter() - t0}


def terms_runs(engine: EngineHandle, docs: dict, segments: list, policies: list[KVIntervention | None], max_tokens: int,
               progress=None) -> dict:
    """Translate ``docs`` (:func:`kvkeeper.eval.term_translate.documents`) under the glossary condition once per
    policy (None: the baseline, also in namespaces of its own), score each run and compare its turns with the
    baseline's.

    Returns ``{name: {"scores": terms.score(...) overall, "identical_turns": [same, turns] against the
    baseline, "intervention_ms": summed, "seconds": summed over turns, "turns": the turn dicts}}``, names
    ``"none"`` and ``policy.name``.  progress: called with (name, doc_id, turns) after each document.
    """
    from . import term_translate as TT
    from . import terms as T

    chosen = [s for d in docs.values() for s in d]
    out: dict[str, dict] = {}
    base = None
    for pol in policies:
        name = "none" if pol is None else pol.name
        tr = TT.LocalTranslator(engine, max_tokens, reuse=True, intervention=pol, isolated=True)
        run = TT.translate_condition(tr, docs, "glossary", segments,
                                     progress=None if progress is None else (lambda d, r, n=name: progress(n, d, r)))
        sc = T.score(chosen, run["hyps"])
        turns = run["turns"]
        if pol is None:
            base = turns
        same = None if base is None else [sum(a["token_ids"] == b["token_ids"] for a, b in zip(turns, base)),
                                          len(turns)]
        out[name] = {"scores": sc["overall"], "identical_turns": same,
                     "intervention_ms": sum(t["intervention_ms"] or 0.0 for t in turns),
                     "seconds": sum(t["seconds"] for t in turns), "hyps": run["hyps"], "turns": turns}
    return out
