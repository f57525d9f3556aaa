"""How many CPU threads the engine's kernels use: the CPUs this process may run on, not the host's.

torch (and the C++ kernels, which take torch's setting; see ``csrc/cpu/pool.cpp``) would start one thread per
CPU of the host.  In a container with a CPU quota (``docker --cpus 2`` on a 64-core host: the cgroup's
``cpu.max``) or under ``taskset``, that is far more threads than cores, and every parallel region then waits
on threads the scheduler has parked.  ``available_cpus`` is the smaller of the affinity mask and the quota,
as llama.cpp and the JVM count them.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_V2_MAX = Path("/sys/fs/cgroup/cpu.max")                       # "<quota us> <period us>" or "max <period>"
CGROUP_V1 = (Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us"))


def cgroup_cpu_limit(v2: Path = CGROUP_V2_MAX, v1: tuple[Path, Path] = CGROUP_V1) -> int | None:
    """CPUs allowed by the cgroup's CPU quota, rounded up (1.5 CPUs -> 2); None when there is no quota or no
    readable cgroup file (cgroup v2 ``cpu.max`` first, then v1's ``cfs_quota_us`` / ``cfs_period_us``)."""
    try:
        quota, period = v2.read_text().split()[:2]
        if quota != "max":
            return max(1, math.ceil(int(quota) / int(period)))
        return None
    except (OSError, ValueError):
        pass
    try:
        quota, period = int(v1[0].read_text()), int(v1[1].read_text())
        return max(1, math.ceil(quota / period)) if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


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
