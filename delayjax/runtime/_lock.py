"""The lock on a checkpoint directory: one live run writes it at a time.

Two processes checkpointing one run into one directory would interleave their
saves: one crashes inside the checkpoint library and the other's later resume
mixes the two runs' history rows (each frame's checksum being valid). The
runtimes therefore hold an exclusive ``flock`` on a file in the directory for
as long as a run reads or writes it. The operating system releases the lock
when its process ends, however it ends (``kill -9`` included), so a lock left
by a killed process is free for the next run to take, with nothing to clean
up; the pid written in the file only serves the refusal's message.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from typing import Iterator

import jax


@contextlib.contextmanager
def locked(directory: str, name: str) -> Iterator[None]:
  """Holds the lock of run ``name`` in ``directory`` (one lock per process of a multi-process run), or
  raises a ``ValueError`` naming the live process that holds it."""
  path = os.path.join(directory, f".{name}.lock-{jax.process_index()}")
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "another process"
      raise ValueError(
          f"checkpoint directory {directory!r} is in use by a live run ({holder}); two runs writing one "
          f"directory would mix their checkpoints. Wait for it to end, or give this run another "
          f"dj.Checkpoint directory.") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
    yield
  finally:
    os.close(fd)  # releases the lock
