"""The engine's thread count: the affinity mask capped by the CPU quota of the process's own cgroup
(kvkeeper.worker.cpu_threads)."""

from __future__ import annotations

import os

import pytest

from kvkeeper.worker import cpu_threads
from kvkeeper.worker.cpu_threads import available_cpus, cgroup_cpu_limit, choose_threads, cpu_cgroup_folders

V2_MOUNT = "30 25 0:26 {root} {point} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate"
V1_MOUNT = "32 25 0:29 {root} {point} rw,relatime - cgroup cgroup rw,cpu,cpuacct"


def _tree(tmp_path, cgroup: str, mounts: list[str], files: dict[str, str]):
    """A fake /proc/self/cgroup and /proc/self/mountinfo (``{tmp}`` in ``mounts`` is ``tmp_path``) and the cgroup
    files ``files`` (path under ``tmp_path`` -> content); returns the two /proc paths."""
    proc_cgroup, mountinfo = tmp_path / "proc-cgroup", tmp_path / "mountinfo"
    proc_cgroup.write_text(cgroup)
    mountinfo.write_text("\n".join(m.replace("{tmp}", str(tmp_path)) for m in mounts) + "\n")
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return proc_cgroup, mountinfo


@pytest.mark.parametrize("cpu_max, want", [("max 100000\n", None), ("200000 100000\n", 2), ("150000 100000", 2),
                                           ("50000 100000", 1), ("garbage", None)])
def test_v2_quota_of_the_process_own_cgroup_below_the_root(tmp_path, cpu_max, want):
    # a systemd service (CPUQuota=) or a container without its own cgroup namespace: the quota is on the
    # process's cgroup, not on the root of the mount (which has no cpu.max at all)
    paths = _tree(tmp_path, "0::/system.slice/kvk.service\n", [V2_MOUNT.format(root="/", point="{tmp}/cg")],
                  {"cg/system.slice/kvk.service/cpu.max": cpu_max})
    assert cgroup_cpu_limit(*paths) == want


@pytest.mark.parametrize("quota, want", [(-1, None), (300000, 3), (100000, 1)])
def test_v1_quota_of_the_process_own_cgroup(tmp_path, quota, want):
    paths = _tree(tmp_path, "5:cpu,cpuacct:/kvk\n4:memory:/kvk\n0::/\n",
                  [V1_MOUNT.format(root="/", point="{tmp}/cpu,cpuacct")],
                  {"cpu,cpuacct/kvk/cpu.cfs_quota_us": str(quota), "cpu,cpuacct/kvk/cpu.cfs_period_us": "100000"})
    assert cpu_cgroup_folders(*paths) == [("v1", tmp_path / "cpu,cpuacct" / "kvk")]
    assert cgroup_cpu_limit(*paths) == want


def test_a_parent_quota_binds_its_children(tmp_path):
    paths = _tree(tmp_path, "0::/outer/inner\n", [V2_MOUNT.format(root="/", point="{tmp}/cg")],
                  {"cg/outer/cpu.max": "100000 100000", "cg/outer/inner/cpu.max": "max 100000",
                   "cg/cpu.max": "400000 100000"})
    assert cgroup_cpu_limit(*paths) == 1


def test_a_container_sees_its_cgroup_as_the_mount_root(tmp_path):
    # the mount's root is the container's cgroup: /proc/self/cgroup's path maps onto the mount point itself
    paths = _tree(tmp_path, "0::/docker/abc\n", [V2_MOUNT.format(root="/docker/abc", point="{tmp}/cg")],
                  {"cg/cpu.max": "200000 100000"})
    assert cpu_cgroup_folders(*paths) == [("v2", tmp_path / "cg")]
    assert cgroup_cpu_limit(*paths) == 2


def test_hybrid_hierarchies_take_the_smaller_quota_and_escaped_mount_points(tmp_path):
    paths = _tree(tmp_path, "3:cpu:/a\n0::/a\n", [V2_MOUNT.format(root="/", point="{tmp}/uni\\040fied"),
                                                  V1_MOUNT.format(root="/", point="{tmp}/cpu")],
                  {"uni fied/a/cpu.max": "300000 100000", "cpu/a/cpu.cfs_quota_us": "200000",
                   "cpu/a/cpu.cfs_period_us": "100000"})
    assert cgroup_cpu_limit(*paths) == 2


def test_no_quota_file_or_no_proc_means_no_limit(tmp_path):
    paths = _tree(tmp_path, "0::/a\n", [V2_MOUNT.format(root="/", point="{tmp}/cg")], {})
    assert cgroup_cpu_limit(*paths) is None
    assert cgroup_cpu_limit(tmp_path / "absent", tmp_path / "absent too") is None


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
