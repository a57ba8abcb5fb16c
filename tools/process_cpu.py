"""Where a machine's cores go during a window: CPU seconds of every process, grouped by Ray role (Linux /proc).

    before = snapshot(); ...run...; after = snapshot()
    cpu_by_role(before, after)   # {"ray::LearnerWorker": 5.9, "ray::RolloutWorker": 5.4, "driver": 0.5, "raylet": 0.3, ...}
    busy_fraction(before, after) # the share of all cores' time not idle

Used by `tools/bench.py pipeline`: with every core busy, a configuration's step cannot be shorter than its CPU per
step over the cores, whatever the orchestration does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class Snapshot:
    cpu_s: dict[int, tuple[float, str]]
    """pid -> (user + system CPU seconds so far, its role)."""
    idle_s: float
    """All cores' idle (and I/O wait) seconds since boot."""
    total_s: float
    """All cores' seconds since boot."""


def role_of(cmdline: str, pid: int, driver_pid: int) -> str:
    """A process's role: "driver" (this process), "ray::<ActorClass>" for an actor's worker (Ray renames its
    process so), "raylet", "gcs_server", "ray (other)" for Ray's other processes (agents, log monitor, idle
    workers), else "other processes"."""
    if pid == driver_pid:
        return "driver"
    if cmdline.startswith("ray::"):
        name = cmdline.split()[0]
        return "ray (other)" if name == "ray::IDLE" else name
    program = cmdline.split(" ", 1)[0]
    for binary in ("raylet", "gcs_server"):
        if program.endswith("/" + binary):
            return binary
    return "ray (other)" if "/ray/" in cmdline else "other processes"


def snapshot() -> Snapshot:
    """Every process's CPU time now, and the machine's idle and total time (empty where there is no /proc)."""
    cpu_s, me = {}, os.getpid()
    if not os.path.isdir("/proc"):
        return Snapshot({}, 0.0, 0.0)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # ended meanwhile
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state is fields[0], utime fields[11]
        cpu_s[int(entry)] = ((int(fields[11]) + int(fields[12])) / TICKS_PER_S, role_of(cmdline, int(entry), me))
    with open("/proc/stat") as f:  # user nice system idle iowait irq softirq steal (guest time is within user)
        times = [int(t) for t in f.readline().split()[1:9]]
    return Snapshot(cpu_s, (times[3] + times[4]) / TICKS_PER_S, sum(times) / TICKS_PER_S)


def cpu_by_role(before: Snapshot, after: Snapshot) -> dict[str, float]:
    """CPU seconds each role used between the snapshots, most first: a process counts under its role at the end
    (an idle worker that became an actor meanwhile, under the actor's), one started meanwhile from 0. Processes that
    ended meanwhile are not counted."""
    used: dict[str, float] = {}
    for pid, (cpu, role) in after.cpu_s.items():
        spent = cpu - before.cpu_s.get(pid, (0.0, role))[0]
        if spent > 0:
            used[role] = used.get(role, 0.0) + spent
    return dict(sorted(used.items(), key=lambda item: -item[1]))


def busy_fraction(before: Snapshot, after: Snapshot) -> float:
    """The share of all cores' time between the snapshots that was not idle."""
    total = after.total_s - before.total_s
    return 1.0 - (after.idle_s - before.idle_s) / total if total > 0 else 0.0
