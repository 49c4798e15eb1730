"""The ``Schedule``: the deterministic record of reads and pushes of a simulated cluster."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, NamedTuple

import numpy as np

from delayjax.cluster._schedule_io import load_npz, save_npz

# Written into saved files; untagged files (saved before it existed, sparse or dense) read as version 0.
_FORMAT_VERSION = 1

# The dense ``[U, M]`` views refuse to build arrays with more entries than this (2 GiB as int64).
DENSE_LIMIT = 2**28


class Contributions(NamedTuple):
  """The contributions of a :class:`Schedule`, one entry each, sorted by update then worker.

  The order is that of ``np.nonzero(schedule.contributes)``, so
  ``read_version[c] == schedule.read_version[update[c], worker[c]]``.

  Attributes:
    update: int64 ``[C]``, the update the gradient is part of.
    worker: int64 ``[C]``, the worker that computed it.
    read_version: int64 ``[C]``, the version it was computed at (``<= update``).
    num_batches: int64 ``[C]``, the minibatches it averages (``>= 1``).
  """

  update: np.ndarray
  worker: np.ndarray
  read_version: np.ndarray
  num_batches: np.ndarray

  @property
  def staleness(self) -> np.ndarray:
    """int64 ``[C]``: ``update - read_version``."""
    return self.update - self.read_version


def _frozen(value: np.ndarray) -> np.ndarray:
  value.setflags(write=False)
  return value


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
  """Which gradients form each update, and which parameter version each was computed at.

  Updates are numbered ``u = 0 .. num_updates - 1``; update ``u`` is applied to
  server version ``u`` and produces version ``u + 1``. A contribution of worker
  ``m`` to update ``u`` was computed at version ``read_version[u, m] <= u``,
  so its staleness is ``u - read_version[u, m]`` (zero means synchronous).

  Contributions are stored sparsely (compressed rows: ``offsets[U + 1]`` and,
  per contribution, its worker, read version and minibatch count; see
  :attr:`contributions`), so memory grows with the number of gradients
  applied, not with ``updates x workers``. The dense ``[U, M]`` views
  ``contributes``, ``read_version``, ``num_batches`` and ``staleness`` are
  built on first use (and kept); one with more than ``DENSE_LIMIT`` entries
  is refused with an error. Build a schedule from dense arrays with
  ``Schedule(time, contributes, read_version, wait, ...)``, or from sparse ones
  with :meth:`from_contributions`.

  Attributes:
    time: float64 ``[U]``, simulated seconds at which update ``u`` is applied;
      non-decreasing.
    contributes: bool ``[U, M]``, whether worker ``m`` pushed a gradient that is
      part of update ``u`` (dense view).
    read_version: int64 ``[U, M]``, the version the contribution was computed
      at, or ``-1`` where ``contributes`` is false (dense view).
    wait: float64 ``[M]``, total simulated seconds each worker spent blocked
      by the synchronization paradigm.
    num_batches: int64 ``[U, M]``, minibatches worker ``m`` contributed to
      update ``u`` (all computed at ``read_version[u, m]``); equals
      ``contributes`` except in K-batch paradigms (dense view).
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
    given = self.__dict__.pop("_given")
    time = np.asarray(self.time, dtype=np.float64)
    if time.ndim != 1:
      raise ValueError(f"time must be 1-D [num_updates], got shape {time.shape}.")
    num_updates = time.shape[0]
    if isinstance(given["contributes"], _Sparse):
      sparse = given["contributes"]
      if given["read_version"] is not None or given["num_batches"] is not None:
        raise ValueError("read_version and num_batches come with the contributions in from_contributions.")
    else:
      sparse = _Sparse.from_dense(num_updates, given["contributes"], given["read_version"],
                                  given["num_batches"])
    num_workers = sparse.num_workers
    sparse.check(num_updates)
    wait = np.asarray(self.wait, dtype=np.float64)
    if wait.shape != (num_workers,):
      raise ValueError(f"wait must have shape ({num_workers},), got {wait.shape}.")
    if not np.all(np.isfinite(time)) or np.any(np.diff(time) < 0):
      raise ValueError("time must be finite and non-decreasing.")
    dropped = (np.zeros(num_workers, np.int64) if self.dropped is None
               else np.asarray(self.dropped, dtype=np.int64))
    busy = (np.zeros(num_workers, np.float64) if self.busy is None
            else np.asarray(self.busy, dtype=np.float64))
    for name, value in (("dropped", dropped), ("busy", busy)):
      if value.shape != (num_workers,):
        raise ValueError(f"{name} must have shape ({num_workers},), got {value.shape}.")
    extras = {str(k): np.asarray(v) for k, v in dict(self.extras).items()}
    for name, value in (("time", time), ("wait", wait), ("dropped", dropped), ("busy", busy)):
      object.__setattr__(self, name, _frozen(value))
    object.__setattr__(self, "extras", extras)
    object.__setattr__(self, "_sparse", sparse)
    object.__setattr__(self, "_dense", {})

  @classmethod
  def from_contributions(cls, time: Any, offsets: Any, worker: Any, read_version: Any, wait: Any, *,
                         num_workers: int, num_batches: Any = None, dropped: Any = None, busy: Any = None,
                         paradigm: str = "", extras: dict[str, np.ndarray] | None = None) -> "Schedule":
    """Builds a schedule from its contributions in compressed rows, without any ``[U, M]`` array.

    Args:
      time: float64 ``[U]``, as in the class.
      offsets: int ``[U + 1]``, non-decreasing from 0: the contributions of update
        ``u`` are entries ``offsets[u] .. offsets[u + 1] - 1``.
      worker: int ``[C]``, the contributing worker; increasing within an update.
      read_version: int ``[C]``, the version each contribution was computed at.
      wait: float64 ``[M]``, as in the class.
      num_workers: ``M >= 1``.
      num_batches: int ``[C]``, positive; ``None`` means one minibatch each.
      dropped, busy, paradigm, extras: as in the class.
    """
    sparse = _Sparse(num_workers, offsets, worker, read_version, num_batches)
    return cls(time=time, contributes=sparse, read_version=None, wait=wait, dropped=dropped, busy=busy,
               paradigm=paradigm, extras={} if extras is None else extras)

  # -- the sparse record ------------------------------------------------------------------------

  @property
  def num_updates(self) -> int:
    return int(self.time.shape[0])

  @property
  def num_workers(self) -> int:
    return self._sparse.num_workers

  @property
  def num_contributions(self) -> int:
    """``C``: the number of (update, worker) contributions."""
    return int(self._sparse.worker.shape[0])

  @property
  def offsets(self) -> np.ndarray:
    """int64 ``[U + 1]``: update ``u``'s contributions are entries ``offsets[u] .. offsets[u + 1] - 1``."""
    return self._sparse.offsets

  @property
  def contributions(self) -> Contributions:
    """The contributions, sorted by update then worker (see :class:`Contributions`); O(C) memory."""
    s = self._sparse
    update = np.repeat(np.arange(self.num_updates, dtype=np.int64), np.diff(s.offsets))
    return Contributions(update=update, worker=s.worker, read_version=s.read_version,
                         num_batches=s.batches())

  @property
  def max_staleness(self) -> np.ndarray:
    """int64 ``[U]``: the largest staleness in each update, ``-1`` where it has no contribution.

    Equals ``staleness.max(axis=1)`` without the dense view.
    """
    offsets = self._sparse.offsets
    out = np.full(self.num_updates, -1, np.int64)
    filled = offsets[1:] > offsets[:-1]
    if np.any(filled):
      out[filled] = np.maximum.reduceat(self.contributions.staleness, offsets[:-1][filled])
    return out

  # -- dense views ------------------------------------------------------------------------------

  def _dense_view(self, name: str) -> np.ndarray:
    cached = self._dense.get(name)
    if cached is not None:
      return cached
    shape = (self.num_updates, self.num_workers)
    size = shape[0] * shape[1]
    if size > DENSE_LIMIT:
      raise ValueError(
          f"schedule.{name} as a dense [num_updates, num_workers] = [{shape[0]}, {shape[1]}] array would "
          f"have {size:,} entries ({size * 8 / 2**30:.1f} GiB as int64), more than DENSE_LIMIT = "
          f"{DENSE_LIMIT:,}; use the sparse schedule.contributions ({self.num_contributions:,} entries) "
          "and schedule.offsets instead.")
    c = self.contributions
    if name == "contributes":
      value = np.zeros(shape, bool)
      value[c.update, c.worker] = True
    else:
      fill, entries = {"read_version": (-1, c.read_version), "num_batches": (0, c.num_batches),
                       "staleness": (-1, c.staleness)}[name]
      value = np.full(shape, fill, np.int64)
      value[c.update, c.worker] = entries
    self._dense[name] = _frozen(value)
    return value

  @property
  def staleness(self) -> np.ndarray:
    """int64 ``[U, M]``: ``u - read_version[u, m]`` where ``contributes``, else ``-1`` (dense view)."""
    return self._dense_view("staleness")

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
    s = self._sparse
    count = int(s.offsets[stop])
    return Schedule.from_contributions(
        self.time[:stop], s.offsets[:stop + 1], s.worker[:count], s.read_version[:count], wait,
        num_workers=self.num_workers, num_batches=None if s.num_batches is None else s.num_batches[:count],
        dropped=dropped, busy=busy, paradigm=self.paradigm, extras=extras)

  def save(self, path: str | os.PathLike[str]) -> None:
    """Writes the schedule to ``path`` as a ``.npz`` file (uncompressed, exact; sparse contributions).

    :meth:`load` also reads the dense files written before schedules were sparse.
    """
    s = self._sparse
    arrays: dict[str, Any] = {
        "time": self.time, "offsets": s.offsets, "worker": s.worker,
        "contribution_read_version": s.read_version, "contribution_num_batches": s.batches(),
        "num_workers": np.asarray(self.num_workers, np.int64),
        "wait": self.wait, "dropped": self.dropped, "busy": self.busy, "paradigm": np.asarray(self.paradigm),
    }
    save_npz(path, "Schedule", _FORMAT_VERSION, arrays, self.extras)

  @classmethod
  def load(cls, path: str | os.PathLike[str]) -> "Schedule":
    """Reads a schedule written by :meth:`save` (sparse, or the older dense ``[U, M]`` format)."""
    fields, extras = load_npz(path, "Schedule", _FORMAT_VERSION, ("time", "wait", "paradigm"))
    fields["paradigm"] = str(fields["paradigm"])
    if "contributes" in fields:
      return cls(**fields, extras=extras)
    return cls.from_contributions(
        fields["time"], fields["offsets"], fields["worker"], fields["contribution_read_version"],
        fields["wait"], num_workers=int(fields["num_workers"]),
        num_batches=fields["contribution_num_batches"], dropped=fields["dropped"], busy=fields["busy"],
        paradigm=fields["paradigm"], extras=extras)

  def __eq__(self, other: object) -> bool:
    if not isinstance(other, Schedule):
      return NotImplemented
    a, b = self._sparse, other._sparse
    same = (a.num_workers == b.num_workers
            and all(np.array_equal(getattr(self, f), getattr(other, f))
                    for f in ("time", "wait", "dropped", "busy"))
            and all(np.array_equal(x, y) for x, y in ((a.offsets, b.offsets), (a.worker, b.worker),
                                                     (a.read_version, b.read_version)))
            and np.array_equal(a.batches(), b.batches()))
    return (same and self.paradigm == other.paradigm and self.extras.keys() == other.extras.keys()
            and all(np.array_equal(v, other.extras[k]) for k, v in self.extras.items()))

  __hash__ = None  # type: ignore[assignment]

  def _staleness_values(self) -> tuple[np.ndarray, np.ndarray]:
    """Staleness of every contribution and its number of minibatches."""
    c = self.contributions
    return c.staleness, c.num_batches

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



class _Sparse:
  """A schedule's contributions in compressed rows (see :meth:`Schedule.from_contributions`)."""

  def __init__(self, num_workers: Any, offsets: Any, worker: Any, read_version: Any, num_batches: Any):
    if isinstance(num_workers, bool) or not isinstance(num_workers, (int, np.integer)) or num_workers < 1:
      raise ValueError(f"a schedule needs at least one worker, got num_workers={num_workers!r}.")
    self.num_workers = int(num_workers)
    self.offsets = _frozen(np.asarray(offsets, dtype=np.int64))
    self.worker = _frozen(np.asarray(worker, dtype=np.int64))
    self.read_version = _frozen(np.asarray(read_version, dtype=np.int64))
    self.num_batches = None if num_batches is None else _frozen(np.asarray(num_batches, dtype=np.int64))

  @classmethod
  def from_dense(cls, num_updates: int, contributes: Any, read_version: Any, num_batches: Any) -> "_Sparse":
    contributes = np.asarray(contributes, dtype=bool)
    read_version = np.asarray(read_version, dtype=np.int64)
    if contributes.ndim != 2 or contributes.shape[0] != num_updates:
      raise ValueError(
          f"contributes must have shape [num_updates={num_updates}, num_workers], got {contributes.shape}.")
    if contributes.shape[1] < 1:
      raise ValueError(f"a schedule needs at least one worker, got contributes of shape {contributes.shape}.")
    if read_version.shape != contributes.shape:
      raise ValueError(f"read_version must have shape {contributes.shape}, got {read_version.shape}.")
    if np.any((read_version != -1) & ~contributes):
      raise ValueError("read_version must be -1 where contributes is false.")
    if num_batches is not None:
      num_batches = np.asarray(num_batches, dtype=np.int64)
      if num_batches.shape != contributes.shape or np.any((num_batches > 0) != contributes):
        raise ValueError("num_batches must have the shape of contributes and be positive exactly where it is true.")
    u, m = np.nonzero(contributes)
    offsets = np.concatenate([[0], np.cumsum(contributes.sum(axis=1, dtype=np.int64))])
    batches = None if num_batches is None or np.all(num_batches[u, m] == 1) else num_batches[u, m]
    return cls(contributes.shape[1], offsets, m, read_version[u, m], batches)

  def batches(self) -> np.ndarray:
    """int64 ``[C]``: minibatches per contribution (ones when not recorded)."""
    if self.num_batches is None:
      return np.ones(self.worker.shape[0], np.int64)
    return self.num_batches

  def check(self, num_updates: int) -> None:
    offsets, worker, version = self.offsets, self.worker, self.read_version
    if offsets.shape != (num_updates + 1,) or offsets[0] != 0 or np.any(np.diff(offsets) < 0):
      raise ValueError(
          f"offsets must be non-decreasing from 0 with shape [num_updates + 1] = [{num_updates + 1}], "
          f"got shape {offsets.shape}.")
    count = int(offsets[-1])
    for name, value in (("worker", worker), ("read_version", version), ("num_batches", self.num_batches)):
      if value is not None and value.shape != (count,):
        raise ValueError(f"{name} must have one entry per contribution, shape ({count},), got {value.shape}.")
    if count and (worker.min() < 0 or worker.max() >= self.num_workers):
      raise ValueError(f"worker must be in 0..{self.num_workers - 1}, got {worker.min()}..{worker.max()}.")
    # Increasing within each update: a decrease may only happen where an update starts.
    step = np.diff(worker) <= 0
    starts = offsets[1:-1]
    step[starts[(starts > 0) & (starts < count)] - 1] = False
    if np.any(step):
      c = int(np.argmax(step)) + 1
      raise ValueError(f"worker must be increasing within each update (one contribution per worker and update); "
                       f"contribution {c} repeats or precedes worker {worker[c - 1]}.")
    update = np.repeat(np.arange(num_updates, dtype=np.int64), np.diff(offsets))
    bad = (version < 0) | (version > update)
    if np.any(bad):
      c = int(np.argmax(bad))
      u, m = update[c], worker[c]
      raise ValueError(
          f"read_version[{u}, {m}] = {version[c]} is not a version available at update {u} "
          f"(allowed: 0..{u}).")
    if self.num_batches is not None and count and self.num_batches.min() < 1:
      raise ValueError("num_batches must be positive for every contribution.")


def _dense_property(name: str, doc: str) -> property:
  def get(self: Schedule) -> np.ndarray:
    return self._dense_view(name)

  def set_given(self: Schedule, value: Any) -> None:
    # Only the dataclass' __init__ sets it (the class is frozen): keep the input for __post_init__.
    self.__dict__.setdefault("_given", {})[name] = value

  return property(get, set_given, doc=doc)


# The dense fields are views of the sparse record: they stay dataclass fields (so ``Schedule(time,
# contributes, read_version, wait, ...)`` and ``dataclasses.replace`` work) and read as properties.
Schedule.contributes = _dense_property(  # type: ignore[assignment]
    "contributes", "bool ``[U, M]``: whether worker ``m`` is part of update ``u`` (dense view).")
Schedule.read_version = _dense_property(  # type: ignore[assignment]
    "read_version", "int64 ``[U, M]``: the version each contribution was computed at, else -1 (dense view).")
Schedule.num_batches = _dense_property(  # type: ignore[assignment]
    "num_batches", "int64 ``[U, M]``: minibatches per contribution, else 0 (dense view).")


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
  update_offsets = np.cumsum([0] + [s.num_updates for s in schedules[:-1]])
  count_offsets = np.cumsum([0] + [s.num_contributions for s in schedules[:-1]])
  extras = {}
  for key in first.extras:
    parts = [s.extras[key] for s in schedules]
    if key in ("event_update", "event_read_version"):
      parts = [np.where(p >= 0, p + off, p) for p, off in zip(parts, update_offsets)]
    extras[key] = np.concatenate(parts)
  if "event_worker" in extras:
    # Keep the events sorted by worker (then time), as the simulator writes them.
    order = np.argsort(extras["event_worker"], kind="stable")
    extras = {k: v[order] if k.startswith("event_") else v for k, v in extras.items()}
  parts = [s._sparse for s in schedules]  # pylint: disable=protected-access
  ones = all(p.num_batches is None for p in parts)
  return Schedule.from_contributions(
      np.concatenate([s.time for s in schedules]),
      np.concatenate([[0]] + [p.offsets[1:] + off for p, off in zip(parts, count_offsets)]),
      np.concatenate([p.worker for p in parts]),
      np.concatenate([p.read_version + off for p, off in zip(parts, update_offsets)]),
      np.sum([s.wait for s in schedules], axis=0),
      num_workers=first.num_workers,
      num_batches=None if ones else np.concatenate([p.batches() for p in parts]),
      dropped=np.sum([s.dropped for s in schedules], axis=0),
      busy=np.sum([s.busy for s in schedules], axis=0),
      paradigm=first.paradigm, extras=extras)
