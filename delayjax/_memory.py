"""How much memory a run may take: what the machine has available, read before anything is allocated."""

from __future__ import annotations

import os


def available_host_bytes() -> int | None:
  """The memory this machine can still give a process without swapping (Linux ``MemAvailable``; elsewhere
  the free physical pages), or ``None`` where neither can be read."""
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  try:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  except (ValueError, OSError, AttributeError):
    return None
