"""What this machine offers the tool, read without importing torch (--help and path errors must not wait for it)."""

import os


def cores() -> int:
    """The CPU cores this process may run on: its affinity mask (taskset, a container's cpuset), which
    os.cpu_count ignores."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
