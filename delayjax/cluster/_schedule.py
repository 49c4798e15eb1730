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
    if np.any((read_version != -1) & ~contributes):
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
    """The schedule up to the moment its ``n``-th update is applied: ``schedule[:n]``.

    Per-update arrays (and per-update ``extras``) are cut. When the schedule
    records its events (``extras["event_*"]``), the events that had started
    by then (read a version below ``n``) are kept, those whose gradient was not applied by then are
    marked still running (``event_update = -2``), and ``busy``, ``wait`` and
    ``dropped`` are recounted up to that moment; otherwise they stay the
    whole run's totals.
    """
    if not isinstance(index, slice) or index.start not in (None, 0) or index.step not in (None, 1):
      raise TypeError(f"a Schedule can only be cut as schedule[:n], got {index!r}.")
    stop = self.num_updates if index.stop is None else min(index.stop, self.num_updates)
    if stop < 1:
      raise ValueError(f"a Schedule needs at least one update, got schedule[:{index.stop}].")
    extras = {k: v[:stop] if not k.startswith("event_") and v.shape[:1] == (self.num_updates,) else v
              for k, v in self.extras.items()}
    busy, wait, dropped = self.busy, self.wait, self.dropped
    if stop < self.num_updates and "event_read_time" in extras:
      end = self.time[stop - 1]
      # A read of version `stop` follows the last kept update: it had not happened yet.
      keep = extras["event_read_version"] < stop
      events = {k: v[keep] for k, v in extras.items() if k.startswith("event_")}
      update, finish = events["event_update"].copy(), events["event_end_time"]
      update[(update >= stop) | ((update == -1) & (finish > end))] = -2
      events["event_update"] = update
      worker = events["event_worker"]
      busy = np.bincount(worker, np.minimum(finish, end) - events["event_read_time"], self.num_workers)
      wait = end - busy
      dropped = np.bincount(worker, update == -1, self.num_workers).astype(np.int64)
      extras.update(events)
    return dataclasses.replace(
        self, time=self.time[:stop], contributes=self.contributes[:stop],
        read_version=self.read_version[:stop], num_batches=self.num_batches[:stop],
        busy=busy, wait=wait, dropped=dropped, extras=extras)

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

  def _staleness_values(self) -> tuple[np.ndarray, np.ndarray]:
    """Staleness of every contribution and its number of minibatches (without a dense [U, M] copy)."""
    u, m = np.nonzero(self.contributes)
    return u - self.read_version[u, m], self.num_batches[u, m]

  def staleness_histogram(self) -> np.ndarray:
    """int64 ``[max staleness + 1]``: how many gradients (minibatches) were applied at each staleness."""
    tau, batches = self._staleness_values()
    return np.bincount(tau, weights=batches).astype(np.int64)

  def mean_staleness(self) -> float:
    """The mean staleness over applied gradients (minibatches)."""
    tau, batches = self._staleness_values()
    return float(np.dot(tau, batches) / batches.sum()) if batches.sum() else float("nan")

  @property
  def total_time(self) -> float:
    """Simulated seconds until the last update, ``time[-1]``."""
    return float(self.time[-1]) if self.num_updates else 0.0

  @property
  def updates_per_second(self) -> float:
    """Updates per simulated second (``inf`` if no simulated time passed)."""
    if self.total_time > 0:
      return self.num_updates / self.total_time
    return float("inf") if self.num_updates else float("nan")

  @property
  def idle_fraction(self) -> np.ndarray:
    """float64 ``[M]``: the fraction of ``total_time`` each worker spent blocked, ``wait / time[-1]``."""
    return self.wait / self.total_time if self.total_time > 0 else np.zeros_like(self.wait)

  @property
  def num_dropped(self) -> int:
    """Gradients computed but never applied, over all workers."""
    return int(self.dropped.sum())

  def summary(self) -> str:
    """A few readable lines: paradigm, size, throughput, staleness, idle time, dropped gradients."""
    hist = self.staleness_histogram()
    shown = ", ".join(f"{tau}: {n}" for tau, n in enumerate(hist[:8]) if n)
    more = ", ..." if hist.shape[0] > 8 else ""
    idle = self.idle_fraction
    return "\n".join([
        f"Schedule {self.paradigm or '(unnamed paradigm)'}: {self.num_updates} updates, "
        f"{self.num_workers} workers, {self.total_time:.6g} simulated seconds "
        f"({self.updates_per_second:.6g} updates/s)",
        f"  staleness: mean {self.mean_staleness():.4g}, max {hist.shape[0] - 1}; histogram {{{shown}{more}}}",
        f"  idle fraction: mean {idle.mean():.3g}, min {idle.min():.3g}, max {idle.max():.3g}",
        f"  dropped gradients: {self.num_dropped}",
    ])

  def __repr__(self) -> str:
    return (f"Schedule(paradigm={self.paradigm!r}, num_updates={self.num_updates}, "
            f"num_workers={self.num_workers}, total_time={self.total_time:.6g}, "
            f"mean_staleness={self.mean_staleness():.4g}, num_dropped={self.num_dropped})")


def concatenate(schedules: "list[Schedule] | tuple[Schedule, ...]") -> Schedule:
  """Joins schedules that run one after another (e.g. the chunks of a ``Simulation``) into one.

  The updates and versions of each schedule are shifted by the number of
  updates before it; times are kept (they must continue: non-decreasing
  across the joins); ``wait``, ``busy`` and ``dropped`` are summed. All must
  have the same workers, paradigm and ``extras`` keys. Extras named
  ``event_*`` are per-gradient records (``event_update`` and
  ``event_read_version`` are shifted where they are ``>= 0``); the others are
  per-update arrays and are concatenated.

  Args:
    schedules: a non-empty sequence of schedules.

  Returns:
    The joined :class:`Schedule`.
  """
  schedules = list(schedules)
  if not schedules or not all(isinstance(s, Schedule) for s in schedules):
    raise TypeError(f"schedules must be a non-empty sequence of Schedule, got {schedules!r}.")
  first = schedules[0]
  for s in schedules[1:]:
    if s.num_workers != first.num_workers or s.paradigm != first.paradigm or s.extras.keys() != first.extras.keys():
      raise ValueError(
          "schedules must share num_workers, paradigm and extras keys; got "
          f"({first.num_workers}, {first.paradigm!r}, {sorted(first.extras)}) and "
          f"({s.num_workers}, {s.paradigm!r}, {sorted(s.extras)}).")
  offsets = np.cumsum([0] + [s.num_updates for s in schedules[:-1]])
  read_version = np.concatenate(
      [np.where(s.contributes, s.read_version + off, -1) for s, off in zip(schedules, offsets)])
  extras = {}
  for key in first.extras:
    parts = [s.extras[key] for s in schedules]
    if key in ("event_update", "event_read_version"):
      parts = [np.where(p >= 0, p + off, p) for p, off in zip(parts, offsets)]
    extras[key] = np.concatenate(parts)
  if "event_worker" in extras:
    # Keep the events sorted by worker (then time), as the simulator writes them.
    order = np.argsort(extras["event_worker"], kind="stable")
    extras = {k: v[order] if k.startswith("event_") else v for k, v in extras.items()}
  return Schedule(
      time=np.concatenate([s.time for s in schedules]),
      contributes=np.concatenate([s.contributes for s in schedules]),
      read_version=read_version,
      wait=np.sum([s.wait for s in schedules], axis=0),
      num_batches=np.concatenate([s.num_batches for s in schedules]),
      dropped=np.sum([s.dropped for s in schedules], axis=0),
      busy=np.sum([s.busy for s in schedules], axis=0),
      paradigm=first.paradigm, extras=extras)
