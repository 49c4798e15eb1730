"""The ``Schedule``: the deterministic record of reads and pushes of a simulated cluster."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
  """Which gradients form each update, and which parameter version each was computed at.

  Updates are numbered ``u = 0 .. num_updates - 1``; update ``u`` is applied to
  server version ``u`` and produces version ``u + 1``. A contribution of worker
  ``m`` to update ``u`` was computed at version ``read_version[u, m] <= u``,
  so its staleness is ``u - read_version[u, m]`` (zero means synchronous).

  Attributes:
    time: float64 ``[U]``, simulated seconds at which update ``u`` is applied;
      non-decreasing.
    contributes: bool ``[U, M]``, whether worker ``m`` pushed a gradient that is
      part of update ``u``.
    read_version: int64 ``[U, M]``, the version the contribution was computed
      at, or ``-1`` where ``contributes`` is false.
    wait: float64 ``[M]``, total simulated seconds each worker spent blocked
      by the synchronization paradigm.
    num_batches: int64 ``[U, M]``, minibatches worker ``m`` contributed to
      update ``u`` (all computed at ``read_version[u, m]``); equals
      ``contributes`` except in K-batch paradigms.
    dropped: int64 ``[M]``, gradients each worker computed that were never
      applied (K-sync, backup workers).
    busy: float64 ``[M]``, total simulated seconds each worker spent
      computing (and communicating).
    paradigm: a short description of the synchronization paradigm.
    extras: optional named NumPy arrays a paradigm records (e.g. DSSP's
      threshold per push); saved and loaded with the schedule.
  """

  time: np.ndarray
  contributes: np.ndarray
  read_version: np.ndarray
  wait: np.ndarray
  num_batches: np.ndarray | None = None
  dropped: np.ndarray | None = None
  busy: np.ndarray | None = None
  paradigm: str = ""
  extras: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    time = np.asarray(self.time, dtype=np.float64)
    contributes = np.asarray(self.contributes, dtype=bool)
    read_version = np.asarray(self.read_version, dtype=np.int64)
    wait = np.asarray(self.wait, dtype=np.float64)
    if time.ndim != 1:
      raise ValueError(f"time must be 1-D [num_updates], got shape {time.shape}.")
    if contributes.ndim != 2 or contributes.shape[0] != time.shape[0]:
      raise ValueError(
          f"contributes must have shape [num_updates={time.shape[0]}, num_workers], got {contributes.shape}.")
    num_updates, num_workers = contributes.shape
    if num_workers < 1:
      raise ValueError(f"a schedule needs at least one worker, got contributes of shape {contributes.shape}.")
    if read_version.shape != contributes.shape:
      raise ValueError(f"read_version must have shape {contributes.shape}, got {read_version.shape}.")
    if wait.shape != (num_workers,):
      raise ValueError(f"wait must have shape ({num_workers},), got {wait.shape}.")
    if not np.all(np.isfinite(time)) or np.any(np.diff(time) < 0):
      raise ValueError("time must be finite and non-decreasing.")
    updates = np.arange(num_updates)[:, None]
    bad = contributes & ((read_version < 0) | (read_version > updates))
    if np.any(bad):
      u, m = np.argwhere(bad)[0]
      raise ValueError(
          f"read_version[{u}, {m}] = {read_version[u, m]} is not a version available at update {u} "
          f"(allowed: 0..{u}).")
    if np.any(read_version[~contributes] != -1):
      raise ValueError("read_version must be -1 where contributes is false.")
    num_batches = (contributes.astype(np.int64) if self.num_batches is None
                   else np.asarray(self.num_batches, dtype=np.int64))
    if num_batches.shape != contributes.shape or np.any((num_batches > 0) != contributes):
      raise ValueError("num_batches must have the shape of contributes and be positive exactly where it is true.")
    dropped = (np.zeros(num_workers, np.int64) if self.dropped is None
               else np.asarray(self.dropped, dtype=np.int64))
    busy = (np.zeros(num_workers, np.float64) if self.busy is None
            else np.asarray(self.busy, dtype=np.float64))
    for name, value in (("dropped", dropped), ("busy", busy)):
      if value.shape != (num_workers,):
        raise ValueError(f"{name} must have shape ({num_workers},), got {value.shape}.")
    extras = {str(k): np.asarray(v) for k, v in dict(self.extras).items()}
    for name, value in (("time", time), ("contributes", contributes), ("read_version", read_version),
                        ("wait", wait), ("num_batches", num_batches), ("dropped", dropped),
                        ("busy", busy)):
      value.setflags(write=False)
      object.__setattr__(self, name, value)
    object.__setattr__(self, "extras", extras)

  @property
  def num_updates(self) -> int:
    return int(self.time.shape[0])

  @property
  def num_workers(self) -> int:
    return int(self.contributes.shape[1])

  @property
  def staleness(self) -> np.ndarray:
    """int64 ``[U, M]``: ``u - read_version[u, m]`` where ``contributes``, else ``-1``."""
    u = np.arange(self.num_updates, dtype=np.int64)[:, None]
    return np.where(self.contributes, u - self.read_version, -1)

  def __getitem__(self, index: slice) -> "Schedule":
    """The first updates of a schedule: only slices ``[:n]`` keep versions meaningful."""
    if not isinstance(index, slice) or index.start not in (None, 0) or index.step not in (None, 1):
      raise TypeError(f"a Schedule can only be cut as schedule[:n], got {index!r}.")
    stop = self.num_updates if index.stop is None else min(index.stop, self.num_updates)
    return dataclasses.replace(
        self, time=self.time[:stop], contributes=self.contributes[:stop],
        read_version=self.read_version[:stop], num_batches=self.num_batches[:stop],
        extras={k: v for k, v in self.extras.items()})

  def save(self, path: str | os.PathLike[str]) -> None:
    """Writes the schedule to ``path`` as a ``.npz`` file (uncompressed, exact)."""
    arrays: dict[str, Any] = {
        "time": self.time, "contributes": self.contributes, "read_version": self.read_version,
        "wait": self.wait, "num_batches": self.num_batches, "dropped": self.dropped,
        "busy": self.busy, "paradigm": np.asarray(self.paradigm),
    }
    for key, value in self.extras.items():
      arrays[f"extras/{key}"] = value
    with open(path, "wb") as f:
      np.savez(f, **arrays)

  @classmethod
  def load(cls, path: str | os.PathLike[str]) -> "Schedule":
    """Reads a schedule written by :meth:`save`."""
    with np.load(path, allow_pickle=False) as data:
      fields = {k: data[k] for k in data.files if not k.startswith("extras/")}
      extras = {k[len("extras/"):]: data[k] for k in data.files if k.startswith("extras/")}
    fields["paradigm"] = str(fields["paradigm"])
    return cls(**fields, extras=extras)

  def __eq__(self, other: object) -> bool:
    if not isinstance(other, Schedule):
      return NotImplemented
    same = all(np.array_equal(getattr(self, f), getattr(other, f)) for f in
               ("time", "contributes", "read_version", "wait", "num_batches", "dropped", "busy"))
    return (same and self.paradigm == other.paradigm and self.extras.keys() == other.extras.keys()
            and all(np.array_equal(v, other.extras[k]) for k, v in self.extras.items()))

  __hash__ = None  # type: ignore[assignment]
