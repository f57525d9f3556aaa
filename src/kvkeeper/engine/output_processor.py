"""After each step: append the sampled tokens, detokenize, record logprobs, decide which requests finished.

One object beside the scheduler, as nano-vllm's ``Scheduler.postprocess`` and vLLM v1's
``update_from_output``: the engine's step only schedules, runs the model and samples.
A request finishes on a stop string (the text stops before it), an EOS or stop token id
(unless ``ignore_eos``), when it reaches ``max_total_tokens``, or with an error when its
constraints left no token to sample (the sampler's ``NO_TOKEN``).
"""

from __future__ import annotations

import time

import torch

from ..sampling.sampler import NO_TOKEN
from ..text.detokenizer import IncrementalDetokenizer
from .sequence import Sequence


NO_TOKEN_ERROR = ("no token is allowed at this point: the output constraint (grammar), bad_words and "
                  "logit_bias together exclude every token; relax one of them")


class OutputProcessor:
    """Per-token bookkeeping of running requests.

    tokenizer: the model's tokenizer (for the incremental detokenizer).
    eos_token_ids: ids that end generation unless a request sets ``ignore_eos``.
    """

    def __init__(self, tokenizer, eos_token_ids: set[int]):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids

    def start(self, seq: Sequence) -> None:
        """Give a new request its detokenizer (it sees the prompt, so the first output piece decodes right)."""
        p = seq.params
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.token_ids, p.stop, p.skip_special_tokens)

    def process(self, seqs: list[Sequence], token_ids: list[int], logprobs: list[torch.Tensor | None]) -> list[Sequence]:
        """Append one sampled token to each sequence; returns those that finished (``finish_reason`` set).

        token_ids: one id per sequence (``NO_TOKEN``: nothing was allowed, the sequence finishes with an
        error and the batch goes on); logprobs: per sequence a (vocab,) float32 log-softmax, or None when
        the request asked for none.
        """
        now = time.perf_counter()
        finished = []
        for seq, tok, lp in zip(seqs, token_ids, logprobs):
            if tok == NO_TOKEN:
                seq.finish_reason, seq.error = "error", NO_TOKEN_ERROR
                finished.append(seq)
                continue
            seq.token_ids.append(tok)
            if seq.processors is not None:
                seq.processors.accept(tok)  # penalties count it, a grammar advances
            if seq.t_first_token is None:
                seq.t_first_token = now
            seq.t_last_token = now
            if lp is not None:
                seq.logprobs.append(_logprob_entry(tok, lp, seq.params.logprobs or 0))
            if tok in seq.params.stop_token_ids:  # its id is returned, its text is not (vLLM's detokenizer)
                seq.text += seq.detokenizer.flush()
            else:
                seq.text += seq.detokenizer.add(tok)
            reason = self._finish_reason(seq, tok)
            if reason:
                if not seq.detokenizer.stopped:
                    seq.text += seq.detokenizer.flush()
                seq.finish_reason = reason
                finished.append(seq)
        return finished

    def _finish_reason(self, seq: Sequence, tok: int) -> str | None:
        if seq.detokenizer.stopped:
            seq.stop_string = seq.detokenizer.stop_string
            return "stop"
        if (tok in self.eos_token_ids and not seq.params.ignore_eos) or tok in seq.params.stop_token_ids:
            return "stop"
        if len(seq.token_ids) >= seq.max_total_tokens:
            return "length"
        return None


def _logprob_entry(tok: int, lp: torch.Tensor, k: int) -> dict:
    """``{"token_id", "logprob", "top": [(id, logprob)] * k}`` for one sampled token."""
    top = torch.topk(lp, k) if k else None
    return {"token_id": tok, "logprob": float(lp[tok]),
            "top": [] if top is None else list(zip(top.indices.tolist(), top.values.tolist()))}
