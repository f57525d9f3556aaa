"""kvkeeper.kvcache.formats.base.zeros: the KV pool's CPU tensors over an anonymous private memory map.

They read as zeros in every storage dtype, take writes, do not share memory between two pools, survive the
loss of every other reference to their map, and a fresh KVStore of a model's shapes is zero throughout.
"""

import gc

import pytest
import torch

from kvkeeper.kvcache.formats.base import parse_kv_format, zeros
from kvkeeper.kvcache.store import KVStore
from kvkeeper.weights import dummy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn])
def test_zeros_are_zero_and_writable(dtype):
    a, b = zeros((3, 16, 2, 8), dtype), zeros((3, 16, 2, 8), dtype)
    gc.collect()
    assert a.shape == (3, 16, 2, 8) and a.dtype == dtype and a.is_contiguous()
    assert not a.view(torch.uint8).any()
    a.view(torch.uint8)[1, 3] = 7
    assert a.view(torch.uint8).sum() == 7 * a[1, 3].numel() * a.element_size() and not b.view(torch.uint8).any()
    assert zeros((0, 4), dtype).numel() == 0


def test_a_fresh_store_is_zero():
    cfg, _ = dummy.load_config("llama-3-8b")
    cfg.num_layers = 2
    store = KVStore.allocate(cfg, 4, 16, parse_kv_format("bf16"))
    for layer in store:
        assert not layer.k.any() and not layer.v.any()
