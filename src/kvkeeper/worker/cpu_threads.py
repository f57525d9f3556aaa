"""How many CPU threads the engine's kernels use: the CPUs this process may run on, not the host's.

torch (and the C++ kernels, which take torch's setting; see ``csrc/cpu/pool.cpp``) would start one thread per
CPU of the host.  In a container with a CPU quota (``docker --cpus 2`` on a 64-core host), a service with
systemd's ``CPUQuota=``, or under ``taskset``, that is far more threads than cores, and every parallel region
then waits on threads the scheduler has parked.  ``available_cpus`` is the smaller of the affinity mask and the
quota, as llama.cpp and the JVM count them.  The quota is read from the process's own cgroup and its ancestors
(``/proc/self/cgroup`` under the hierarchy's mount from ``/proc/self/mountinfo``), not only from the root of
``/sys/fs/cgroup``: a cgroup below the root (a systemd service, a container without its own cgroup namespace)
keeps its quota there.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

PROC_CGROUP = Path("/proc/self/cgroup")        # "<id>:<controllers>:<path>" per hierarchy (cgroups(7))
MOUNTINFO = Path("/proc/self/mountinfo")       # where each hierarchy is mounted, and from which of its folders


def _v2_cpus(folder: Path) -> float | None:
    """CPUs allowed by ``folder/cpu.max`` ("<quota us> <period us>", or "max <period>"); None: no quota there."""
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
        return None if quota == "max" or int(period) <= 0 else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1_cpus(folder: Path) -> float | None:
    """CPUs allowed by ``folder/cpu.cfs_quota_us`` over ``cpu.cfs_period_us`` (quota -1: none)."""
    try:
        quota, period = (int((folder / f"cpu.cfs_{n}_us").read_text()) for n in ("quota", "period"))
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def _unescape(field: str) -> str:
    """A mountinfo path field: space, tab, newline and backslash are written as octal escapes (``\\040``)."""
    for code, ch in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, ch)
    return field


def own_cgroups(proc_cgroup: Path = PROC_CGROUP, mountinfo: Path = MOUNTINFO,
                controller: str = "cpu") -> list[tuple[str, Path, Path]]:
    """(``"v2"`` or ``"v1"``, this process's cgroup folder, the hierarchy's mount point) for the unified (v2)
    hierarchy and a v1 one with ``controller`` (``cpu``, ``memory``), each mount once.  The folder is the cgroup's path from
    ``/proc/self/cgroup`` under the mount point, less the mount's own root (a container sees its cgroup mounted
    as ``/``; a path outside the mount's root: the mount point).  Empty where the files cannot be read."""
    try:
        own = [line.split(":", 2) for line in proc_cgroup.read_text().splitlines() if line.count(":") >= 2]
        mounts = mountinfo.read_text().splitlines()
    except OSError:
        return []
    v2_path = next((path for hid, ctrl, path in own if hid == "0" and ctrl == ""), None)
    v1_path = next((path for _, ctrl, path in own if controller in ctrl.split(",")), None)
    found: dict[Path, tuple[str, Path, Path]] = {}
    for line in mounts:  # proc(5): ID parent major:minor root mount-point options [optional...] - fstype source super
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        root, point = Path(_unescape(fields[3])), Path(_unescape(fields[4]))
        if tail[0] == "cgroup2" and v2_path is not None:
            version, path = "v2", Path(v2_path)
        elif tail[0] == "cgroup" and controller in tail[2].split(",") and v1_path is not None:
            version, path = "v1", Path(v1_path)
        else:
            continue
        folder = point / path.relative_to(root) if path.is_relative_to(root) else point
        found.setdefault(folder, (version, folder, point))
    return list(found.values())


def up_to(folder: Path, top: Path) -> list[Path]:
    """``folder`` and its ancestors up to the mount point ``top`` (a limit on any of them binds the process)."""
    out = [folder]
    while out[-1] != top and out[-1].parent != out[-1]:
        out.append(out[-1].parent)
    return out


def cpu_cgroup_folders(proc_cgroup: Path = PROC_CGROUP, mountinfo: Path = MOUNTINFO) -> list[tuple[str, Path]]:
    """(``"v2"`` or ``"v1"``, folder) of this process's own cgroup in each mounted hierarchy that can hold a CPU
    quota (see :func:`cgroup_cpu_limit`); empty where ``/proc`` cannot be read (not Linux)."""
    return [(version, folder) for version, folder, _ in own_cgroups(proc_cgroup, mountinfo)]


def cgroup_cpu_limit(proc_cgroup: Path = PROC_CGROUP, mountinfo: Path = MOUNTINFO) -> int | None:
    """CPUs allowed by the CPU quotas on this process's own cgroup and its ancestors up to the mount point (the
    smallest: a parent's quota binds its children), rounded up (1.5 CPUs -> 2); None when none of them has a
    quota or the files cannot be read.  cgroup v2 ``cpu.max`` and v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``
    alike (``docker --cpus``, systemd's ``CPUQuota=``); the JVM and Go's automaxprocs read the same files."""
    limits = []
    for version, folder, top in own_cgroups(proc_cgroup, mountinfo):
        read = _v2_cpus if version == "v2" else _v1_cpus
        limits += [cpus for cpus in map(read, up_to(folder, top)) if cpus is not None]
    return max(1, math.ceil(min(limits))) if limits else None


def available_cpus() -> int:
    """CPUs this process can use: its affinity mask (``taskset``, ``docker --cpuset-cpus``) capped by the
    cgroup CPU quota (``docker --cpus``); at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    return max(1, min(cpus, limit) if limit else cpus)


def choose_threads(requested: int | None, current: int) -> int:
    """The thread count for torch and the kernels: ``requested`` (``--threads``) when given, else torch's
    ``current`` setting capped at :func:`available_cpus` (a program that set fewer threads keeps them)."""
    return requested if requested else max(1, min(current, available_cpus()))


def set_torch_threads(requested: int | None) -> int:
    """Set torch's thread count (which the C++ kernels take too) to :func:`choose_threads`' choice for
    ``requested`` (None: the CPUs this process may use); returns the count now in use."""
    import torch

    threads = choose_threads(requested, torch.get_num_threads())
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    return threads
