"""The kernels' thread pool (csrc/cpu/pool.cpp): results do not depend on the thread count or on who runs a task,
callers on several Python threads at once each get their own answer, and a forked child computes too (its pool
is a new one: the parent's workers do not exist there)."""

from __future__ import annotations

import os
import select
import threading

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as GT  # noqa: E402

from tests.kernels.test_kquant import random_weight  # noqa: E402
from tests.utils.kernels import kernels_or_skip  # noqa: E402

N, K = 1000, 2048  # 63 tasks of 16 rows, the last one short


@pytest.fixture(scope="module")
def kq():
    return kernels_or_skip()


@pytest.fixture(scope="module")
def weight():
    return torch.from_numpy(random_weight(GT.Q4_K, N, K, np.random.default_rng(7)))


def _with_threads(n: int, fn):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("m", [1, 3, 40, 300])
def test_results_do_not_depend_on_the_thread_count(kq, weight, m):
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(m))
    one = _with_threads(1, lambda: kq.kq_matmul(x, weight, int(GT.Q4_K), N, K))
    for threads in (2, 3, 8):  # more threads than this machine's cores: tasks wait, results are the same
        many = _with_threads(threads, lambda: kq.kq_matmul(x, weight, int(GT.Q4_K), N, K))
        assert torch.equal(one, many), f"{threads} threads changed the result of M={m}"


def test_callers_on_several_threads_get_their_own_results(kq, weight):
    xs = [torch.randn(2, K, generator=torch.Generator().manual_seed(100 + i)) for i in range(4)]
    want = [kq.kq_matmul(x, weight, int(GT.Q4_K), N, K) for x in xs]
    got: dict[int, list[torch.Tensor]] = {i: [] for i in range(4)}

    def run(i):
        for _ in range(15):  # the GIL is released: the calls overlap, one holds the pool, the others run alone
            got[i].append(kq.kq_matmul(xs[i], weight, int(GT.Q4_K), N, K))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    _with_threads(2, lambda: ([t.start() for t in threads], [t.join(timeout=120) for t in threads]))
    for i in range(4):
        assert len(got[i]) == 15 and all(torch.equal(y, want[i]) for y in got[i]), f"caller {i}"


def test_a_forked_child_computes_with_a_new_pool(kq, weight):
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(3))
    want = _with_threads(2, lambda: kq.kq_matmul(x, weight, int(GT.Q4_K), N, K))  # the parent's workers exist
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: the same product on 2 threads, its bytes back through the pipe
        try:
            torch.set_num_threads(2)
            os.write(w, kq.kq_matmul(x, weight, int(GT.Q4_K), N, K).numpy().tobytes())
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    while len(data) < N * 4:
        ready, _, _ = select.select([r], [], [], 120)
        assert ready, "the forked child did not answer within 120 s (a pool waiting on its parent's workers)"
        chunk = os.read(r, N * 4)
        if not chunk:
            break
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    assert np.array_equal(np.frombuffer(data, dtype=np.float32), want.numpy().reshape(-1))
