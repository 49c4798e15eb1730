"""How much host memory is available, so that a request too large to fit is refused before anything is allocated.

A simulation or a buffer whose size follows from its arguments (a number of
updates, a delay) can be sized from shapes alone. Refusing one that cannot fit
is better than letting it grow until the operating system kills the process,
which loses the work of everyone sharing the machine and says nothing about
which argument was too large.
"""

from __future__ import annotations

import os

__all__ = ["available_memory", "format_bytes", "check_fits"]


def available_memory() -> int | None:
  """Bytes of host memory available to a new allocation, or ``None`` when the system does not say.

  On Linux this is ``MemAvailable`` of ``/proc/meminfo`` (free memory plus
  what the kernel can reclaim without swapping); elsewhere the free physical
  pages (``os.sysconf``), a lower bound.
  """
  try:
    with open("/proc/meminfo", encoding="ascii") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  try:
    return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
  except (AttributeError, ValueError, OSError):
    return None


def format_bytes(num_bytes: float) -> str:
  """``num_bytes`` in a readable unit, with the exact count: ``"21.7 GiB (23300000000 bytes)"``."""
  num_bytes = int(num_bytes)
  for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if num_bytes >= scale:
      return f"{num_bytes / scale:.1f} {unit} ({num_bytes} bytes)"
  return f"{num_bytes} bytes"


def check_fits(what: str, needed: int, available: int | None, where: str = "available host memory") -> None:
  """Raises a ValueError naming ``what`` when ``needed`` bytes exceed ``available`` (not checked when unknown).

  Args:
    what: the argument and value responsible, e.g. ``"num_updates=10**15"``,
      and what it would allocate.
    needed: the bytes it needs.
    available: the bytes available, or ``None`` when unknown.
    where: what ``available`` measures, for the message.
  """
  if available is not None and needed > available:
    raise ValueError(f"{what} needs {format_bytes(needed)}, more than the {format_bytes(available)} of {where}.")
