"""What the machine has free: the host's available memory, for the checks that refuse work that cannot fit."""

from __future__ import annotations

import os


def available_bytes() -> int | None:
    """The host memory the kernel says a new allocation can take without swapping (MemAvailable), or the free
    physical pages where /proc/meminfo does not exist; None when neither can be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
