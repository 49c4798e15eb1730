"""Checkpoints of a runtime's state on Orbax, with the run's identity and a checksum, and an append-only history.

Two entries per run in the checkpoint directory:

``<name>/``
  an Orbax (``orbax-checkpoint``) checkpoint directory holding one step, the
  state after the last chunk done (a new step is written to a temporary
  folder and committed by a rename, then the previous one is deleted, so a
  process killed at any moment leaves the previous checkpoint or the new
  one). Each step has two items: ``state``, the carry's arrays (with a
  ``mesh`` spanning processes every process writes its own shards; nothing is
  gathered onto one host), and ``meta``, a JSON record of the format version,
  the run's *fingerprint* (named components, each a digest of one thing that
  makes the run: the schedule, the options, the parameters' and the
  optimizer state's structure, shapes and dtypes, the initial parameters, the
  optimizer's and the loss's traced programs, the data), the carry's
  structure, the chunks done, how many bytes of the history file belong to
  it, the names of the records its history keeps, and a *checksum* per
  process: the SHA-256 of the shards that process holds, checked against the
  restored shards on resume.
``<name>.records``
  the history (the engine's records), one frame per chunk (length, SHA-256,
  msgpack), *appended* after every chunk: a save costs the chunk's rows, not
  the whole run's. Bytes past the length the checkpoint names (a chunk
  appended just before a crash) are ignored on resume and overwritten.

Resuming from a checkpoint whose fingerprint differs is a ``ValueError``
that names each differing component, unless the caller names those
components as knowingly changed (``resume_changes``); one whose history lacks
a record the run keeps (it was written by a run that kept less, e.g.
``history="evaluations"``) is a ``ValueError`` too, whatever the changes
allowed (the rows were never written); a damaged or truncated
checkpoint is a ``ValueError`` naming the file or folder. A checkpoint in the
earlier single-file format (``<name>.msgpack``) is a ``ValueError`` saying
the format changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from typing import Any

import jax
import numpy as np
from flax import serialization
from jax.experimental import multihost_utils

_FORMAT = 3
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
      f"checkpoint {path} is damaged or truncated ({why}); delete it, use another checkpoint_dir or "
      f"resume=False.")


def check_changes(changes: Any, checkpoint_dir: Any) -> tuple[str, ...]:
  """``resume_changes`` as a tuple of component names: a sequence of strings, used only with a checkpoint."""
  if isinstance(changes, str) or not isinstance(changes, (tuple, list)) or not all(
      isinstance(c, str) for c in changes):
    raise TypeError(f"resume_changes must be a tuple of component names (str), got {changes!r}.")
  if changes and checkpoint_dir is None:
    raise ValueError(f"resume_changes={tuple(changes)!r} is only used with checkpoint_dir.")
  return tuple(changes)


def _structure(carry: Any) -> str:
  """A digest of the carry's structure, shapes and dtypes as placed (the same for host and device values)."""
  leaves, treedef = jax.tree.flatten(carry)
  return digest(str(treedef), [(np.shape(x), str(_dtype(x))) for x in leaves])


def _index_key(index: tuple[slice, ...]) -> tuple[tuple[Any, Any], ...]:
  return tuple((s.start, s.stop) for s in index)


def _shard_checksum(leaves: list[jax.Array]) -> tuple[str, str]:
  """The SHA-256 of the shards of ``leaves`` this process holds (each distinct shard once), and of their layout.

  Only this process's own bytes are read: nothing is gathered.
  """
  content, layout = hashlib.sha256(), hashlib.sha256()
  for i, leaf in enumerate(leaves):
    shards = {}
    for shard in leaf.addressable_shards:
      shards.setdefault(_index_key(shard.index), shard)
    for key in sorted(shards, key=repr):
      tag = f"{i}:{key}|".encode()
      layout.update(tag)
      content.update(tag)
      content.update(np.ascontiguousarray(np.asarray(shards[key].data)).tobytes())
  return content.hexdigest(), layout.hexdigest()


class Checkpoint:
  """The checkpoint of one run: ``save`` after every chunk, ``restore`` on resume.

  Args:
    directory: the checkpoint directory.
    name: the Orbax checkpoint folder's name (the history is ``name + ".records"``).
    fingerprint: ``{component: digest}``, or one string, the run's identity.
    changes: components allowed to differ on resume (a knowingly changed run); the checkpoint written
      next records the new fingerprint.
    records: the names of the records this run keeps in its history; a checkpoint whose history lacks one
      cannot be resumed. Records it holds beyond them are left unread.
  """

  def __init__(self, directory: str | os.PathLike[str], name: str, fingerprint: str | dict[str, str],
               changes: tuple[str, ...] = (), records: tuple[str, ...] = ()):
    # Orbax takes absolute paths only; a relative directory is taken against the working directory of now.
    self.path = os.path.join(os.path.abspath(os.fspath(directory)), name)
    self.records_path = self.path + ".records"
    self.legacy_path = self.path + ".msgpack"
    self.fingerprint = dict(fingerprint) if isinstance(fingerprint, dict) else {"run": fingerprint}
    unknown = [c for c in changes if c not in self.fingerprint]
    if unknown:
      raise ValueError(
          f"resume_changes names {', '.join(map(repr, unknown))}, not a component of this run's identity; "
          f"the components are: {', '.join(map(repr, self.fingerprint))}.")
    self.changes = changes
    self.records = tuple(sorted(records))
    self._records_bytes = 0  # bytes of the history file that the last checkpoint owns
    self._fresh = True  # nothing saved or restored yet: the first save replaces what an earlier run left
    self._manager_: Any = None

  def _manager(self) -> Any:
    # Imported here: Orbax takes a while to import and only a run with a checkpoint needs it.
    import orbax.checkpoint as ocp

    if self._manager_ is None:
      self._manager_ = ocp.CheckpointManager(self.path, options=ocp.CheckpointManagerOptions(
          # One step kept: the previous one is deleted only after the new one is committed.
          max_to_keep=1, create=True, cleanup_tmp_directories=True,
          # Saved before the next chunk runs: that chunk donates (overwrites) the carry's buffers.
          enable_async_checkpointing=False))
    return self._manager_

  def exists(self) -> bool:
    return (os.path.isdir(self.path) and self._manager().latest_step() is not None) or os.path.exists(
        self.legacy_path)

  def save(self, carry: tuple[Any, ...], new_rows: list[dict[str, Any]], chunks_done: int) -> None:
    """Appends ``new_rows`` (one dict of records per chunk not yet saved) to the history, then writes the state.

    A collective when the carry spans processes: every process calls it and writes its own shards.
    """
    import orbax.checkpoint as ocp

    manager = self._manager()
    if self._fresh:
      # A run that did not resume starts over: an earlier run's steps would be taken for newer than its own.
      for step in manager.all_steps():
        manager.delete(step)
      self._fresh = False
    leaves = jax.tree.leaves(carry)
    checksum = _shard_checksum(leaves)
    if jax.process_count() > 1:
      encoded = np.frombuffer(bytes.fromhex(checksum[0] + checksum[1]), np.uint8)
      every = np.asarray(multihost_utils.process_allgather(encoded)).reshape(jax.process_count(), 64)
      checksums = [[row[:32].tobytes().hex(), row[32:].tobytes().hex()] for row in every]
    else:
      checksums = [list(checksum)]
    frames = b"".join(_frame(_rows_payload(rows)) for rows in new_rows)
    if jax.process_index() == 0:
      with open(self.records_path, "r+b" if os.path.exists(self.records_path) else "wb") as f:
        # Whatever a crash left past the last checkpoint's history is not part of this run's.
        f.truncate(self._records_bytes)
        f.seek(self._records_bytes)
        f.write(frames)
        f.flush()
        os.fsync(f.fileno())
    self._records_bytes += len(frames)
    meta = {"format": _FORMAT, "fingerprint": self.fingerprint, "carry": _structure(carry),
            "chunks_done": chunks_done, "records_bytes": self._records_bytes, "records": list(self.records),
            "checksums": checksums}
    meta["sha256"] = _json_digest(meta)
    # Orbax cannot store an empty array; its shape and dtype are in the carry's structure already.
    state = {str(i): x for i, x in enumerate(leaves) if x.size}
    manager.save(chunks_done, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                      meta=ocp.args.JsonSave(meta)))

  def restore(self, carry: tuple[Any, ...], shardings: Any,
              records_like: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any], int]:
    """The carry (on the devices, laid out by ``shardings``), the records and the chunks done.

    Args:
      carry: the initial carry (host values): the structure, shapes and dtypes to restore.
      shardings: one ``jax.sharding.Sharding`` per leaf of ``carry`` (the same structure).
      records_like: the records' structure (see :meth:`_read_records`).

    Raises:
      ValueError: if the checkpoint belongs to another run (naming what differs), or a file is damaged
        or truncated (naming it), or it is in the earlier single-file format.
    """
    import orbax.checkpoint as ocp

    manager = self._manager()
    step = manager.latest_step() if os.path.isdir(self.path) else None
    if step is None:
      raise ValueError(
          f"checkpoint_dir holds a checkpoint in an earlier format ({self.legacy_path}), which this version no "
          f"longer reads (checkpoints are Orbax folders now); use another checkpoint_dir or resume=False.")
    folder = os.path.join(self.path, str(step))
    try:
      meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception as e:  # noqa: BLE001 - any failure to read it means the same: the file is damaged
      raise _damaged(os.path.join(folder, "meta"), f"cannot be read: {e}") from e
    if not isinstance(meta, dict) or meta.get("sha256") != _json_digest(
        {k: v for k, v in meta.items() if k != "sha256"}):
      raise _damaged(os.path.join(folder, "meta"), "its content does not match its checksum")
    if meta.get("format") != _FORMAT:
      raise _damaged(os.path.join(folder, "meta"), f"format {meta.get('format')!r}, expected {_FORMAT}")
    saved = meta["fingerprint"]
    differ = sorted(k for k in set(saved) | set(self.fingerprint) if saved.get(k) != self.fingerprint.get(k))
    refused = [k for k in differ if k not in self.changes]
    if refused:
      raise ValueError(
          f"checkpoint_dir holds a checkpoint ({self.path}) of a different run: {', '.join(refused)} "
          f"differ; use another directory, resume=False to start over, or resume_changes="
          f"{tuple(refused)!r} to continue from it knowingly with these changes.")
    # A checkpoint of an earlier version names no records: its runs kept every record they had.
    missing = [name for name in self.records if "records" in meta and name not in meta["records"]]
    if missing:
      raise ValueError(
          f"checkpoint_dir holds a checkpoint ({self.path}) whose history does not keep {missing}, which this "
          f"run's does: it was written by a run that recorded less (history='evaluations' keeps no "
          f"per-update rows), and rows never written cannot be restored, whatever resume_changes allows; resume "
          f"with the setting it was written with, or start over with resume=False or another directory.")
    if meta.get("carry") != _structure(carry):
      raise ValueError(
          f"checkpoint_dir holds a checkpoint ({self.path}) whose state has another structure, shapes or dtypes "
          f"than this run's; it cannot be resumed, even with resume_changes.")
    leaves, treedef = jax.tree.flatten(carry)
    targets = jax.tree.leaves(shardings)
    abstract = {str(i): jax.ShapeDtypeStruct(np.shape(x), _dtype(x), sharding=s)
                for i, (x, s) in enumerate(zip(leaves, targets, strict=True)) if np.size(x)}
    try:
      state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
    except Exception as e:  # noqa: BLE001 - as above
      raise _damaged(os.path.join(folder, "state"), f"cannot be read: {e}") from e
    restored = [state[str(i)] if np.size(x) else jax.device_put(np.zeros(np.shape(x), _dtype(x)), s)
                for i, (x, s) in enumerate(zip(leaves, targets))]
    checksums = meta.get("checksums")
    content, layout = _shard_checksum(restored)
    if not isinstance(checksums, list) or len(checksums) <= jax.process_index():
      raise _damaged(os.path.join(folder, "meta"), "no checksum for this process")
    saved_content, saved_layout = checksums[jax.process_index()]
    # A resume laid out otherwise (other devices or processes) reads other shards: nothing to compare.
    if layout == saved_layout and content != saved_content:
      raise _damaged(os.path.join(folder, "state"), "its content does not match its checksum")
    self._records_bytes = int(meta["records_bytes"])
    self._fresh = False
    return (tuple(jax.tree.unflatten(treedef, restored)), self._read_records(records_like),
            int(meta["chunks_done"]))
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


def _json_digest(record: dict[str, Any]) -> str:
  return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def _dtype(x: Any) -> np.dtype:
  """The dtype ``x`` has once placed on a device (64-bit types narrowed unless x64 is enabled)."""
  return np.dtype(jax.dtypes.canonicalize_dtype(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype))
