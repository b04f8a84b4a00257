"""CPU priority of batch processes (training, exports, evals) under Linux's autogroup scheduling.

With ``kernel.sched_autogroup_enabled`` (the default on desktop and most server kernels), every session
(``setsid``) is its own scheduling group and the groups share the CPU equally, whatever the nice values of
their processes: a nice value only orders processes inside one group. The worker starts its trainers in
sessions of their own (so that a cancel can signal the whole group), and `paddle.distributed.launch` gives
each rank its own session too, so ``os.nice(10)`` alone left a trainer competing with the API as an equal.
The group's own nice value (``/proc/self/autogroup``) is what the scheduler weighs between groups.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

AUTOGROUP = Path("/proc/self/autogroup")


def nice_own_session() -> bool:
    """Give this process's autogroup its nice value when the process is a session leader with a nice value
    above 0; True when the group's nice was set. A process that does not lead its session (``nice
    ernie-studio train`` typed in a shell) leaves its session alone: the group is the user's terminal.
    Kernels without autogroups (no file) and refusals (raising a group's priority needs CAP_SYS_NICE; we
    only lower it) change nothing."""
    if not sys.platform.startswith("linux"):
        return False
    niceness = os.getpriority(os.PRIO_PROCESS, 0)
    if niceness <= 0 or os.getsid(0) != os.getpid():
        return False
    try:
        AUTOGROUP.write_text(str(niceness))
    except OSError:
        return False
    return True


def autogroup_niceness() -> int | None:
    """This process's autogroup nice value (``/autogroup-85 nice 10`` -> 10); None without autogroups."""
    try:
        return int(AUTOGROUP.read_text().split("nice")[1])
    except (OSError, IndexError, ValueError):
        return None
