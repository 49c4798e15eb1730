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
checkpoint is a ``ValueError`` naming the file or folder; one written in
another format version (the earlier single-file ``<name>.msgpack``, or a
``meta`` of another ``format``) is a ``ValueError`` naming the version it is
and the one this version reads. Each of these is a :class:`CheckpointError`.
A save that fails in the file system (a full disk) is a
:class:`CheckpointWriteError` (an ``OSError``) naming the checkpoint directory and
saying whether the previous checkpoint is intact (it is, once one was
written: a save replaces it only once the new one is committed).

Orbax reads and writes in background threads that the caller waits for. A
Ctrl-C during a save or restore takes effect once it is done (see
:func:`_uninterrupted`): raised in the middle, it left those threads running
into the interpreter's shutdown, which crashed it. What Orbax logs and prints
about a failure it raises is not repeated to the user: the error raised here
says it once.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import struct
import sys
import tempfile
import threading
from typing import Any, Iterator

import jax
import numpy as np
from flax import serialization
from jax.experimental import multihost_utils

_FORMAT = 3
_FRAME = struct.Struct("<Q32s")  # length of the payload, its SHA-256
_LEGACY_MAGIC = re.compile(rb"delayjax checkpoint (\d+)\n")  # the first line of a single-file checkpoint


class CheckpointError(ValueError):
  """A checkpoint that cannot be resumed: damaged or truncated, of another format version, or of another run.

  The message names the file or folder, what is wrong, and what to do.
  """


class CheckpointWriteError(OSError):
  """A checkpoint the file system would not take (a full disk, a read-only or lost mount).

  ``errno`` is the file system's; the message names the checkpoint directory and says whether the previous
  checkpoint is intact.
  """

  def __str__(self) -> str:
    return str(self.strerror)  # the message alone, without OSError's "[Errno N]" prefix


@contextlib.contextmanager
def _uninterrupted() -> Iterator[None]:
  """Ctrl-C (SIGINT) inside the block takes effect when the block ends, as it would have at that moment.

  Orbax writes and reads in background threads that the calling thread waits for. A KeyboardInterrupt
  raised in that wait abandons them: they keep writing while the interpreter shuts down, and the shutdown
  crashes (a segmentation fault or abort as a thread calls into JAX) or prints their asyncio tracebacks
  ("Event loop is closed", "cannot schedule new futures after interpreter shutdown"). Waiting for them
  instead costs the length of one save, and leaves the checkpoint written whole. A second Ctrl-C within
  the block takes effect at once (a write that hangs, on a lost network mount, can still be stopped).
  Python runs signal handlers in the main thread only, so in any other thread this does nothing; an
  ignored SIGINT stays ignored.
  """
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  previous = signal.getsignal(signal.SIGINT)
  if previous is None or previous is signal.SIG_IGN:
    yield
    return
  received: list[Any] = []

  def deliver(frame: Any) -> None:
    signal.signal(signal.SIGINT, previous)
    if callable(previous):
      previous(signal.SIGINT, frame)
    else:
      signal.raise_signal(signal.SIGINT)  # SIG_DFL: what the signal does by default

  def defer(signum: int, frame: Any) -> None:
    received.append(frame)
    if len(received) > 1:
      deliver(frame)

  signal.signal(signal.SIGINT, defer)
  try:
    yield
  finally:
    if len(received) == 1:
      deliver(received[0])
    elif not received:
      signal.signal(signal.SIGINT, previous)


class _OrbaxFailureLogs(logging.Filter):
  """Drops Orbax's own error logs (each with a traceback) of a failure that :class:`Checkpoint` raises."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not (record.levelno >= logging.ERROR and f"{os.sep}orbax{os.sep}" in record.pathname)


class _UnretrievedTensorstoreErrors(logging.Filter):
  """Drops asyncio's "exception was never retrieved" report of a tensorstore read or write that failed.

  When several of a restore's reads fail (a damaged b-tree node that every array's read goes through),
  Orbax's gather raises the first failure and the other tasks' exceptions are never retrieved; asyncio
  logs each, with its traceback and tensorstore's spec, when the task is collected, which can be after
  the call returned. :class:`Checkpoint` has already named the damaged file by then.
  """

  drops_unretrieved_tensorstore_errors = True

  def filter(self, record: logging.LogRecord) -> bool:
    error = record.exc_info[1] if record.exc_info else None
    first_line = str(record.msg).partition("\n")[0]
    return not (first_line.endswith("exception was never retrieved") and error is not None
                and "tensorstore_spec" in str(error))


@contextlib.contextmanager
def _quiet_orbax() -> Iterator[None]:
  """Orbax's failure logs silenced during the block, and a closed event loop's late callbacks once one failed.

  When one of Orbax's reads or writes fails, Orbax logs it (with a traceback) from its background thread
  and raises it to the caller, which :class:`Checkpoint` turns into an error naming the file; the log
  would only say the same thing again, less clearly. The tensorstore operations still in flight finish
  after Orbax has closed their event loop, during the call or after it returned, and each one's callback
  raises "Event loop is closed", which Python prints as a traceback through ``sys.unraisablehook``; and
  the failures of reads beside the one raised are logged by asyncio as never retrieved when their tasks
  are collected. Both are dropped during the block, and for the rest of the process once a call failed
  (see :func:`_closed_loop_hook` and :class:`_UnretrievedTensorstoreErrors`).
  """
  logger = logging.getLogger("absl")
  quiet = _OrbaxFailureLogs()
  logger.addFilter(quiet)
  previous = sys.unraisablehook
  installed = not getattr(previous, "drops_closed_loop_callbacks", False)
  if installed:
    sys.unraisablehook = _closed_loop_hook(previous)
  asyncio_logger = logging.getLogger("asyncio")
  unretrieved = None
  if not any(getattr(f, "drops_unretrieved_tensorstore_errors", False) for f in asyncio_logger.filters):
    unretrieved = _UnretrievedTensorstoreErrors()
    asyncio_logger.addFilter(unretrieved)
  failed = True
  try:
    yield
    failed = False
  finally:
    logger.removeFilter(quiet)
    if not failed:
      if installed and getattr(sys.unraisablehook, "drops_closed_loop_callbacks", False):
        sys.unraisablehook = previous
      if unretrieved is not None:
        asyncio_logger.removeFilter(unretrieved)


def _closed_loop_hook(previous: Any) -> Any:
  """An ``unraisablehook`` that drops the RuntimeError("Event loop is closed") of a late callback.

  Only an exception raised by asyncio's ``call_soon_threadsafe`` on a closed loop, reported without an
  object (as tensorstore's future callbacks report it), is dropped; everything else goes to ``previous``.
  """

  def hook(unraisable: Any) -> None:
    if unraisable.object is None and _closed_loop(unraisable.exc_value, unraisable.exc_traceback):
      return
    previous(unraisable)

  hook.drops_closed_loop_callbacks = True  # type: ignore[attr-defined]
  return hook


def _closed_loop(error: BaseException | None, traceback: Any) -> bool:
  if not (isinstance(error, RuntimeError) and str(error) == "Event loop is closed") or traceback is None:
    return False
  while traceback.tb_next is not None:
    traceback = traceback.tb_next
  return traceback.tb_frame.f_code.co_name == "_check_closed"


def _short(error: BaseException) -> str:
  """An Orbax / tensorstore error's message on one line, without the tensorstore specs it appends.

  The specs are kilobytes of JSON, quoted (``[tensorstore_spec='{...}']``), or with their quotes escaped
  where the message holds another error's repr; a message of several lines (errors gathered from several
  reads) is joined into one.
  """
  text = re.sub(r"\s*\[tensorstore_spec(?:\[\d+\])?=(\\*)'.*?\1'\]", "", str(error), flags=re.DOTALL)
  return " ".join(text.split())


def _file_system_error(error: BaseException) -> tuple[int, str, str] | None:
  """``(errno, strerror, detail)`` of the file-system failure behind ``error``, if one is (``None`` otherwise).

  An ``OSError`` anywhere in its chain (Python's own writes), or tensorstore's ``os_error_code`` in a
  message (Orbax's array writes raise a ValueError ``RESOURCE_EXHAUSTED: ... [os_error_code='28']``).
  """
  seen, current = set(), error
  while current is not None and id(current) not in seen:
    seen.add(id(current))
    if isinstance(current, OSError) and current.errno is not None:
      detail = f"{current.strerror or os.strerror(current.errno)}"
      return current.errno, detail, f"{detail}: {current.filename}" if current.filename else detail
    code = re.search(r"os_error_code='(\d+)'", str(current))
    if code:
      number = int(code.group(1))
      return number, os.strerror(number), _short(current)
    current = current.__cause__ or current.__context__
  return None


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


def _damaged(path: str, why: str) -> CheckpointError:
  return CheckpointError(
      f"checkpoint {path} is damaged or truncated ({why}); delete it, use another dj.Checkpoint directory or "
      f"dj.Checkpoint(..., resume=False).")


def _other_format(path: str, version: Any, how: str) -> CheckpointError:
  return CheckpointError(
      f"checkpoint {path} is in checkpoint format {version!r} ({how}); this version of delayjax reads format "
      f"{_FORMAT} (Orbax folders) only: resume it with the delayjax version that wrote it, or start over with "
      f"dj.Checkpoint(..., resume=False) or another directory.")


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
    self.directory = os.path.abspath(os.fspath(directory))
    self.path = os.path.join(self.directory, name)
    self.records_path = self.path + ".records"
    self.legacy_path = self.path + ".msgpack"
    self.fingerprint = dict(fingerprint) if isinstance(fingerprint, dict) else {"run": fingerprint}
    unknown = [c for c in changes if c not in self.fingerprint]
    if unknown:
      raise ValueError(
          f"Checkpoint.changes names {', '.join(map(repr, unknown))}, not a component of this run's identity; "
          f"the components are: {', '.join(map(repr, self.fingerprint))}.")
    if "schedule" in changes:
      # The checkpoint's carry holds gradients and reads in flight, laid out by its schedule's plan: a run
      # of another schedule (even one that extends it) would continue its own plan from someone else's
      # state, and end at other parameters than either run, its history rows misaligned.
      raise ValueError(
          "Checkpoint.changes cannot include 'schedule': the checkpoint's gradients and reads in flight belong "
          "to its schedule's plan, so a run of another schedule cannot continue from it exactly. Resume with "
          "the same schedule, or run the new one from the start (resume=False).")
    self.changes = changes
    self.records = tuple(sorted(records))
    self._records_bytes = 0  # bytes of the history file that the last checkpoint owns
    self._fresh = True  # nothing saved or restored yet: the first save replaces what an earlier run left
    self._chunks_saved = 0  # the chunks done of the checkpoint on disk that is this run's (0: none yet)
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
    with _uninterrupted(), _quiet_orbax():
      return (os.path.isdir(self.path) and self._manager().latest_step() is not None) or os.path.exists(
          self.legacy_path)

  def save(self, carry: tuple[Any, ...], new_rows: list[dict[str, Any]], chunks_done: int) -> None:
    """Appends ``new_rows`` (one dict of records per chunk not yet saved) to the history, then writes the state.

    A collective when the carry spans processes: every process calls it and writes its own shards.

    Raises:
      CheckpointWriteError: if the file system refuses the write (e.g. the disk is full); the previous
        checkpoint, if this run wrote or resumed one, is left intact, and what the failed save had written
        is removed.
    """
    with _uninterrupted():
      records_bytes = self._records_bytes
      try:
        with _quiet_orbax():
          self._save(carry, new_rows, chunks_done)
      except Exception as e:
        self._records_bytes = records_bytes
        failure = _file_system_error(e)
        if failure is None:
          raise
        self._remove_partial(chunks_done, records_bytes)
        number, reason, detail = failure
        rerun = "free some space, then rerun" if number in (errno.ENOSPC, errno.EDQUOT) else "rerun"
        if self._chunks_saved:
          kept = (f"the previous checkpoint (after chunk {self._chunks_saved}) is intact: {rerun} to resume from "
                  f"it")
        else:
          kept = f"no checkpoint of this run had been written yet: {rerun} to start it over"
        raise CheckpointWriteError(
            number, f"checkpoint directory {self.directory}: the checkpoint after chunk {chunks_done} could not be "
            f"written ({reason}); {kept}. The file system said: {detail}") from None
      self._chunks_saved = chunks_done

  def _remove_partial(self, chunks_done: int, records_bytes: int) -> None:
    """Removes what a failed save wrote: Orbax's temporary step folder and history bytes past the checkpoint's.

    Neither would be read on resume (Orbax skips temporary folders, the history is read up to the length
    the checkpoint names); removing them gives the space back now. Best effort: a failure here changes
    nothing a resume reads.
    """
    for folder in glob.glob(os.path.join(glob.escape(self.path), f"{chunks_done}.orbax-checkpoint-tmp*")):
      shutil.rmtree(folder, ignore_errors=True)
    if jax.process_index() == 0 and os.path.exists(self.records_path):
      with contextlib.suppress(OSError):
        os.truncate(self.records_path, records_bytes)

  def _save(self, carry: tuple[Any, ...], new_rows: list[dict[str, Any]], chunks_done: int) -> None:
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
      CheckpointError: (a ``ValueError``) if the checkpoint belongs to another run (naming what differs),
        or a file is damaged or truncated (naming it), or it is in another format version (naming both).
    """
    with _uninterrupted(), _quiet_orbax():
      return self._restore(carry, shardings, records_like)

  def _restore(self, carry: tuple[Any, ...], shardings: Any,
               records_like: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any], int]:
    import orbax.checkpoint as ocp

    manager = self._manager()
    step = manager.latest_step() if os.path.isdir(self.path) else None
    if step is None:
      raise CheckpointError(
          f"the checkpoint directory holds a checkpoint in an earlier format ({self.legacy_path}: checkpoint format "
          f"{self._legacy_version()!r}, a single msgpack file), which this version no longer reads: it reads format "
          f"{_FORMAT} (Orbax folders) only; resume it with the delayjax version that wrote it, or use another "
          f"directory or dj.Checkpoint(..., resume=False).")
    folder = os.path.join(self.path, str(step))
    try:
      meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception as e:  # noqa: BLE001 - any failure to read it means the same: the file is damaged
      raise _damaged(os.path.join(folder, "meta"), f"cannot be read: {_short(e)}") from None
    if not isinstance(meta, dict):
      raise _damaged(os.path.join(folder, "meta"), f"it holds a {type(meta).__name__}, not a record")
    intact = meta.get("sha256") == _json_digest({k: v for k, v in meta.items() if k != "sha256"})
    if meta.get("format") != _FORMAT:
      if intact:
        raise _other_format(os.path.join(folder, "meta"), meta.get("format"), "written by another version of "
                            "delayjax")
      raise _damaged(os.path.join(folder, "meta"), f"its content does not match its checksum, and it names "
                     f"format {meta.get('format')!r} where this version reads {_FORMAT}")
    if not intact:
      raise _damaged(os.path.join(folder, "meta"), "its content does not match its checksum")
    saved = meta["fingerprint"]
    differ = sorted(k for k in set(saved) | set(self.fingerprint) if saved.get(k) != self.fingerprint.get(k))
    refused = [k for k in differ if k not in self.changes]
    if refused:
      raise CheckpointError(
          f"the checkpoint directory holds a checkpoint ({self.path}) of a different run: {', '.join(refused)} "
          f"differ; use another directory, dj.Checkpoint(..., resume=False) to start over, or "
          f"dj.Checkpoint(..., changes={tuple(refused)!r}) to continue from it knowingly with these changes.")
    # A checkpoint of an earlier version names no records: its runs kept every record they had.
    missing = [name for name in self.records if "records" in meta and name not in meta["records"]]
    if missing:
      raise CheckpointError(
          f"the checkpoint directory holds a checkpoint ({self.path}) whose history does not keep {missing}, which this "
          f"run's does: it was written by a run that recorded less (history='evaluations' keeps no "
          f"per-update rows), and rows never written cannot be restored, whatever Checkpoint.changes allows; resume "
          f"with the setting it was written with, or start over with dj.Checkpoint(..., resume=False) or another directory.")
    if meta.get("carry") != _structure(carry):
      raise CheckpointError(
          f"the checkpoint directory holds a checkpoint ({self.path}) whose state has another structure, shapes or dtypes "
          f"than this run's; it cannot be resumed, even with resume_changes.")
    leaves, treedef = jax.tree.flatten(carry)
    targets = jax.tree.leaves(shardings)
    abstract = {str(i): jax.ShapeDtypeStruct(np.shape(x), _dtype(x), sharding=s)
                for i, (x, s) in enumerate(zip(leaves, targets, strict=True)) if np.size(x)}
    try:
      state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
    except Exception as e:  # noqa: BLE001 - as above
      raise _damaged(os.path.join(folder, "state"), f"cannot be read: {_short(e)}") from None
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
    self._chunks_saved = int(meta["chunks_done"])
    return (tuple(jax.tree.unflatten(treedef, restored)), self._read_records(records_like),
            int(meta["chunks_done"]))

  def _legacy_version(self) -> Any:
    """The format version a single-file checkpoint names in its first line (``"unknown"`` if it names none)."""
    try:
      with open(self.legacy_path, "rb") as f:
        match = _LEGACY_MAGIC.match(f.read(64))
    except OSError:
      match = None
    return int(match.group(1)) if match else "unknown"

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
