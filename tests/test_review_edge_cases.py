"""Edge cases found by an adversarial review of the KV telemetry / dump / offload / breaker features."""

from __future__ import annotations

import time

import pytest

from kvkeeper.diagnostics.kvdump import parse_layers
from kvkeeper.errors import InvalidRequestError


@pytest.mark.parametrize("num_layers", [30, None])
def test_huge_layer_range_is_refused_at_once(num_layers):
    # "0-99999999999" used to build a set of 1e11 ints on the engine thread (the server ran out of memory)
    t0 = time.perf_counter()
    if num_layers is None:
        assert parse_layers("0-99999999999", None) is not None  # syntax only: valid, not expanded
    else:
        with pytest.raises(InvalidRequestError, match="layer 99999999999 does not exist.*0..29"):
            parse_layers("0-99999999999", num_layers)
    assert time.perf_counter() - t0 < 1.0
    assert parse_layers("2-4,0", 30) == [0, 2, 3, 4]


def test_kv_dump_errors_are_messages_under_python_m_kvkeeper_cli(tmp_path):
    # `python -m kvkeeper.cli` runs the module as __main__; the kv subcommands raise kvkeeper.cli.CLIError,
    # which must still be caught (it printed a traceback and exited 1)
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "kvkeeper.cli", "kv", "dump", "--session", "s1",
                        "-o", str(tmp_path / "x.safetensors")], capture_output=True, text=True, timeout=120,
                       env=os.environ.copy())
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert "error: --session needs --server URL" in r.stderr


def test_kv_dump_to_a_folder_is_refused_before_any_work(tmp_path, monkeypatch):
    import kvkeeper.cli as cli

    def no_engine(args):
        raise AssertionError("the model was loaded before the output path was checked")

    monkeypatch.setattr(cli.kv, "load_engine", no_engine)
    assert cli.main(["kv", "dump", "--prompt", "Hi", "-o", str(tmp_path)]) == 2


@pytest.mark.parametrize("query", ["interval=abc", "interval=", "interval=-5", "cell=x&cols=y"])
def test_admin_page_refresh_interval_is_never_nan(query):
    # ?interval=abc gave setInterval(refresh, NaN): the page fetched /admin/kv.json (built on the engine thread)
    # as fast as the browser could
    import json
    import re
    import shutil
    import subprocess

    from kvkeeper.api.admin import page_html

    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    m = re.search(r"const P = \{.*?\};", page_html(), re.S)
    assert m, "the page's parameter object P was not found"
    js = f"const q = new URLSearchParams({json.dumps(query)});\n{m.group(0)}\nconsole.log(JSON.stringify(P));"
    out = json.loads(subprocess.run([node, "-e", js], capture_output=True, text=True, timeout=30, check=True).stdout)
    assert isinstance(out["interval"], int) and out["interval"] >= 200, out


@pytest.mark.parametrize("limit", ["0", "-1"])
def test_kv_audit_limit_below_one_is_refused(limit, tmp_path, monkeypatch, capsys):
    # --limit -1 (or 0) audited nothing and exited 0: "no divergence" for a run that checked no request
    import kvkeeper.cli as cli

    monkeypatch.setattr(cli.kv, "load_engine", lambda args: pytest.fail("the model was loaded"))
    f = tmp_path / "c.jsonl"
    f.write_text('{"turns": ["Hi"]}\n')
    with pytest.raises(SystemExit) as e:
        cli.main(["kv", "audit", "--conversations", str(f), "--limit", limit])
    assert e.value.code == 2 and "--limit" in capsys.readouterr().err


def test_parse_layers_takes_one_int_and_refuses_other_types_clearly():
    # dump_session(eng, "s", 3) raised AttributeError: 'int' object has no attribute 'split'
    assert parse_layers(3, 30) == [3]
    assert parse_layers((0, 2), 30) == [0, 2]
    for bad in (True, 1.5, {"a": 1}):
        with pytest.raises(InvalidRequestError, match="layers must be"):
            parse_layers(bad, 30)


def _dump(k0, v0):
    import torch

    meta = {"layers": "0", "token_start": "10", "token_end": str(10 + k0.shape[0]), "model_revision": "r",
            "namespace": "n", "kv_dtype": "float32", "token_ids": "[]"}
    return {"layers.0.k": k0, "layers.0.v": v0}, meta


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_kv_diff_reports_nan_or_inf_as_divergence(bad):
    # a dump with NaN KV was reported as "max |diff| 0; no divergence" (exit 0), and --json printed NaN
    import json

    import torch

    from kvkeeper.diagnostics.kvdiff import diff_dumps, format_report, to_json

    k = torch.randn(6, 3, 8, generator=torch.Generator().manual_seed(0))
    v = torch.randn(6, 3, 8, generator=torch.Generator().manual_seed(1))
    k2 = k.clone()
    k2[4, 1, 2] = bad
    for a, b in ((_dump(k, v), _dump(k2, v)), (_dump(k2, v), _dump(k, v))):
        r = diff_dumps(a, b, atol=1e-3)
        assert r["first_divergent"] == {"layer": 0, "token": 14, "tensor": "k"}, r
        assert any("NaN or infinite" in w for w in r["warnings"])
        json.loads(to_json(r), parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
        assert "no divergence" not in format_report(r)
    same = diff_dumps(_dump(k2, v), _dump(k2.clone(), v))  # the same bits on both sides: no divergence
    assert same["first_divergent"] is None and same["max_abs"] == 0.0


def test_a_tiny_temperature_samples_greedily_instead_of_crashing():
    # schemathesis sent temperature 6.25e-270: logits / T overflowed (T is 0 in float32) and
    # torch.multinomial raised on NaN probabilities, failing the engine step (a 500)
    import torch

    from kvkeeper.sampling.params import SamplingParams
    from kvkeeper.sampling.sampler import make_generator, sample

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=t, seed=1) for t in (6.25e-270, 1e-6, 1e-4)]
    ids, _ = sample(logits, params, [make_generator(p) for p in params])
    assert ids == logits.argmax(-1).tolist()
