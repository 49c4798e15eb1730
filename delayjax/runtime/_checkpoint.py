"""Checkpoints of a runtime's state: the carry, the records so far, the chunks done and the run's fingerprint.

One file per run, written atomically (a temporary file, then a rename), so a
process killed at any moment leaves either the previous checkpoint or the new
one. With a carry spread over several processes every process takes part in
gathering it and process 0 writes.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import jax
import numpy as np
from flax import serialization
from jax.experimental import multihost_utils


def check_directory(name: str, directory: Any) -> str | None:
  """``directory`` as a path, created if missing and checked writable, before any compute; ``None`` stays."""
  if directory is None:
    return None
  if not isinstance(directory, (str, os.PathLike)):
    raise TypeError(f"{name} must be a path (str or os.PathLike) or None, got {type(directory).__name__}.")
  path = os.fspath(directory)
  try:
    os.makedirs(path, exist_ok=True)
    # Writing is what a checkpoint needs: try it now rather than after the first chunk's compute.
    with tempfile.TemporaryFile(dir=path):
      pass
  except OSError as e:
    raise ValueError(f"{name}={path!r} cannot be written: {e.strerror or e}.") from e
  return path


def gathered(x: Any) -> np.ndarray:
  """The whole value of a (possibly multi-process, sharded) array as NumPy."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    if x.sharding.is_fully_replicated:
      return np.asarray(x.addressable_data(0))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(jax.device_get(x))


def save(path: str, fingerprint: str, carry: tuple[Any, ...], records: dict[str, Any], chunks_done: int) -> None:
  """Writes the checkpoint at ``path`` (a collective when the carry spans processes)."""
  record = {
      "fingerprint": fingerprint,
      "chunks_done": chunks_done,
      "carry": [serialization.to_state_dict(jax.tree.map(gathered, x)) for x in carry],
      "records": {name: {str(i): np.asarray(leaf) for i, leaf in enumerate(jax.tree.leaves(rows))}
                  for name, rows in records.items()},
  }
  if jax.process_index() != 0:
    return
  os.makedirs(os.path.dirname(path), exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "wb") as f:
    f.write(serialization.msgpack_serialize(record))
  # A crash mid-write must never leave a truncated checkpoint behind.
  os.replace(tmp, path)


def restore(path: str, fingerprint: str, carry: tuple[Any, ...],
            records_like: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any], int]:
  """The carry (shaped like ``carry``), the records (shaped like ``records_like``) and the chunks done
  saved at ``path``; a clear error if it belongs to a run of another fingerprint."""
  with open(path, "rb") as f:
    record = serialization.msgpack_restore(f.read())
  if record["fingerprint"] != fingerprint:
    raise ValueError(
        f"checkpoint_dir holds a checkpoint ({path}) of a different run (schedule, seed or "
        f"settings differ); use another directory or resume=False.")
  carry = tuple(serialization.from_state_dict(x, record["carry"][i]) for i, x in enumerate(carry))
  records = {}
  for name, like in records_like.items():
    treedef = jax.tree.structure(like)
    saved = record.get("records", {}).get(name)
    if saved is None:
      raise ValueError(
          f"checkpoint_dir holds a checkpoint ({path}) in an older format, without the record {name!r}; "
          f"use another directory or resume=False.")
    records[name] = jax.tree.unflatten(treedef, [saved[str(i)] for i in range(treedef.num_leaves)])
  return carry, records, int(record["chunks_done"])
