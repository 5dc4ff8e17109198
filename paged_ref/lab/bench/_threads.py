"""The threads a process tree really ran, read from ``/proc``: what a benchmark records beside a thread setting.

`cpu_times` snapshots the CPU time of every thread of a process and of its descendants (vLLM's engine core
and its worker are child processes); `busy` compares two snapshots over a run's wall time: per process,
its name, the CPUs it may run on, its threads, how many were busy (each on a CPU for at least ``share`` of
the wall time) and its CPU time. Linux only: elsewhere the snapshots are empty and nothing is claimed.

Example:
    >>> import os, time
    >>> before = cpu_times(os.getpid())
    >>> x = sum(i * i for i in range(300_000))
    >>> mine = [p for p in busy(before, cpu_times(os.getpid()), wall_s=1.0, share=0.0) if p["pid"] == os.getpid()]
    >>> not os.path.exists("/proc/self/task") or mine[0]["threads"] >= 1
    True
"""

from __future__ import annotations

import os

__all__ = ["cpu_times", "busy"]

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (scanning ``/proc/*/stat`` for parent ids)."""
    parent_of = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _read(f"/proc/{name}/stat")
            if stat:
                parent_of[int(name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        kids = [c for c, p in parent_of.items() if p in frontier]
        found += kids
        frontier = kids
    return found


def cpu_times(pid: int) -> dict:
    """``{pid: {"name", "cpus", "threads": {tid: cpu seconds}}}`` for ``pid`` and its descendants."""
    if not os.path.isdir("/proc/self/task"):
        return {}
    out = {}
    for p in [pid, *_children(pid)]:
        status = _read(f"/proc/{p}/status") or ""
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        threads, allowed = {}, {}
        for tid in os.listdir(f"/proc/{p}/task") if os.path.isdir(f"/proc/{p}/task") else []:
            stat = _read(f"/proc/{p}/task/{tid}/stat")
            if stat:
                rest = stat.rsplit(")", 1)[1].split()  # fields after the name: state is rest[0]
                threads[int(tid)] = (int(rest[11]) + int(rest[12])) / _TICK  # utime + stime
                status = (_read(f"/proc/{p}/task/{tid}/status") or "").splitlines()
                line = [x for x in status if x.startswith("Cpus_allowed_list:")]  # not Cpus_allowed, a hex mask
                allowed[int(tid)] = line[0].split(":", 1)[1].strip() if line else "?"
        out[p] = {"name": fields.get("Name", "?").strip(), "cpus": fields.get("Cpus_allowed_list", "?").strip()}
        out[p].update(threads=threads, thread_cpus=allowed)
    return out


def busy(before: dict, after: dict, *, wall_s: float, share: float = 0.25) -> list[dict]:
    """Per process of ``after``: ``{"pid", "name", "cpus", "threads", "busy_threads", "busy_cpus", "cpu_s",
    "top_threads_cpu_s"}``: the busy threads those whose CPU time between the snapshots is at least ``share`` of
    ``wall_s``, ``busy_cpus`` the CPUs they may run on (each thread's own list: OpenMP binds threads one by one),
    ``top_threads_cpu_s`` the CPU seconds of the four busiest threads."""
    rows = []
    for pid, proc in after.items():
        old = before.get(pid, {}).get("threads", {})
        used = {tid: t - old.get(tid, 0.0) for tid, t in proc["threads"].items()}
        busy_tids = [tid for tid, u in used.items() if u >= share * wall_s]
        rows.append(
            {
                "pid": pid,
                "name": proc["name"],
                "cpus": proc["cpus"],
                "threads": len(used),
                "busy_threads": len(busy_tids),
                "busy_cpus": sorted({proc.get("thread_cpus", {}).get(t, proc["cpus"]) for t in busy_tids}),
                "cpu_s": round(sum(used.values()), 3),
                "top_threads_cpu_s": [round(u, 2) for u in sorted(used.values(), reverse=True)[:4]],
            }
        )
    return sorted(rows, key=lambda r: -r["cpu_s"])
