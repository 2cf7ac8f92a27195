"""Where a starting drafter runs, and at which priority, from the moment it exists.

A drafter started by the worker inherits the worker's CPU affinity (the target's cores) and priority; it
pins itself to its own cores only once torch is imported (drafter/server.py `place_process`). A replacement
started after a fault therefore loads on the target's cores for its first second or more, and its load
competes with the steps that keep the streams going (benchmarks/notes.md "A drafter fault's pause"). So the
worker puts the new process on its draft cores right after starting it (one thread then; threads started
later inherit both settings) and lowers its priority while it loads, where the drafter may raise it back
once loaded (root, or an RLIMIT_NICE that allows it): an unprivileged process cannot undo a lower priority,
and a drafter left at a low priority for good would lose its cores to every unpinned process.
"""
from __future__ import annotations

import os
import resource

LOADING_NICE_STEP = 10  # how much lower a loading drafter's priority is than the worker's (nice units)


def may_raise_priority_to(nice: int) -> bool:
    """Whether a process with this one's privileges and limits may lower its nice value to `nice`
    (Linux: CAP_SYS_NICE, approximated by root, or RLIMIT_NICE >= 20 - nice)."""
    if os.geteuid() == 0:
        return True
    soft = resource.getrlimit(resource.RLIMIT_NICE)[0]
    return soft == resource.RLIM_INFINITY or soft >= 20 - nice


def loading_nice() -> int | None:
    """The priority to restore once loaded if a starting drafter is to load at a lower one, else None."""
    own = os.getpriority(os.PRIO_PROCESS, 0)
    return own if own < 19 and may_raise_priority_to(own) else None


def place_started(pid: int, cores: list[int], restore_nice: int | None) -> list[str]:
    """Put the just-started process `pid` on `cores` (if any) and, when `restore_nice` is set, at a lower
    priority until it restores that one itself (`restore_priority`). Returns what could not be done."""
    problems = []
    if cores:
        try:
            os.sched_setaffinity(pid, set(cores))
        except OSError as err:  # it exited already, or the cores are not ours: it pins itself later anyway
            problems.append(f"affinity: {err}")
    if restore_nice is not None:
        try:
            os.setpriority(os.PRIO_PROCESS, pid, min(19, restore_nice + LOADING_NICE_STEP))
        except OSError as err:
            problems.append(f"priority: {err}")
    return problems


def restore_priority(nice: int) -> list[int]:
    """Set every thread of this process to `nice` (priority is per thread on Linux). Returns the threads
    left as they were (normally none)."""
    stuck = []
    for tid in sorted(int(t) for t in os.listdir("/proc/self/task")):
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) != nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError:  # a thread that exited meanwhile, or a limit that forbids it
            stuck.append(tid)
    return stuck
