"""Checkpoints of a runtime's state, with the run's identity and a checksum, and an append-only history.

Two files per run in the checkpoint directory:

``<name>``
  the state after the last chunk done: a header (a magic line and the
  SHA-256 of the rest), then a msgpack record of the format version, the
  run's *fingerprint* (named components, each a digest of one thing that
  makes the run: the schedule, the options, the parameters' and the
  optimizer state's structure, shapes and dtypes, the initial parameters, the
  optimizer's and the loss's traced programs, the data), the carry, the
  chunks done and how many bytes of the history file belong to it. It is
  written whole, atomically (a temporary file, then a rename), so a process
  killed at any moment leaves the previous checkpoint or the new one.
``<name>.records``
  the history (the engine's records), one frame per chunk (length, SHA-256,
  msgpack), *appended* after every chunk: a save costs the chunk's rows, not
  the whole run's. Bytes past the length the checkpoint names (a chunk
  appended just before a crash) are ignored on resume and overwritten.

Resuming from a checkpoint whose fingerprint differs is a ``ValueError``
that names each differing component; a damaged or truncated file is a
``ValueError`` naming the file. With a carry spread over several processes
every process takes part in gathering it and process 0 writes.

Orbax (``orbax-checkpoint``) is not used yet: this single-file format is
atomic with one rename and keeps resume bit-identical; per-process shard
writes for a carry spanning processes (what Orbax would add) are left to do.
"""

from __future__ import annotations

import hashlib
import os
import struct
import tempfile
from typing import Any

import jax
import numpy as np
from flax import serialization
from jax.experimental import multihost_utils

_MAGIC = b"delayjax checkpoint 2\n"
_FORMAT = 2
_FRAME = struct.Struct("<Q32s")  # length of the payload, its SHA-256


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


def digest(*parts: Any) -> str:
  """A SHA-256 hex digest of ``parts``: arrays by dtype, shape and bytes, anything else by ``repr``."""
  h = hashlib.sha256()
  for part in parts:
    if isinstance(part, (np.ndarray, jax.Array)):
      a = np.ascontiguousarray(np.asarray(part))
      h.update(f"{a.dtype.str}{a.shape}".encode())
      h.update(a.tobytes())
    else:
      h.update(repr(part).encode())
    h.update(b"|")
  return h.hexdigest()


def tree_digest(tree: Any, *, values: bool) -> str:
  """A digest of ``tree``'s structure, shapes and dtypes (and with ``values`` its leaves' bytes)."""
  leaves, treedef = jax.tree.flatten(tree)
  shapes = [(np.shape(x), str(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype)) for x in leaves]
  return digest(str(treedef), shapes, *([np.asarray(x) for x in leaves] if values else []))


def _frame(payload: bytes) -> bytes:
  return _FRAME.pack(len(payload), hashlib.sha256(payload).digest()) + payload


def _rows_payload(rows: dict[str, Any]) -> bytes:
  return serialization.msgpack_serialize(
      {name: {str(i): np.asarray(leaf) for i, leaf in enumerate(jax.tree.leaves(value))}
       for name, value in rows.items()})


def _damaged(path: str, why: str) -> ValueError:
  return ValueError(
      f"checkpoint file {path} is damaged or truncated ({why}); delete it, use another checkpoint_dir or "
      f"resume=False.")


class Checkpoint:
  """The checkpoint files of one run: ``save`` after every chunk, ``restore`` on resume.

  Args:
    directory: the checkpoint directory.
    name: the state file's name (the history is ``name + ".records"``).
    fingerprint: ``{component: digest}``, or one string, the run's identity.
  """

  def __init__(self, directory: str | os.PathLike[str], name: str, fingerprint: str | dict[str, str]):
    self.path = os.path.join(os.fspath(directory), name)
    self.records_path = self.path + ".records"
    self.fingerprint = dict(fingerprint) if isinstance(fingerprint, dict) else {"run": fingerprint}
    self._records_bytes = 0  # bytes of the history file that the last checkpoint owns

  def exists(self) -> bool:
    return os.path.exists(self.path)

  def save(self, carry: tuple[Any, ...], new_rows: list[dict[str, Any]], chunks_done: int) -> None:
    """Appends ``new_rows`` (one dict of records per chunk not yet saved) to the history, then writes the state.

    A collective when the carry spans processes: every process calls it.
    """
    state = [serialization.to_state_dict(jax.tree.map(gathered, x)) for x in carry]
    if jax.process_index() != 0:
      return
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    frames = b"".join(_frame(_rows_payload(rows)) for rows in new_rows)
    with open(self.records_path, "r+b" if os.path.exists(self.records_path) else "wb") as f:
      # Whatever a crash left past the last checkpoint's history is not part of this run's.
      f.truncate(self._records_bytes)
      f.seek(self._records_bytes)
      f.write(frames)
      f.flush()
      os.fsync(f.fileno())
    self._records_bytes += len(frames)
    payload = serialization.msgpack_serialize({
        "format": _FORMAT, "fingerprint": self.fingerprint, "chunks_done": chunks_done, "carry": state,
        "records_bytes": self._records_bytes})
    tmp = self.path + ".tmp"
    with open(tmp, "wb") as f:
      f.write(_MAGIC + hashlib.sha256(payload).digest() + payload)
      f.flush()
      os.fsync(f.fileno())
    # A crash mid-write must never leave a truncated checkpoint behind.
    os.replace(tmp, self.path)

  def restore(self, carry: tuple[Any, ...],
              records_like: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any], int]:
    """The carry (shaped like ``carry``), the records (shaped like ``records_like``) and the chunks done.

    Raises:
      ValueError: if the checkpoint belongs to another run (naming what differs), or a file is damaged
        or truncated (naming the file).
    """
    record = self._read_state()
    saved = record.get("fingerprint")
    if not isinstance(saved, dict):
      raise ValueError(
          f"checkpoint_dir holds a checkpoint ({self.path}) without a fingerprint (an older format); use "
          f"another directory or resume=False.")
    differ = sorted(k for k in set(saved) | set(self.fingerprint) if saved.get(k) != self.fingerprint.get(k))
    if differ:
      raise ValueError(
          f"checkpoint_dir holds a checkpoint ({self.path}) of a different run: {', '.join(differ)} "
          f"differ; use another directory, or resume=False to start over.")
    restored = tuple(serialization.from_state_dict(x, record["carry"][i]) for i, x in enumerate(carry))
    for i, (new, old) in enumerate(zip(restored, carry)):
      for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(old), strict=True):
        if np.shape(a) != np.shape(b) or np.asarray(a).dtype != np.asarray(b).dtype:
          raise _damaged(self.path, f"carry element {i} holds {np.asarray(a).dtype}{np.shape(a)} where "
                                    f"{np.asarray(b).dtype}{np.shape(b)} is expected")
    self._records_bytes = int(record["records_bytes"])
    return restored, self._read_records(records_like), int(record["chunks_done"])

  def _read_state(self) -> dict[str, Any]:
    with open(self.path, "rb") as f:
      data = f.read()
    head = len(_MAGIC) + 32
    if len(data) < head or not data.startswith(_MAGIC):
      raise _damaged(self.path, "no delayjax checkpoint header")
    payload = data[head:]
    if hashlib.sha256(payload).digest() != data[len(_MAGIC):head]:
      raise _damaged(self.path, "its content does not match its checksum")
    try:
      record = serialization.msgpack_restore(payload)
    except Exception as e:  # noqa: BLE001 - any decoding failure means the same: the file is damaged
      raise _damaged(self.path, f"cannot be decoded: {e}") from e
    if record.get("format") != _FORMAT:
      raise _damaged(self.path, f"format {record.get('format')!r}, expected {_FORMAT}")
    return record

  def _read_records(self, records_like: dict[str, Any]) -> dict[str, Any]:
    try:
      with open(self.records_path, "rb") as f:
        data = f.read(self._records_bytes)
    except FileNotFoundError:
      data = b""
    if len(data) < self._records_bytes:
      raise _damaged(self.records_path, f"{len(data)} bytes where the checkpoint needs {self._records_bytes}")
    rows: dict[str, list[Any]] = {name: [] for name in records_like}
    at = 0
    while at < len(data):
      if at + _FRAME.size > len(data):
        raise _damaged(self.records_path, f"a frame header cut at byte {at}")
      length, checksum = _FRAME.unpack_from(data, at)
      payload = data[at + _FRAME.size:at + _FRAME.size + length]
      if len(payload) != length or hashlib.sha256(payload).digest() != checksum:
        raise _damaged(self.records_path, f"the frame at byte {at} does not match its checksum")
      frame = serialization.msgpack_restore(payload)
      for name, like in records_like.items():
        if name in frame:
          treedef = jax.tree.structure(like)
          rows[name].append(jax.tree.unflatten(treedef, [frame[name][str(i)] for i in range(treedef.num_leaves)]))
      at += _FRAME.size + length
    return {name: (jax.tree.map(lambda *xs: np.concatenate(xs), *parts) if parts else records_like[name])
            for name, parts in rows.items()}
