"""The engine's thread count: the affinity mask capped by the cgroup CPU quota (kvkeeper.engine.cpu_threads)."""

from __future__ import annotations

import os

import pytest

from kvkeeper.engine import cpu_threads
from kvkeeper.engine.cpu_threads import available_cpus, cgroup_cpu_limit, choose_threads


def _files(tmp_path, v2=None, quota=None, period=None):
    p2 = tmp_path / "cpu.max"
    if v2 is not None:
        p2.write_text(v2)
    q, p = tmp_path / "cfs_quota_us", tmp_path / "cfs_period_us"
    if quota is not None:
        q.write_text(str(quota))
        p.write_text(str(period))
    return p2, (q, p)


@pytest.mark.parametrize("v2, want", [("max 100000\n", None), ("200000 100000\n", 2), ("150000 100000", 2),
                                      ("50000 100000", 1), ("garbage", None)])
def test_cgroup_v2_quota(tmp_path, v2, want):
    p2, v1 = _files(tmp_path, v2=v2)
    assert cgroup_cpu_limit(p2, v1) == want


@pytest.mark.parametrize("quota, want", [(-1, None), (300000, 3), (100000, 1)])
def test_cgroup_v1_quota_when_there_is_no_v2_file(tmp_path, quota, want):
    p2, v1 = _files(tmp_path, quota=quota, period=100000)
    assert cgroup_cpu_limit(p2, v1) == want


def test_no_cgroup_file_means_no_limit(tmp_path):
    p2, v1 = _files(tmp_path)
    assert cgroup_cpu_limit(p2, v1) is None


def test_quota_caps_the_affinity_mask(monkeypatch):
    monkeypatch.setattr(cpu_threads, "cgroup_cpu_limit", lambda: 1)
    assert available_cpus() == 1
    monkeypatch.setattr(cpu_threads, "cgroup_cpu_limit", lambda: None)
    assert available_cpus() == len(os.sched_getaffinity(0))


def test_requested_threads_win_and_fewer_threads_are_kept(monkeypatch):
    monkeypatch.setattr(cpu_threads, "available_cpus", lambda: 2)
    assert choose_threads(5, 64) == 5       # --threads 5
    assert choose_threads(None, 64) == 2    # torch would start 64 on a 64-core host with a 2-CPU quota
    assert choose_threads(None, 1) == 1     # the program asked torch for 1: kept
