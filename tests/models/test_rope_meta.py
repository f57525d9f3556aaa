"""RoPE tables of a model built on the meta device (as the runner builds every model before loading weights).

The tables are meta tensors of the real shape (no arithmetic on the meta device: it imports torch._dynamo and
sympy, seconds at start-up), and ``build_rope`` on CPU gives exactly the tables a CPU-built RotaryEmbedding has.
"""

import subprocess
import sys

import torch

from kvkeeper.layers.rope import RotaryEmbedding
from kvkeeper.weights import dummy


def test_meta_tables_have_the_shape_and_build_rope_fills_them():
    cfg, _ = dummy.load_config("llama-3.1-8b")  # llama3 RoPE scaling
    with torch.device("meta"):
        meta = RotaryEmbedding(cfg, max_positions=64)
    ref = RotaryEmbedding(cfg, max_positions=64)
    assert meta.cos.device.type == "meta" and meta.cos.shape == ref.cos.shape == (64, cfg.head_dim)

def test_build_rope_computes_the_cpu_tables():
    cfg, _ = dummy.load_config("llama-3.1-8b")
    cfg.num_layers = 1
    from kvkeeper.models.llama import skip_init
    from kvkeeper.models.registry import causal_lm_class

    with skip_init(), torch.device("meta"):
        model = causal_lm_class(cfg)(cfg)
    assert model.rope.cos.device.type == "meta"
    model.build_rope(torch.device("cpu"))
    ref = RotaryEmbedding(cfg)
    assert torch.equal(model.rope.cos, ref.cos) and torch.equal(model.rope.sin, ref.sin)


def test_building_a_model_on_meta_imports_no_dynamo():
    code = ("import sys, torch\nfrom kvkeeper.weights import dummy\nfrom kvkeeper.models.llama import skip_init\n"
            "from kvkeeper.models.registry import causal_lm_class\n"
            "cfg, _ = dummy.load_config('llama-3.1-8b'); cfg.num_layers = 2\n"
            "with skip_init(), torch.device('meta'):\n    m = causal_lm_class(cfg)(cfg)\n"
            "m.build_rope(torch.device('cpu'))\n"
            "assert m.rope.cos.device.type == 'cpu' and m.rope.cos.abs().sum() > 0\n"
            "print('torch._dynamo' in sys.modules, 'sympy' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]
