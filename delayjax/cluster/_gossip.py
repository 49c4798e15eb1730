"""Gossip schedules: the exact, deterministic event record of decentralized (gossip) training.

There is no server: ``M`` replicas each keep their own model ``x_i`` and
optimizer state. A :class:`GossipSchedule` lists ``E`` events **in execution
order** (``time`` is non-decreasing; events at the same second happen in the
listed order). Each event is one of three kinds (``kind[e]``, int8):

- ``READ`` (0): replica ``worker[e]`` snapshots its current model to compute
  its next gradient, on ``num_batches[e]`` minibatches (their mean).
- ``GRAD`` (1): replica ``worker[e]`` applies the gradient computed at its last
  ``READ`` through its own optimizer, to its *current* model (which may have
  been mixed since the read). Per replica, ``READ`` and ``GRAD`` events
  alternate, starting with a ``READ``; a final ``READ`` without its ``GRAD``
  is a gradient still being computed when the record ends. ``num_batches[e]``
  repeats the value of its ``READ``.
- ``MIX`` (2): a group of replicas combine values. Mixes are numbered
  ``k = 0 .. K - 1`` in execution order, ``mix[e] = k`` (``-1`` for other
  events), and described by per-mix tables (so that ``READ`` and ``GRAD``
  events carry no ``P x P`` padding): ``members[k, :]`` holds the replica
  indices (``-1`` padded at the end; ``P`` is the largest group),
  ``weights[k, a, b]`` the weights, ``receives[k, a]`` whether member ``a`` is
  replaced, ``lag[k, b]`` how old member ``b``'s sent value is, and
  ``mixes[k]`` what is mixed:

  * ``PARAMS`` (0): for every member ``a`` with ``receives[k, a]``,

    .. math::  x_{m_a} \\leftarrow \\sum_b W_{ab}\\, x_{m_b}^{(v_b - \\ell_b)}

    where ``v_b`` is member ``b``'s local version just before the event and
    ``x^{(v)}`` its model at version ``v``: ``lag[k, b] = 0`` sends the current
    model, ``lag > 0`` a value ``lag`` versions old (a late message, as in
    SGP's tau-overlap). All sent values are taken before any member is
    replaced (the event is atomic). Members with ``receives`` false only send
    (their row is all zero and ignored).
  * ``GRADS`` (1): the same rule on the members' *pending gradients* (computed
    at their last ``READ``, not yet applied): GossipGraD's gradient gossip and
    the all-reduce baseline. Every member must have a pending gradient, and
    ``lag`` is 0.

  ``worker[e] = -1`` and ``num_batches[e] = 0`` for ``MIX`` events.

**Local versions.** Each replica's version starts at 0 and counts the changes
to its model: every ``GRAD`` of that replica, and every ``PARAMS`` ``MIX`` in
which it receives. A gradient's *staleness* is the number of changes between
its ``READ`` and its ``GRAD``; a message's *lag* is ``lag[k, b]``.

The schedule carries no method rule: a method interprets the events (SGP
mixes the push-sum weight ``w`` with the same weights as ``x`` and computes
gradients at ``x / w``; A2CiD2 uses ``time`` to mix its momentum pair between
events). ``busy[m]`` and ``wait[m]`` count simulated seconds each replica
computed and was blocked in ``[0, time[-1]]``; ``extras`` hold named arrays a
paradigm records. The simulator records ``compute_end`` (float64 ``[E]``: for
each ``GRAD`` event, when its gradient finished computing; NaN elsewhere) and
the intervals each replica computed, ``busy_worker``, ``busy_start``,
``busy_stop`` (one entry per gradient; a gradient still computing at the end
stops after ``time[-1]``).

**Paradigms** (``simulate_gossip``; each class docstring has the rule and
its reference): ``allreduce`` (rounds: every replica reads, one ``GRADS`` mix
``1/M``, every replica applies), ``d_psgd`` (rounds: reads, one ``PARAMS`` mix
with ``W``, applies), ``gossipgrad`` (rounds: reads, one ``GRADS`` mix with the
rotating partner, applies), ``ad_psgd`` (asynchronous: each gradient's read,
one two-member ``PARAMS`` mix of weight 1/2, its apply), ``sgp`` (asynchronous:
read, apply, a one-member halving mix, later one two-member receive mix per
message, possibly late), ``asap`` (asynchronous: read, apply, one
``PARAMS`` reduce of the messages notified since, send once the receivers
have ACKed the previous message); ``failures`` drop messages (``receives`` false, or no
mix; with ``on_failure="reuse"``, a late message: the last one that arrived) and take nodes out for windows.
"""

from __future__ import annotations

import dataclasses
import heapq
import os
from typing import Any, Sequence

import numpy as np

from delayjax import topology as topo
from delayjax._checks import check_choice, check_float, check_int, check_seed
from delayjax._memory import available_memory, check_fits
from delayjax.cluster._schedule_io import load_npz, save_npz
from delayjax.cluster._simulate import _seed_sequences, _Times, _window_factors
from delayjax.cluster._workers import Workers

__all__ = [
    "GossipSchedule", "READ", "GRAD", "MIX", "PARAMS", "GRADS",
    "GossipParadigm", "AllReduce", "DPSGD", "ADPSGD", "SGP", "GossipGraD", "ASAP", "Failures", "NodeDown",
    "allreduce", "d_psgd", "ad_psgd", "sgp", "gossipgrad", "asap", "failures", "node_down", "simulate_gossip",
]

READ, GRAD, MIX = 0, 1, 2
PARAMS, GRADS = 0, 1
_KIND_NAMES = {READ: "READ", GRAD: "GRAD", MIX: "MIX"}

_EVENT_ARRAYS = ("time", "kind", "worker", "num_batches", "mix")
_MIX_ARRAYS = ("members", "weights", "lag", "receives", "mixes")
_ARRAYS = _EVENT_ARRAYS + _MIX_ARRAYS + ("busy", "wait")
# Written into saved files; files without one (saved before it existed) read as version 0, the same layout.
_FORMAT_VERSION = 1


def _fail(message: str) -> None:
  raise ValueError(f"invalid GossipSchedule: {message}")


@dataclasses.dataclass(frozen=True, eq=False)
class GossipSchedule:
  """The events of decentralized training over ``M`` replicas, in execution order (see the module docstring).

  Attributes:
    num_workers: ``M``, the number of replicas.
    time: float64 ``[E]``, simulated seconds; non-decreasing.
    kind: int8 ``[E]``, ``READ`` (0), ``GRAD`` (1) or ``MIX`` (2).
    worker: int64 ``[E]``, the replica of a ``READ`` / ``GRAD``; ``-1`` for ``MIX``.
    num_batches: int64 ``[E]``, minibatches of the gradient read or applied; 0 for ``MIX``.
    mix: int64 ``[E]``, the row of a ``MIX`` event in the mix tables (``0 .. K - 1`` in order); ``-1`` otherwise.
    members: int64 ``[K, P]``, each mix's replicas, distinct, ``-1`` padded at the end.
    weights: float64 ``[K, P, P]``, ``weights[k, a, b]``: weight of member ``b``'s sent value in member ``a``'s new one.
    lag: int64 ``[K, P]``, local versions by which member ``b``'s sent value is old (0: current).
    receives: bool ``[K, P]``, whether member ``a`` is replaced.
    mixes: int8 ``[K]``, ``PARAMS`` (0) or ``GRADS`` (1).
    busy: float64 ``[M]``, seconds each replica spent computing, up to ``time[-1]``.
    wait: float64 ``[M]``, seconds each replica spent blocked, up to ``time[-1]``.
    paradigm: a short description of the paradigm.
    extras: named NumPy arrays a paradigm records; saved and loaded with the schedule.
  """

  num_workers: int
  time: np.ndarray
  kind: np.ndarray
  worker: np.ndarray
  num_batches: np.ndarray
  mix: np.ndarray
  members: np.ndarray
  weights: np.ndarray
  lag: np.ndarray
  receives: np.ndarray
  mixes: np.ndarray
  busy: np.ndarray | None = None
  wait: np.ndarray | None = None
  paradigm: str = ""
  extras: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    num = int(self.num_workers)
    if num < 1:
      _fail(f"num_workers must be >= 1, got {num}.")
    object.__setattr__(self, "num_workers", num)
    time = np.asarray(self.time, np.float64)
    if time.ndim != 1:
      _fail(f"time must be 1-D [E], got shape {time.shape}.")
    num_events = time.shape[0]
    mixes = np.asarray(self.mixes, np.int8)
    if mixes.ndim != 1:
      _fail(f"mixes must be 1-D [K], got shape {mixes.shape}.")
    num_mixes = mixes.shape[0]
    members = np.asarray(self.members, np.int64)
    if members.ndim != 2 or members.shape[0] != num_mixes:
      _fail(f"members must have shape [K={num_mixes}, P], got {members.shape}.")
    width = members.shape[1]
    arrays = {
        "time": time,
        "kind": np.asarray(self.kind, np.int8),
        "worker": np.asarray(self.worker, np.int64),
        "num_batches": np.asarray(self.num_batches, np.int64),
        "mix": np.asarray(self.mix, np.int64),
        "members": members,
        "weights": np.asarray(self.weights, np.float64),
        "lag": np.asarray(self.lag, np.int64),
        "receives": np.asarray(self.receives, bool),
        "mixes": mixes,
        "busy": np.zeros(num) if self.busy is None else np.asarray(self.busy, np.float64),
        "wait": np.zeros(num) if self.wait is None else np.asarray(self.wait, np.float64),
    }
    shapes = {"time": (num_events,), "kind": (num_events,), "worker": (num_events,),
              "num_batches": (num_events,), "mix": (num_events,), "members": (num_mixes, width),
              "weights": (num_mixes, width, width), "lag": (num_mixes, width),
              "receives": (num_mixes, width), "mixes": (num_mixes,), "busy": (num,), "wait": (num,)}
    for name, shape in shapes.items():
      if arrays[name].shape != shape:
        _fail(f"{name} must have shape {shape}, got {arrays[name].shape}.")
    for name, value in arrays.items():
      value.setflags(write=False)
      object.__setattr__(self, name, value)
    object.__setattr__(self, "extras", {str(k): np.asarray(v) for k, v in dict(self.extras).items()})
    object.__setattr__(self, "paradigm", str(self.paradigm))
    self._validate()

  # ---- validation -------------------------------------------------------------------------------------------

  def _validate(self) -> None:
    num, time, kind, worker = self.num_workers, self.time, self.kind, self.worker
    if not np.all(np.isfinite(time)) or np.any(np.diff(time) < 0):
      _fail("time must be finite and non-decreasing.")
    if np.any((kind < READ) | (kind > MIX)):
      _fail(f"kind must be READ (0), GRAD (1) or MIX (2); got {sorted(set(kind.tolist()))}.")
    is_mix = kind == MIX
    rg = ~is_mix
    if np.any(rg & ((worker < 0) | (worker >= num))):
      e = int(np.flatnonzero(rg & ((worker < 0) | (worker >= num)))[0])
      _fail(f"event {e} ({_KIND_NAMES[int(kind[e])]}) has worker {worker[e]}, allowed 0..{num - 1}.")
    if np.any(is_mix & (worker != -1)):
      _fail("worker must be -1 for MIX events.")
    if np.any(rg & (self.num_batches < 1)) or np.any(is_mix & (self.num_batches != 0)):
      _fail("num_batches must be >= 1 for READ/GRAD events and 0 for MIX events.")
    num_mixes = self.mixes.shape[0]
    if int(is_mix.sum()) != num_mixes or not np.array_equal(self.mix[is_mix], np.arange(num_mixes)) \
        or np.any(self.mix[rg] != -1):
      _fail(f"mix must number the {int(is_mix.sum())} MIX events 0, 1, ... in order (one row each of the "
            f"{num_mixes} mix tables) and be -1 for READ/GRAD events.")
    m, valid = self.members, self.members >= 0
    if np.any(m >= num) or np.any(m < -1):
      _fail(f"members must be replica indices in 0..{num - 1} or -1 (padding).")
    if num_mixes and (m.shape[1] == 0 or not np.all(valid[:, 0])):
      _fail("every mix needs at least one member.")
    if np.any(valid[:, 1:] & ~valid[:, :-1]):
      _fail("members must be packed at the start of each row (-1 padding only at the end).")
    srt = np.sort(np.where(valid, m, -1 - np.arange(m.shape[1])[None, :]), axis=1)
    if np.any(srt[:, 1:] == srt[:, :-1]):
      _fail("members of one mix must be distinct.")
    pad2 = ~(valid[:, :, None] & valid[:, None, :])
    if not np.all(np.isfinite(self.weights)) or np.any(self.weights[pad2] != 0):
      _fail("weights must be finite, and 0 outside the members' rows and columns.")
    if np.any(self.receives & ~valid) or np.any(self.lag[~valid] != 0) or np.any(self.lag < 0):
      _fail("receives must be false and lag 0 on padding; lag must be >= 0.")
    if np.any(np.abs(self.weights).sum(axis=2)[~self.receives] != 0):
      _fail("the weights row of a member that does not receive must be all zero.")
    if np.any((self.mixes != PARAMS) & (self.mixes != GRADS)):
      _fail("mixes must be PARAMS (0) or GRADS (1).")
    grads_mix = self.mixes == GRADS
    if np.any(self.lag[grads_mix] != 0):
      _fail("lag must be 0 in a GRADS mix (pending gradients have no history).")
    # READ and GRAD alternate per replica, starting with READ; a GRAD repeats its READ's num_batches.
    order = self._rg_order()
    k_sorted = kind[order]
    expected = np.where(self._rg_position() % 2 == 0, READ, GRAD)
    if np.any(k_sorted != expected):
      bad = order[np.flatnonzero(k_sorted != expected)[0]]
      _fail(f"READ and GRAD events of replica {worker[bad]} must alternate starting with READ "
            f"(event {bad} breaks it).")
    grads = np.flatnonzero(k_sorted == GRAD)
    if np.any(self.num_batches[order[grads]] != self.num_batches[order[grads - 1]]):
      _fail("a GRAD's num_batches must equal its READ's.")
    # Lags reach back no further than version 0; GRADS mixes need a pending gradient of every member.
    k_mix, a_mix = np.nonzero(valid)
    e_mix = np.flatnonzero(is_mix)[k_mix]
    replica = m[k_mix, a_mix]
    before = self._changes_before(e_mix, replica)
    if np.any(self.lag[k_mix, a_mix] > before):
      i = int(np.flatnonzero(self.lag[k_mix, a_mix] > before)[0])
      _fail(f"lag[{k_mix[i]}, {a_mix[i]}] = {self.lag[k_mix[i], a_mix[i]]} reaches before replica "
            f"{replica[i]}'s version 0 (it has version {before[i]}).")
    sel = grads_mix[k_mix]
    if np.any(sel):
      pending = self._pending(e_mix[sel], replica[sel])
      if not np.all(pending):
        i = int(np.flatnonzero(~pending)[0])
        _fail(f"GRADS mix at event {e_mix[sel][i]} includes replica {replica[sel][i]}, which has no pending "
              "gradient (no READ since its last GRAD).")

  def _cached(self, name: str, fn: Any) -> np.ndarray:
    if name not in self.__dict__:
      self.__dict__[name] = fn()
    return self.__dict__[name]

  def _rg_order(self) -> np.ndarray:
    """READ/GRAD event indices sorted by replica, then by event."""
    def order():
      rg = np.flatnonzero(self.kind != MIX)
      return rg[np.argsort(self.worker[rg], kind="stable")]
    return self._cached("_rg_order_", order)

  def _rg_position(self) -> np.ndarray:
    """For ``_rg_order()``, each event's position among its replica's READ/GRAD events."""
    order = self._rg_order()
    w = self.worker[order]
    first = np.r_[True, w[1:] != w[:-1]] if order.size else np.zeros(0, bool)
    return np.arange(order.size) - np.maximum.accumulate(np.where(first, np.arange(order.size), 0))

  def _change_keys(self) -> np.ndarray:
    """Sorted keys ``replica * (E + 1) + event`` of every change of a replica's model."""
    def keys():
      stride = self.num_events + 1
      g = np.flatnonzero(self.kind == GRAD)
      k, a = np.nonzero(self.receives & (self.mixes == PARAMS)[:, None])
      e = np.flatnonzero(self.kind == MIX)[k]
      return np.sort(np.concatenate([self.worker[g] * stride + g, self.members[k, a] * stride + e]))
    return self._cached("_change_keys_", keys)

  def _changes_before(self, events: np.ndarray, replicas: np.ndarray) -> np.ndarray:
    """int64: the local version of each ``replicas[i]`` just before event ``events[i]``."""
    stride = self.num_events + 1
    keys = self._change_keys()
    return (np.searchsorted(keys, replicas * stride + events)
            - np.searchsorted(keys, replicas * stride)).astype(np.int64)

  def _pending(self, events: np.ndarray, replicas: np.ndarray) -> np.ndarray:
    """bool: whether each replica has read and not yet applied a gradient just before each event."""
    stride = self.num_events + 1
    rg = np.flatnonzero(self.kind != MIX)
    keys = np.sort(self.worker[rg] * stride + rg)
    pos = np.searchsorted(keys, replicas * stride + events) - 1
    ok = pos >= 0
    prev = np.where(ok, keys[np.maximum(pos, 0)], 0)
    ok &= prev // stride == replicas
    return ok & (self.kind[prev % stride] == READ)

  # ---- derived records --------------------------------------------------------------------------------------

  @property
  def num_events(self) -> int:
    return int(self.time.shape[0])

  @property
  def num_mixes(self) -> int:
    return int(self.mixes.shape[0])

  @property
  def group_size(self) -> int:
    """``P``, the width of ``members``."""
    return int(self.members.shape[1])

  @property
  def total_time(self) -> float:
    """Simulated seconds until the last event."""
    return float(self.time[-1]) if self.num_events else 0.0

  @property
  def num_gradients(self) -> int:
    """Gradients applied (``GRAD`` events)."""
    return int(np.count_nonzero(self.kind == GRAD))

  @property
  def max_lag(self) -> int:
    """The largest message lag: a runtime keeps this many past versions of each replica."""
    return int(self.lag.max()) if self.lag.size else 0

  def mix_versions(self) -> np.ndarray:
    """int64 ``[K, P]``: each mix member's local version just before the mix; ``-1`` on padding."""
    out = np.full(self.members.shape, -1, np.int64)
    k, a = np.nonzero(self.members >= 0)
    out[k, a] = self._changes_before(np.flatnonzero(self.kind == MIX)[k], self.members[k, a])
    return out

  def read_version(self) -> np.ndarray:
    """int64 ``[E]``: for ``READ`` and ``GRAD`` events, the replica's version at the gradient's ``READ``; else ``-1``."""
    out = np.full(self.num_events, -1, np.int64)
    order = self._rg_order()
    v = self._changes_before(order, self.worker[order])
    # A GRAD's read is the previous READ/GRAD event of the same replica.
    g = np.flatnonzero(self.kind[order] == GRAD)
    v[g] = v[g - 1]
    out[order] = v
    return out

  def staleness(self) -> np.ndarray:
    """int64 ``[E]``: for ``GRAD`` events, the changes to the replica between its ``READ`` and this ``GRAD``; else ``-1``."""
    g = np.flatnonzero(self.kind == GRAD)
    out = np.full(self.num_events, -1, np.int64)
    out[g] = self._changes_before(g, self.worker[g]) - self.read_version()[g]
    return out

  def batch_index(self) -> np.ndarray:
    """int64 ``[E]``: for ``READ``/``GRAD`` events, the replica's index of the gradient's first minibatch
    (minibatches counted per replica in ``READ`` order: ``0, nb_0, nb_0 + nb_1, ...``); ``-1`` for ``MIX``."""
    out = np.full(self.num_events, -1, np.int64)
    order = self._rg_order()
    pos = self._rg_position()
    nb = np.where(pos % 2 == 0, self.num_batches[order], 0)
    csum = np.cumsum(nb) - nb
    start = np.flatnonzero(pos == 0)
    first = np.repeat(start, np.diff(np.r_[start, order.size]))
    idx = csum - csum[first]
    g = np.flatnonzero(pos % 2 == 1)
    idx[g] = idx[g - 1]
    out[order] = idx
    return out

  # ---- statistics -------------------------------------------------------------------------------------------

  @property
  def events_per_second(self) -> float:
    """Events per simulated second (``inf`` if no time passed)."""
    if self.total_time > 0:
      return self.num_events / self.total_time
    return float("inf") if self.num_events else float("nan")

  @property
  def gradients_per_second(self) -> float:
    """Applied gradients per simulated second."""
    if self.total_time > 0:
      return self.num_gradients / self.total_time
    return float("inf") if self.num_gradients else float("nan")

  @property
  def idle_fraction(self) -> np.ndarray:
    """float64 ``[M]``: the fraction of ``total_time`` each replica spent blocked, ``wait / time[-1]``."""
    return self.wait / self.total_time if self.total_time > 0 else np.zeros_like(self.wait)

  def message_lags(self) -> np.ndarray:
    """int64: the lag of every message of a ``PARAMS`` mix (member ``b``'s value used with a non-zero weight
    by a receiving member ``a != b``)."""
    sent = (self.weights != 0) & self.receives[:, :, None]
    sent &= ~np.eye(self.group_size, dtype=bool)[None]
    sent &= (self.mixes == PARAMS)[:, None, None]
    k, _, b = np.nonzero(sent)
    return self.lag[k, b]

  def lag_histogram(self) -> np.ndarray:
    """int64 ``[max lag + 1]``: how many messages arrived at each lag (local versions late)."""
    return np.bincount(self.message_lags()).astype(np.int64)

  def staleness_histogram(self) -> np.ndarray:
    """int64 ``[max staleness + 1]``: how many gradients were applied at each staleness (model changes since their read)."""
    s = self.staleness()
    return np.bincount(s[s >= 0]).astype(np.int64)

  def summary(self) -> str:
    """A few readable lines: paradigm, size, throughput, staleness, message lags, idle time."""
    counts = np.bincount(self.kind, minlength=3)
    stale = self.staleness_histogram()
    lags = self.lag_histogram()
    idle = self.idle_fraction
    mean_stale = float(np.dot(np.arange(stale.size), stale) / stale.sum()) if stale.sum() else float("nan")
    shown = ", ".join(f"{i}: {int(n)}" for i, n in enumerate(lags[:8]) if n)
    return "\n".join([
        f"GossipSchedule {self.paradigm or '(unnamed paradigm)'}: {self.num_events} events "
        f"({counts[READ]} reads, {counts[GRAD]} gradients, {counts[MIX]} mixes), {self.num_workers} replicas, "
        f"{self.total_time:.6g} simulated seconds ({self.events_per_second:.6g} events/s)",
        f"  gradient staleness (local versions): mean {mean_stale:.4g}, max {max(stale.size - 1, 0)}",
        f"  message lags: {{{shown}}}",
        f"  idle fraction: mean {idle.mean():.3g}, min {idle.min():.3g}, max {idle.max():.3g}",
    ])

  def __repr__(self) -> str:
    return (f"GossipSchedule(paradigm={self.paradigm!r}, num_workers={self.num_workers}, "
            f"num_events={self.num_events}, num_gradients={self.num_gradients}, "
            f"total_time={self.total_time:.6g})")

  # ---- persistence ------------------------------------------------------------------------------------------

  def save(self, path: str | os.PathLike[str]) -> None:
    """Writes the schedule to ``path`` as an uncompressed ``.npz`` file (exact, tagged with its format version)."""
    arrays: dict[str, Any] = {name: getattr(self, name) for name in _ARRAYS}
    arrays["num_workers"] = np.asarray(self.num_workers, np.int64)
    arrays["paradigm"] = np.asarray(self.paradigm)
    save_npz(path, "GossipSchedule", _FORMAT_VERSION, arrays, self.extras)

  @classmethod
  def load(cls, path: str | os.PathLike[str]) -> "GossipSchedule":
    """Reads a schedule written by :meth:`save`; a file of another kind or a newer format is refused by name."""
    fields, extras = load_npz(path, "GossipSchedule", _FORMAT_VERSION, _ARRAYS + ("num_workers", "paradigm"))
    fields["num_workers"] = int(fields["num_workers"])
    fields["paradigm"] = str(fields["paradigm"])
    return cls(**fields, extras=extras)

  def __eq__(self, other: object) -> bool:
    if not isinstance(other, GossipSchedule):
      return NotImplemented
    return (self.num_workers == other.num_workers and self.paradigm == other.paradigm
            and all(np.array_equal(getattr(self, f), getattr(other, f)) for f in _ARRAYS)
            and self.extras.keys() == other.extras.keys()
            and all(np.array_equal(v, other.extras[k], equal_nan=v.dtype.kind == "f")
                    for k, v in self.extras.items()))

  __hash__ = None  # type: ignore[assignment]


# ---- building schedules -------------------------------------------------------------------------------------


class _Builder:
  """Collects events in execution order and the mix tables, and turns them into a :class:`GossipSchedule`."""

  def __init__(self, num_workers: int):
    self.num = num_workers
    self.time: list[float] = []
    self.kind: list[int] = []
    self.worker: list[int] = []
    self.num_batches: list[int] = []
    self.compute_end: list[float] = []
    self.mix_members: list[Any] = []
    self.mix_weights: list[Any] = []
    self.mix_lag: list[Any] = []
    self.mix_receives: list[Any] = []
    self.mix_kind: list[int] = []
    self.busy_worker: list[int] = []
    self.busy_start: list[float] = []
    self.busy_stop: list[float] = []
    self.extras: dict[str, Any] = {}

  def computing(self, m: int, start: float, stop: float) -> None:
    """Replica ``m`` computed (or communicated) during ``[start, stop)``."""
    self.busy_worker.append(m)
    self.busy_start.append(start)
    self.busy_stop.append(stop)

  def read(self, m: int, t: float, num_batches: int = 1) -> None:
    self._event(t, READ, m, num_batches, float("nan"))

  def grad(self, m: int, t: float, compute_end: float, num_batches: int = 1) -> None:
    self._event(t, GRAD, m, num_batches, compute_end)

  def mix(self, t: float, members: Any, weights: Any, *, lag: Any = None, receives: Any = None,
          mixes: int = PARAMS) -> None:
    # Kept as given (tuples or arrays); converted once, grouped by size, in build().
    self._event(t, MIX, -1, 0, float("nan"))
    self.mix_members.append(members)
    self.mix_weights.append(weights)
    self.mix_lag.append(lag)
    self.mix_receives.append(receives)
    self.mix_kind.append(mixes)

  def _event(self, t: float, kind: int, m: int, num_batches: int, compute_end: float) -> None:
    self.time.append(t)
    self.kind.append(kind)
    self.worker.append(m)
    self.num_batches.append(num_batches)
    self.compute_end.append(compute_end)

  def build(self, paradigm: str, end: float | None = None) -> GossipSchedule:
    """The schedule; ``busy`` is clipped to the last event and ``wait`` is the rest of ``[0, time[-1]]``."""
    num_mixes = len(self.mix_kind)
    sizes = np.fromiter((len(m) for m in self.mix_members), np.int64, num_mixes)
    width = int(sizes.max()) if num_mixes else 1
    members = np.full((num_mixes, width), -1, np.int64)
    weights = np.zeros((num_mixes, width, width))
    lag = np.zeros((num_mixes, width), np.int64)
    receives = np.zeros((num_mixes, width), bool)
    for size in np.unique(sizes).tolist():
      rows = np.flatnonzero(sizes == size)
      members[rows, :size] = np.array([self.mix_members[k] for k in rows], np.int64).reshape(-1, size)
      weights[rows, :size, :size] = np.array([self.mix_weights[k] for k in rows], np.float64).reshape(-1, size, size)
      lag[rows, :size] = np.array([np.zeros(size, np.int64) if self.mix_lag[k] is None else self.mix_lag[k]
                                   for k in rows], np.int64).reshape(-1, size)
      receives[rows, :size] = np.array([np.ones(size, bool) if self.mix_receives[k] is None else self.mix_receives[k]
                                        for k in rows], bool).reshape(-1, size)
    kind = np.asarray(self.kind, np.int8)
    mix = np.full(kind.shape, -1, np.int64)
    mix[kind == MIX] = np.arange(num_mixes)
    time = np.asarray(self.time, np.float64)
    total = float(time[-1]) if end is None else end
    bw = np.asarray(self.busy_worker, np.int64)
    bs = np.asarray(self.busy_start, np.float64)
    be = np.asarray(self.busy_stop, np.float64)
    busy = np.bincount(bw, np.clip(np.minimum(be, total) - bs, 0.0, None), self.num)
    return GossipSchedule(
        num_workers=self.num, time=time, kind=kind, worker=np.asarray(self.worker, np.int64),
        num_batches=np.asarray(self.num_batches, np.int64), mix=mix, members=members, weights=weights,
        lag=lag, receives=receives, mixes=np.asarray(self.mix_kind, np.int8), busy=busy,
        wait=np.maximum(total - busy, 0.0), paradigm=paradigm,
        extras={"compute_end": np.asarray(self.compute_end, np.float64), "busy_worker": bw, "busy_start": bs,
                "busy_stop": be, **self.extras})


# ---- paradigms ----------------------------------------------------------------------------------------------


class GossipParadigm:
  """Base class of the gossip paradigms (frozen dataclasses built by lower-case factories)."""

  def check(self, num_workers: int) -> None:
    """Raises a ``ValueError`` if the paradigm cannot run on ``num_workers`` replicas."""

  def events(self, workers: Workers, times: Any, total: int, seed_sequence: Any) -> Any:
    """The event loop of a paradigm defined outside this module (a plug-in, e.g. ``dj.cluster.lasgd``).

    ``times``: the workers' compute and comm draws (the stream every paradigm shares); ``total``: the
    gradients to apply; ``seed_sequence``: a ``numpy.random.SeedSequence`` of the seed's own, for any
    further randomness. Returns the filled event builder. The paradigms of this module are dispatched by
    ``simulate_gossip`` itself.
    """
    raise TypeError(f"paradigm {self!r} is not supported by simulate_gossip.")

  def __str__(self) -> str:
    parts = []
    for f in dataclasses.fields(self):  # type: ignore[arg-type]
      value = getattr(self, f.name)
      parts.append(f"{f.name}={value.name if isinstance(value, topo.Topology) else value}")
    return f"{self._name}({', '.join(parts)})"

  _name = "gossip"


@dataclasses.dataclass(frozen=True)
class AllReduce(GossipParadigm):
  """Synchronous data parallel (all-reduce SGD), the baseline of decentralized training.

  Rule: in round ``r`` every replica reads, computes its gradient ``g_i``
  (``compute + comm`` seconds of its worker); when the slowest is done, one
  ``GRADS`` mix replaces every pending gradient by the mean
  ``(1/M) sum_j g_j``, and every replica applies it. With identical initial
  models and optimizers all replicas stay equal: it is synchronous SGD on
  ``M`` times the batch.

  References:
    Goyal et al., `Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour
    <https://arxiv.org/abs/1706.02677>`_, 2017.
  """

  _name = "allreduce"


@dataclasses.dataclass(frozen=True)
class DPSGD(GossipParadigm):
  """Synchronous decentralized parallel SGD (D-PSGD): gossip with ``W``, then the gradient read before it.

  Rule (Lian et al. 2017, Algorithm 1), round ``r``:

  .. math::  x_i \\leftarrow \\sum_j W_{ij} x_j - \\gamma\\, g_i(x_i^{\\text{read}})

  Every replica reads at the round's start and computes (``compute + comm``
  seconds); when the slowest is done, one ``PARAMS`` mix of all replicas with
  ``W = mixing_matrix(topology, rule)``, then every replica applies its
  gradient (computed at its model before the mix: staleness 1 in local
  versions) through its optimizer.

  References:
    Lian, Zhang, Zhang, Hsieh, Zhang, Liu, `Can Decentralized Algorithms
    Outperform Centralized Algorithms? A Case Study for Decentralized Parallel
    Stochastic Gradient Descent <https://arxiv.org/abs/1705.09056>`_, NeurIPS 2017.
  """

  topology: topo.Topology
  rule: str = "metropolis"
  _name = "d_psgd"

  def check(self, num_workers: int) -> None:
    if self.topology.num_nodes != num_workers:
      raise ValueError(f"topology has {self.topology.num_nodes} nodes but the workers are {num_workers}; "
                       "they must match.")


def allreduce() -> AllReduce:
  """Synchronous all-reduce data parallel SGD (see :class:`AllReduce`)."""
  return AllReduce()


def d_psgd(topology: topo.Topology, rule: str = "metropolis") -> DPSGD:
  """Synchronous D-PSGD on ``topology`` with ``rule``'s mixing weights (see :class:`DPSGD`)."""
  if not isinstance(topology, topo.Topology):
    raise TypeError(f"topology must be a dj.topology.Topology (e.g. dj.topology.ring(8)), got {topology!r}.")
  check_choice("rule", rule, topo.MIXING_RULES)
  w = topo.mixing_matrix(topology, rule)
  topo.check_mixing(w, doubly=True, name=f"the {rule} weights of {topology.name}")
  return DPSGD(topology, rule)


@dataclasses.dataclass(frozen=True)
class ADPSGD(GossipParadigm):
  """Asynchronous decentralized parallel SGD (AD-PSGD): one atomic pairwise averaging per gradient, no waiting.

  Rule (Lian et al. 2018, Algorithm 1), each worker ``i`` in a loop, without
  waiting for anyone:

  1. ``READ``: snapshot ``x_i``; compute ``g = grad F_i(x_i^read)`` (``compute`` seconds);
  2. average atomically with one peer ``j``: ``x_i, x_j <- (x_i + x_j) / 2``
     (a ``PARAMS`` mix of two);
  3. ``GRAD``: ``x_i <- x_i - gamma g`` on the current (averaged) model, once
     both the gradient and the averaging are done (at ``max(read + compute,
     read + comm)``); then read again.

  ``average`` says where step 2 sits; the times of reads and applies are the
  same for both, only the averaging moves:

  - ``"completion"`` (default): the mix comes just before the ``GRAD`` that
    applies the gradient, at the same second. This is Algorithm 1 as the paper
    writes it: iteration ``k`` is ``X_{k+1/2} = X_k W_k`` (atomic) then
    ``x_{k+1}^{i_k} = x_{k+1/2}^{i_k} - gamma g(x_hat_k^{i_k})``, and the
    analysis takes ``X_{k+1} = X_k W_k - gamma G(X_hat_k)``: an averaging
    immediately followed by the update of the worker that initiated it, the
    gradient computed at a stale read ``X_hat_k = X_{k - tau_k}``. The paper's
    concurrency argument is that staleness: other workers' averagings and
    updates may change ``x_i`` while its gradient is computed (so the
    computation overlaps communication), not that a worker's own averaging may
    be separated from its update.
  - ``"read"``: the mix happens ``comm`` seconds after the read, while the
    gradient is still computing; other events may fall between it and the
    ``GRAD``. This is the implementation-style overlap (the reference code's
    gossip thread averages while the computation thread runs) and was the
    schedule's only point before ``average`` existed. Its consensus distance
    is lower: averaged over the run of ``experiments/gossip_adpsgd.py``
    (16 replicas, 5 seeds), 0.66-0.74x that of ``"completion"`` on a ring and
    0.79-0.89x with bipartite peers, the final losses equal to 3 digits.

  Peers: with ``topology=None`` the bipartite scheme of the reference code
  (``facebookresearch/stochastic_gradient_push``, ``gossip/ad_psgd.py`` with
  ``DynamicBipartiteExponentialGraph``): odd workers are active and initiate
  one averaging per gradient with the next even peer of their rotating list
  (``dj.topology.bipartite_peers``); even workers are passive (they compute
  and apply gradients, and are averaged with when contacted), so two
  initiators never wait on each other. With a ``topology``, every worker is
  active and picks a uniformly random neighbour per gradient, when it reads
  (the paper's Algorithm 1). Local momentum belongs to the optimizer that
  applies ``GRAD`` (the reference runs SGD with Nesterov momentum on its
  gossip copy).

  The reference code's gossip process averages continuously and pulls the
  model for the next gradient before its own last gradient is applied; this
  schedule follows the paper's loop (one averaging per gradient, the next
  read after the apply).

  References:
    Lian, Zhang, Zhang, Liu, `Asynchronous Decentralized Parallel Stochastic
    Gradient Descent <https://arxiv.org/abs/1710.06952>`_, ICML 2018.
  """

  topology: topo.Topology | None = None
  average: str = "completion"
  _name = "ad_psgd"

  def check(self, num_workers: int) -> None:
    if self.topology is None:
      if num_workers % 2 or num_workers < 2:
        raise ValueError(f"ad_psgd() with bipartite peers needs an even number of workers >= 2, got {num_workers}; "
                         "pass a topology for an odd count.")
    elif self.topology.num_nodes != num_workers:
      raise ValueError(f"topology has {self.topology.num_nodes} nodes but the workers are {num_workers}; "
                       "they must match.")


@dataclasses.dataclass(frozen=True)
class SGP(GossipParadigm):
  """Stochastic Gradient Push (SGP): push-sum over the directed one-peer exponential graph, with tau-overlap.

  Rule (Assran et al. 2019, Algorithm 1 with weights 1/2), node ``i`` at its iteration ``k``:

  .. math::

     x_i \\leftarrow x_i - \\gamma\\, \\nabla F_i(z_i),\\quad z_i = x_i / w_i;\\qquad
     (x_i, w_i) \\leftarrow \\tfrac12 (x_i, w_i)\\ \\text{and send } \\tfrac12 (x_i, w_i)
     \\text{ to } j = \\text{peer}_k(i);\\qquad
     (x_i, w_i) \\mathrel{+}= \\text{the messages received (see ``receive``)}.

  Events: ``READ`` (the method reads ``x_i`` and ``w_i``), ``GRAD`` after
  ``compute`` seconds, then a one-member ``PARAMS`` mix with weight 1/2 (the
  halving: the sent message is the value right after it), the message
  arrives ``comm`` seconds later. Before starting iteration ``k + 1`` a node
  adds the messages that ``receive`` names, each as a two-member mix
  ``x_i <- x_i + x_j^{(sent)}`` (weights ``[[1, 1], [0, 0]]``, only ``i``
  receives, ``lag`` = the sender's changes since it sent); it must have
  received the messages of iterations ``<= k - overlap`` (it waits for them):
  ``overlap = 0`` is synchronous SGP, ``overlap = tau`` lets messages be up to
  ``tau`` iterations late. ``receive`` does not change when a node starts an
  iteration, only which arrived messages it adds then:

  - ``"iteration"`` (default): the arrived messages sent at iterations
    ``<= k``; one sent at a later iteration (by a faster in-peer) waits until
    the node starts the iteration after it. With ``overlap = 0`` that is
    exactly the in-peer's iteration-``k`` message, as in the paper's
    Algorithm 1 (``x_i^{(k+1)}`` is made of the iteration-``k`` half-steps)
    and in the reference code (``gossip_sgd.py`` without ``--overlap``: a
    blocking receive from the round's in-peer before the next forward pass);
    with ``overlap > 0`` every message is added between 0 and ``overlap``
    iterations late, never before the iteration after it was sent.
  - ``"arrived"``: every message that has arrived, including one sent at a
    later iteration than the node's (added early, which neither the paper's
    Algorithm 1 nor the reference code does). Both conserve the push-sum
    mass; this was the schedule's only timing before ``receive`` existed.

  The method mixes the push-sum weight ``w`` with the same weights and lags
  as ``x``. Peers: ``dj.topology.one_peer_exponential``
  (``facebookresearch/stochastic_gradient_push``: ``DynamicDirectedExponentialGraph``,
  the graph of its SGP experiment scripts, or with ``forward_only``
  ``NPeerDynamicDirectedExponentialGraph``, the default of ``gossip_sgd.py``;
  one peer per iteration). The reference implements its overlap differently
  (a gossip thread, re-synchronized every ``synch_freq`` iterations); this
  schedule follows the paper's bound: a message sent at iteration ``k`` is
  added by iteration ``k + overlap + 1``.

  References:
    Assran, Loizou, Ballas, Rabbat, `Stochastic Gradient Push for Distributed
    Deep Learning <https://arxiv.org/abs/1811.10792>`_, ICML 2019.
  """

  overlap: int = 0
  forward_only: bool = False
  receive: str = "iteration"
  _name = "sgp"

  def check(self, num_workers: int) -> None:
    if num_workers < 2:
      raise ValueError(f"sgp needs at least 2 workers (each sends to a peer), got {num_workers}.")


@dataclasses.dataclass(frozen=True)
class GossipGraD(GossipParadigm):
  """GossipGraD: gradient gossip with one rotating partner per step (not parameter averaging).

  Rule (Daily et al. 2018; ``pytorch/torchdistx`` ``gossip_grad.py``,
  ``DISSEMINATION`` topology), step ``t``: every replica reads and computes
  ``g_r``; it sends ``g_r`` to the node ``2^(t mod p)`` positions ahead in the
  current node order and receives ``g_s`` from the one as far behind
  (``dj.topology.gossipgrad_partners``), sets ``g_r <- (g_r + g_s) / 2`` (a
  ``GRADS`` mix of all replicas) and applies it. Steps are synchronous: a step
  ends when the slowest replica's ``compute + comm`` is done.

  References:
    Daily, Vishnu, Siegel, Warfel, Amatya, `GossipGraD: Scalable Deep Learning
    using Gossip Communication based Asynchronous Gradient Descent
    <https://arxiv.org/abs/1803.05880>`_, 2018.
  """

  seed: int | None = None
  _name = "gossipgrad"

  def check(self, num_workers: int) -> None:
    if num_workers < 2:
      raise ValueError(f"gossipgrad needs at least 2 workers, got {num_workers}.")


@dataclasses.dataclass(frozen=True)
class ASAP(GossipParadigm):
  """ASAP: a stochastic reduce over a sparse graph, with NOTIFY-ACK synchronization on each link.

  **Only the paper's abstract could be read here** (arXiv 1612.08608; the full
  text was not reachable): it names the two primitives, a *stochastic reduce*
  (each worker reduces with a few others instead of all, with a convergence
  guarantee to the all-reduce's result) and *fine-grained NOTIFY-ACK worker
  synchronization* (independent workers run asynchronously), and claims 2-10x
  faster convergence than synchronous reduce. The event rules below are the
  library's construction of those two primitives: NOTIFY-ACK is read as a
  sender notifying its receivers that a new model is ready and sending its
  next one only once they have ACKed consuming the previous one; the reduce
  weights, the ACK latency and the receive side of a blocked worker are the
  library's choices.

  Rule, node ``i`` with out-neighbours ``N_out(i)`` (it sends to them) and
  in-neighbours ``N_in(i)`` in ``topology``, ``W = mixing_matrix(topology,
  rule)``, in a loop:

  1. ``READ`` ``x_i``, compute the gradient (``compute`` seconds), ``GRAD``:
     apply it to the current ``x_i`` through the replica's optimizer.
  2. *Stochastic reduce*: consume every notified, not yet consumed message
     ``x_j^{(sent)}`` (set ``R`` of senders) in one ``PARAMS`` mix

     .. math::

        x_i \\leftarrow \\Bigl(1 - \\sum_{j \\in R} W_{ij}\\Bigr) x_i
        + \\sum_{j \\in R} W_{ij}\\, x_j^{(\\text{sent})}

     (with every in-neighbour's message this is one row of ``W``; a missing
     message's weight stays on ``x_i``, as a lost message in
     :func:`failures`), ``lag`` = the sender's changes since it sent. Each
     consumed message is ACKed; the ACK reaches its sender ``comm`` seconds of
     the receiver later.
  3. *NOTIFY*: once every out-neighbour has ACKed ``i``'s previous message,
     send the current ``x_i`` to all of them (arriving ``comm`` seconds later)
     and go to 1. Until then ``i`` is blocked, and while blocked it consumes
     each message the moment it arrives (a one-sender reduce, ACKed as in 2):
     a blocked worker still serves its receive side, otherwise two neighbours
     waiting on each other's ACKs would never move.

  So a sender is at most one unconsumed message ahead of each receiver (no
  update is overwritten, reads are at most about one iteration of the sender
  old), a fast node waits only for its own out-neighbours, never for the whole
  cluster, and no barrier exists. ``sync="none"`` is the unsynchronized sparse
  averaging the paper sets against it: a node sends after every reduce without
  waiting, and a message overwrites its sender's previous one still unconsumed
  in the receiver's buffer (lost; counted per receiver in
  ``extras["overwritten"]``).

  References:
    Kadav, Kruus, `ASAP: Asynchronous Approximate Data-Parallel Computation
    <https://arxiv.org/abs/1612.08608>`_, arXiv 2016.
  """

  topology: topo.Topology
  rule: str = "uniform"
  sync: str = "notify_ack"
  _name = "asap"

  def check(self, num_workers: int) -> None:
    if self.topology.num_nodes != num_workers:
      raise ValueError(f"topology has {self.topology.num_nodes} nodes but the workers are {num_workers}; "
                       "they must match.")


_AVERAGING_POINTS = ("completion", "read")


def ad_psgd(topology: topo.Topology | None = None, average: str = "completion") -> ADPSGD:
  """AD-PSGD (see :class:`ADPSGD`): bipartite active/passive peers, or random neighbours of ``topology``;
  ``average`` is where each gradient's averaging lands: ``"completion"`` (just before the gradient is applied,
  the paper's Algorithm 1) or ``"read"`` (``comm`` seconds after the read, while the gradient computes)."""
  if topology is not None and not isinstance(topology, topo.Topology):
    raise TypeError(f"topology must be None or a dj.topology.Topology, got {topology!r}.")
  if topology is not None and topology.directed:
    raise ValueError(f"ad_psgd averages in pairs and needs an undirected topology, got {topology.name}.")
  return ADPSGD(topology, check_choice("average", average, _AVERAGING_POINTS))


_RECEIVE_TIMINGS = ("iteration", "arrived")


def sgp(overlap: int = 0, forward_only: bool = False, receive: str = "iteration") -> SGP:
  """Stochastic Gradient Push with ``overlap``-iteration late messages (see :class:`SGP`); ``forward_only``
  picks the peers ``i + 2^k`` instead of ``i +- 2^k`` (``dj.topology.one_peer_exponential``); ``receive`` is
  which arrived messages a node adds before its iteration ``k + 1``: ``"iteration"`` those sent at iterations
  ``<= k`` (the paper's and the reference code's), ``"arrived"`` all of them."""
  if not isinstance(forward_only, bool):
    raise TypeError(f"forward_only must be a bool, got {forward_only!r}.")
  return SGP(check_int("overlap", overlap, minimum=0), forward_only, check_choice("receive", receive,
                                                                                   _RECEIVE_TIMINGS))


def gossipgrad(seed: int | None = None) -> GossipGraD:
  """GossipGraD (see :class:`GossipGraD`); ``seed=None`` uses the reference's node shuffles."""
  return GossipGraD(None if seed is None else check_seed("seed", seed))


_ASAP_SYNCS = ("notify_ack", "none")


def asap(topology: topo.Topology, rule: str = "uniform", sync: str = "notify_ack") -> ASAP:
  """ASAP's stochastic reduce over ``topology`` with ``rule``'s weights (see :class:`ASAP`); ``sync`` is
  ``"notify_ack"`` (a node sends its next model once its receivers have consumed the previous one) or ``"none"``
  (it sends after every gradient; an unconsumed message is overwritten)."""
  if not isinstance(topology, topo.Topology):
    raise TypeError(f"topology must be a dj.topology.Topology (e.g. dj.topology.random_regular(16, 3)), "
                    f"got {topology!r}.")
  check_choice("rule", rule, topo.MIXING_RULES)
  check_choice("sync", sync, _ASAP_SYNCS)
  if topology.num_nodes < 2:
    raise ValueError(f"asap needs a topology of at least 2 nodes, got {topology.num_nodes}.")
  w = topo.mixing_matrix(topology, rule)
  topo.check_mixing(w, doubly=True, name=f"the {rule} weights of {topology.name}")
  return ASAP(topology, rule, sync)


@dataclasses.dataclass(frozen=True)
class NodeDown:
  """Node ``node`` is gone during ``[start, stop)`` simulated seconds: it neither computes nor communicates."""

  node: int
  start: float
  stop: float


@dataclasses.dataclass(frozen=True)
class Failures:
  """Link and node failures: each message is lost with probability ``drop``; nodes are down in windows.

  Attributes:
    drop: probability that one message (one direction of one exchange) is lost.
    down: the windows in which nodes are gone.
    on_failure: what a receiver does with a failed link's term: ``"drop"`` (leave it out, its weight moved to
      the receiver's own model) or ``"reuse"`` (use the last message that did arrive from that neighbour, the
      weights those of the full topology); see :func:`failures`.
  """

  drop: float = 0.0
  down: tuple[NodeDown, ...] = ()
  on_failure: str = "drop"

  def is_down(self, node: int, t: float) -> bool:
    return any(d.node == node and d.start <= t < d.stop for d in self.down)

  def back_at(self, node: int, t: float) -> float:
    """The first second ``>= t`` at which ``node`` is up."""
    moved = True
    while moved:
      moved = False
      for d in self.down:
        if d.node == node and d.start <= t < d.stop:
          t, moved = d.stop, True
    return t


def node_down(node: int, start: float, stop: float) -> NodeDown:
  """Node ``node`` disappears during ``[start, stop)`` seconds."""
  node = check_int("node", node, minimum=0)
  start = check_float("start", start, minimum=0.0)
  stop = check_float("stop", stop, minimum=0.0)
  if stop < start:
    raise ValueError(f"stop must be >= start, got start={start}, stop={stop}.")
  return NodeDown(node, start, stop)


def failures(drop: float = 0.0, down: NodeDown | Sequence[NodeDown] = (), on_failure: str = "drop") -> Failures:
  r"""Message loss with probability ``drop`` and node outages ``down`` (``node_down(...)`` windows).

  Supported by ``d_psgd`` (a node down at a round's start sits the round out:
  it neither computes nor sends nor receives) and ``ad_psgd`` (each direction
  of an averaging is lost independently; a node down skips averagings, and
  its reads and applies wait until it is back). This is the setting of
  asynchronous decentralized SGD at the wireless edge, where links drop
  packets and devices come and go. ``on_failure`` says what a receiver does
  with the term of a neighbour whose message did not arrive (lost, or the
  neighbour down):

  - ``"drop"`` (default): leave it out. In ``d_psgd`` a lost message
    ``j -> i`` moves ``W[i, j]`` to ``W[i, i]`` and a node down has its
    weights moved to the others' diagonals; in ``ad_psgd`` a member whose
    incoming message is lost keeps its model (no mix when both are lost).
  - ``"reuse"``: use the last message that did arrive from that neighbour,
    with the weights of the full topology. Receiver ``i`` of a ``d_psgd``
    round, with ``s_{ij}`` the round in which ``j``'s message last reached
    ``i``,

    .. math::  x_i \leftarrow W_{ii}\, x_i + \sum_{j \ne i} W_{ij}\,
       x_j^{(s_{ij})} - \gamma\, g_i

    where ``x_j^{(s)}`` is the model ``j`` sent in round ``s``; ``s_{ij}`` is
    the current round when the message arrives. In ``ad_psgd`` a lost
    direction of the averaging ``i <-> j`` becomes ``x_i \leftarrow (x_i +
    x_j^{(s_{ij})}) / 2`` with ``j``'s last message to arrive at ``i``, and an
    averaging with a peer that is down averages with that stored copy (the
    peer does not receive); a node that is down itself does nothing. Before
    any message from ``j`` has arrived, the common initial model
    (``j``'s version 0) stands in for it. In the schedule, a stored message
    is a late message (``lag`` = the sender's changes since it sent); since a
    mix's ``lag`` is one per sender, a round whose receivers need different
    versions of one sender is split into several ``PARAMS`` mixes at the same
    second, of at most 8 members each (their lags counting the changes of
    the mixes before), which together equal the rule above.

  For a given ``seed``, ``"drop"`` and ``"reuse"`` see the same losses,
  outages, peers and times: only what the failed terms mix differs.

  References:
    Jeong, Zecchin, Kountouris, `Asynchronous Decentralized Learning over
    Unreliable Wireless Networks <https://arxiv.org/abs/2202.00955>`_, IEEE
    ICC 2022 (the ``"reuse"`` rule). **Only the paper's abstract could be
    read here**: it proposes asynchronous decentralized SGD robust to
    computation and communication failures at the wireless edge and reports
    the benefit of "outdated gradient information reuse". That a receiver
    reuses the neighbour's last received *model* with unchanged weights, the
    per-link independent loss, the stand-in before a first arrival and the
    handling of nodes that are down are the library's construction, checked
    against a NumPy simulation of this docstring
    (``tests/gossip/test_unreliable_links.py``).
  """
  drop = check_float("drop", drop, minimum=0.0, maximum=1.0)
  check_choice("on_failure", on_failure, _ON_FAILURE)
  if isinstance(down, NodeDown):
    down = (down,)
  down = tuple(down)
  for d in down:
    if not isinstance(d, NodeDown):
      raise TypeError(f"down must hold node_down(...) windows, got {d!r}.")
  return Failures(drop, down, on_failure)


_ON_FAILURE = ("drop", "reuse")
# The largest mix of a reuse round split into several (dj.simulate_gossip runs late messages in mixes of at most 8).
_REUSE_GROUP = 8


def _mix_reusing(b: _Builder, t: float, weights: np.ndarray, receivers: Sequence[int], sent: dict[int, dict[int, int]],
                 version: list[int]) -> None:
  """``PARAMS`` mixes at ``t`` in which receiver ``i`` gets ``sum_j weights[i, j] x_j^(sent[i][j])`` (absolute
  versions; ``sent[i][i]`` is ``i``'s current one), all from the values before the first of them.

  One mix carries one version per member, so receivers are grouped greedily (in order) into mixes whose receivers
  agree on the version of every member they share, of at most :data:`_REUSE_GROUP` members (the replica
  runtime's limit for mixes with late messages); a member replaced by an earlier group is reached through one
  more version of lag. ``version`` (current versions) is updated for the receivers.
  """
  groups: list[tuple[dict[int, int], list[int]]] = []
  for i in receivers:
    need = sent[i]
    for want, rows in groups:
      fits = len(want.keys() | need.keys()) <= _REUSE_GROUP
      if fits and all(want.get(j, v) == v for j, v in need.items()):
        want.update(need)
        rows.append(i)
        break
    else:
      groups.append((dict(need), [i]))
  replaced: set[int] = set()
  for want, rows in groups:
    members = sorted(want)
    lag = [version[j] + (j in replaced) - want[j] for j in members]
    w = np.zeros((len(members), len(members)))
    for a, i in enumerate(members):
      if i in rows:
        w[a] = weights[i, members]
    b.mix(t, members, w, lag=lag, receives=[i in rows for i in members])
    replaced.update(rows)
  for i in receivers:
    version[i] += 1


# ---- the simulator ------------------------------------------------------------------------------------------


class _Durations(_Times):
  """Per-gradient compute and comm seconds, from the same per-worker streams as ``dj.cluster.simulate``."""

  def take_split(self, m: int, t: float) -> tuple[float, float]:
    """``(compute, comm)`` of worker ``m``'s next gradient, read at ``t`` (straggler windows on compute)."""
    j = self.used[m]
    self.used[m] = j + 1
    if j >= self.filled[m]:
      compute, comm = self._draw(m)
      self.compute[m].extend(compute.tolist())
      self.comm[m].extend(comm.tolist())
    factor = 1.0
    for w in self.windows:
      if w.start <= t < w.stop and (w.workers is None or m in w.workers):
        factor *= w.slowdown
    return self.compute[m][j] * factor, self.comm[m][j]


def _round_engine(paradigm: GossipParadigm, workers: Workers, times: _Times, num_rounds: int,
                  fail: Failures, rng: np.random.Generator) -> _Builder:
  """Synchronous rounds: every replica reads at the round's start; the round ends when the slowest is done."""
  num = workers.num_workers
  b = _Builder(num)
  compute, comm = times.rows(0, num_rounds)
  if isinstance(paradigm, DPSGD):
    w_params = topo.mixing_matrix(paradigm.topology, paradigm.rule)
  if isinstance(paradigm, GossipGraD):
    partners = topo.gossipgrad_partners(num, num_rounds, paradigm.seed) if num > 1 else None
  # Under on_failure="reuse": each replica's version, and the version of j's last message to arrive at i.
  version = [0] * num
  last: dict[tuple[int, int], int] = {}
  t = 0.0
  for r in range(num_rounds):
    up = np.array([not fail.is_down(m, t) for m in range(num)])
    if not up.any():
      t = min(fail.back_at(m, t) for m in range(num))
      continue
    duration = compute[r] * _window_factors(workers, t) + comm[r] if workers.windows else compute[r] + comm[r]
    live = np.flatnonzero(up)
    end = t + float(duration[live].max())
    for m in live:
      b.read(int(m), t)
      b.computing(int(m), t, t + float(duration[m]))
    if isinstance(paradigm, AllReduce):
      b.mix(end, live, np.full((live.size, live.size), 1.0 / live.size), mixes=GRADS)
    elif isinstance(paradigm, GossipGraD):
      source = np.empty(num, np.int64)
      source[partners[r]] = np.arange(num)
      w = 0.5 * np.eye(num)
      w[np.arange(num), source] += 0.5
      b.mix(end, live, w[np.ix_(live, live)], mixes=GRADS)
    elif fail.on_failure == "reuse":
      # The draw of "drop" (same shape, same stream), so that both rules see the same losses.
      arrived = np.zeros((num, num), bool)
      arrived[np.ix_(live, live)] = rng.random((live.size, live.size)) >= fail.drop if fail.drop > 0 else True
      sent = {}
      for i in live.tolist():
        sent[i] = {j: version[j] if arrived[i, j] else last.get((i, j), 0)
                   for j in np.flatnonzero(w_params[i]).tolist()}
        sent[i][i] = version[i]
      for i, j in zip(*np.nonzero(arrived & (w_params > 0))):
        last[int(i), int(j)] = version[j]
      _mix_reusing(b, end, w_params, live.tolist(), sent, version)
    else:
      w = w_params[np.ix_(live, live)].copy()
      if fail.drop > 0:
        lost = (rng.random(w.shape) < fail.drop) & ~np.eye(live.size, dtype=bool) & (w > 0)
        w[lost] = 0.0
      np.fill_diagonal(w, 0.0)
      np.fill_diagonal(w, 1.0 - w.sum(axis=1))
      b.mix(end, live, w)
    for m in live:
      b.grad(int(m), end, t + float(duration[m]))
      version[m] += 1
    t = end
  return b


def _pick_peer(paradigm: ADPSGD, m: int, count: int, peers: list[list[int]], neighbors: list[np.ndarray],
               rng: np.random.Generator) -> int:
  if paradigm.topology is None:
    return peers[m][count % len(peers[m])] if m % 2 else -1
  options = neighbors[m]
  return int(options[rng.integers(options.shape[0])])


def _ad_psgd_engine(paradigm: ADPSGD, workers: Workers, times: _Durations, total: int,
                    fail: Failures, rng: np.random.Generator) -> _Builder:
  """AD-PSGD as an event loop over (time, order) keys: reads, pairwise averagings, applies."""
  num = workers.num_workers
  b = _Builder(num)
  # Each active node's rotating list of passive peers (dj.topology.bipartite_peers, one period).
  peers = [topo._bipartite_peer_list(num, m) if m % 2 else [] for m in range(num)]
  neighbors = [] if paradigm.topology is None else [paradigm.topology.neighbors(m) for m in range(num)]
  at_completion = paradigm.average == "completion"
  heap: list[tuple[float, int, str, int, int]] = []
  seq = 0
  count = [0] * num
  compute_end = [0.0] * num
  # Under on_failure="reuse": each replica's version, the version of j's last message to arrive at i, and the
  # pairwise weights (every pair averages with 1/2, whatever arrived).
  reuse = fail.on_failure == "reuse"
  version = [0] * num
  last: dict[tuple[int, int], int] = {}
  half = np.full((num, num), 0.5)

  def start(m: int, t: float) -> None:
    nonlocal seq
    t = fail.back_at(m, t)
    b.read(m, t)
    c, l = times.take_split(m, t)
    done = fail.back_at(m, t + c)
    compute_end[m] = t + c
    b.computing(m, t, t + c)
    # The peer is drawn at the read for both averaging points: without failures (whose draws come at the
    # averaging) they pick the same peers and differ only in where the averaging lands.
    peer = _pick_peer(paradigm, m, count[m], peers, neighbors, rng)
    count[m] += 1
    apply_at = done
    if peer >= 0:
      apply_at = max(done, t + l)
      # At completion the averaging is the heap entry just before the apply's (same time, next sequence number),
      # so nothing falls between them.
      heapq.heappush(heap, (apply_at if at_completion else t + l, seq, "mix", m, peer))
      seq += 1
    heapq.heappush(heap, (apply_at, seq, "grad", m, -1))
    seq += 1

  def average(t: float, m: int, peer: int) -> None:
    if fail.is_down(m, t) or fail.is_down(peer, t):
      if reuse and not fail.is_down(m, t):
        # The peer is gone: m averages with its stored copy of the peer's model.
        _mix_reusing(b, t, half, [m], {m: {m: version[m], peer: last.get((m, peer), 0)}}, version)
      return
    if fail.drop > 0:
      draw = rng.random(2)
      to_m, to_peer = bool(draw[0] >= fail.drop), bool(draw[1] >= fail.drop)
    else:
      to_m = to_peer = True
    if reuse:
      sent = {m: {m: version[m], peer: version[peer] if to_m else last.get((m, peer), 0)},
              peer: {peer: version[peer], m: version[m] if to_peer else last.get((peer, m), 0)}}
      if to_m:
        last[m, peer] = version[peer]
      if to_peer:
        last[peer, m] = version[m]
      _mix_reusing(b, t, half, [m, peer], sent, version)
    elif to_m or to_peer:
      b.mix(t, (m, peer), ((0.5, 0.5) if to_m else (0.0, 0.0), (0.5, 0.5) if to_peer else (0.0, 0.0)),
            receives=(to_m, to_peer))

  for m in range(num):
    start(m, 0.0)
  applied = 0
  while applied < total:
    t, _, what, m, peer = heapq.heappop(heap)
    if what == "mix":
      average(t, m, peer)
    else:
      b.grad(m, t, compute_end[m])
      version[m] += 1
      applied += 1
      if applied < total:
        start(m, t)
  return b


class _NodeLoop:
  """The event heap of the node-by-node engines (SGP, ASAP): events in (time, insertion) order, and a node's
  gradient started as both time it (read, compute for its worker's draw, a ``"done"`` event at the end)."""

  def __init__(self, b: _Builder, times: _Durations, num: int):
    self.b, self.times = b, times
    self.heap: list[tuple[float, int, str, int, int]] = []
    self.seq = 0
    self.comm = [0.0] * num          # the latency of the messages each node's current iteration sends
    self.compute_end = [0.0] * num

  def push(self, t: float, what: str, m: int, data: int) -> None:
    heapq.heappush(self.heap, (t, self.seq, what, m, data))
    self.seq += 1

  def pop(self) -> tuple[float, str, int, int]:
    t, _, what, m, data = heapq.heappop(self.heap)
    return t, what, m, data

  def start(self, m: int, t: float) -> None:
    self.b.read(m, t)
    c, self.comm[m] = self.times.take_split(m, t)
    self.compute_end[m] = t + c
    self.b.computing(m, t, t + c)
    self.push(t + c, "done", m, 0)


def _sgp_engine(paradigm: SGP, workers: Workers, times: _Durations, total: int) -> _Builder:
  """SGP as an event loop: compute, apply, halve and send; add arrived messages; wait for late ones."""
  num = workers.num_workers
  b = _Builder(num)
  offsets = topo.one_peer_exponential(num, 2 * num, paradigm.forward_only)[:, 0]   # every node's offsets
  period = len(dict.fromkeys(offsets.tolist()))
  loop = _NodeLoop(b, times, num)
  push, start, comm, compute_end = loop.push, loop.start, loop.comm, loop.compute_end
  version = [0] * num
  iteration = [0] * num            # the iteration each node is in (or about to start)
  sent_version: dict[tuple[int, int], int] = {}
  inbox: list[list[tuple[float, int, int]]] = [[] for _ in range(num)]   # (arrival, iteration, sender)
  got = [set() for _ in range(num)]   # iterations whose message has arrived
  complete = [-1] * num               # every message of iterations <= complete[m] has arrived at m
  waiting = [False] * num

  def try_start(m: int, t: float) -> None:
    # Iteration k may start once the messages of iterations <= k - 1 - overlap have arrived.
    while complete[m] + 1 in got[m]:
      got[m].discard(complete[m] + 1)
      complete[m] += 1
    if complete[m] < iteration[m] - 1 - paradigm.overlap:
      waiting[m] = True
      return
    waiting[m] = False
    # Under "iteration" a message sent at a later iteration than the one m has finished stays in the inbox.
    last = iteration[m] - 1 if paradigm.receive == "iteration" else None
    held = []
    for message in sorted(inbox[m]):
      _, k, sender = message
      if last is not None and k > last:
        held.append(message)
        continue
      b.mix(t, (m, sender), ((1.0, 1.0), (0.0, 0.0)), receives=(True, False),
            lag=(0, version[sender] - sent_version.pop((sender, k))))
      version[m] += 1
    inbox[m] = held
    start(m, t)

  for m in range(num):
    start(m, 0.0)
  applied = 0
  while applied < total:
    t, what, m, data = loop.pop()
    if what == "done":
      b.grad(m, t, compute_end[m])
      version[m] += 1
      applied += 1
      if applied == total:
        break
      k = iteration[m]
      b.mix(t, (m,), ((0.5,),))
      version[m] += 1
      sent_version[(m, k)] = version[m]
      peer = (m + int(offsets[k % period])) % num
      push(t + comm[m], "arrive", peer, k * num + m)
      iteration[m] = k + 1
      try_start(m, t)
    else:
      k, sender = divmod(data, num)
      inbox[m].append((t, k, sender))
      got[m].add(k)
      if waiting[m]:
        try_start(m, t)
  return b


def _asap_engine(paradigm: ASAP, workers: Workers, times: _Durations, total: int) -> _Builder:
  """ASAP as an event loop: compute, apply, reduce the notified messages, send once the receivers have ACKed."""
  num = workers.num_workers
  b = _Builder(num)
  w = topo.mixing_matrix(paradigm.topology, paradigm.rule)
  receivers = [paradigm.topology.neighbors(m).tolist() for m in range(num)]
  notify_ack = paradigm.sync == "notify_ack"
  loop = _NodeLoop(b, times, num)
  push, start, comm, compute_end = loop.push, loop.start, loop.comm, loop.compute_end
  version = [0] * num
  buffer: list[dict[int, int]] = [{} for _ in range(num)]   # sender -> its version when it sent
  unacked = [0] * num          # out-neighbours that have not yet ACKed the node's last message
  blocked = [False] * num
  overwritten = np.zeros(num, np.int64)

  def reduce(m: int, t: float) -> None:
    if not buffer[m]:
      return
    senders = sorted(buffer[m])
    size = len(senders) + 1
    weights = np.zeros((size, size))
    weights[0, 1:] = w[m, senders]
    weights[0, 0] = 1.0 - weights[0, 1:].sum()
    lag = [0] + [version[s] - buffer[m][s] for s in senders]
    b.mix(t, [m] + senders, weights, lag=lag, receives=[True] + [False] * len(senders))
    version[m] += 1
    buffer[m].clear()
    if notify_ack:
      for s in senders:
        push(t + comm[m], "ack", s, m)

  def send(m: int, t: float) -> None:
    for r in receivers[m]:
      push(t + comm[m], "arrive", r, m * (total + 1) + version[m])
    unacked[m] = len(receivers[m]) if notify_ack else 0
    start(m, t)

  for m in range(num):
    start(m, 0.0)
  applied = 0
  while applied < total:
    t, what, m, data = loop.pop()
    if what == "done":
      b.grad(m, t, compute_end[m])
      version[m] += 1
      applied += 1
      if applied == total:
        break
      reduce(m, t)
      if unacked[m]:
        blocked[m] = True
      else:
        send(m, t)
    elif what == "arrive":
      sender, sent = divmod(data, total + 1)
      if sender in buffer[m]:
        overwritten[m] += 1   # only without NOTIFY-ACK: a sender never has two unconsumed messages with it
      buffer[m][sender] = sent
      if blocked[m]:
        reduce(m, t)
    else:
      unacked[m] -= 1
      if blocked[m] and not unacked[m]:
        blocked[m] = False
        send(m, t)
  b.extras["overwritten"] = overwritten
  return b


def simulate_gossip(paradigm: GossipParadigm, workers: Workers, num_steps: int, seed: int = 0,
                    failures: Failures | None = None) -> GossipSchedule:
  """Simulates decentralized training of ``paradigm`` on ``workers`` and returns its :class:`GossipSchedule`.

  Gradient ``j`` of replica ``m`` takes the time ``dj.cluster.simulate`` would
  give gradient ``j`` of worker ``m`` (same ``workers``, same ``seed``): the same
  per-worker streams, speeds and stragglers; a gradient's ``comm`` draw is the
  latency of the messages its worker sends in that step.

  Args:
    paradigm: ``allreduce()``, ``d_psgd(topology)``, ``ad_psgd(...)``,
      ``sgp(overlap)``, ``gossipgrad()``, ``asap(topology)`` or ``lasgd()``.
    workers: the cluster, from ``dj.cluster.workers(...)``; one replica per worker.
    num_steps: gradients per replica on average: the run ends when
      ``num_steps * M`` gradients have been applied (``num_steps`` rounds for
      the synchronous ``allreduce``, ``d_psgd`` and ``gossipgrad``, fewer
      gradients where failed nodes sit rounds out). One whose record cannot
      fit in the available memory is refused before anything is simulated.
    seed: the same seed gives a bit-identical schedule.
    failures: optional ``failures(drop, down, on_failure)``, for ``d_psgd`` and ``ad_psgd``.

  Returns:
    The schedule.

  Example::

    >>> import delayjax as dj
    >>> w = dj.cluster.workers(4, compute="exponential")
    >>> s = dj.cluster.simulate_gossip(dj.cluster.d_psgd(dj.topology.ring(4)), w, num_steps=10, seed=0)
    >>> s.num_gradients, s.num_mixes
    (40, 10)
  """
  if not isinstance(paradigm, GossipParadigm):
    raise TypeError(f"paradigm must be a gossip paradigm such as dj.cluster.d_psgd(dj.topology.ring(8)), "
                    f"got {paradigm!r}.")
  if not isinstance(workers, Workers):
    raise TypeError(f"workers must be built with dj.cluster.workers(...), got {workers!r}.")
  check_seed("seed", seed)
  num_steps = check_int("num_steps", num_steps, minimum=1)
  paradigm.check(workers.num_workers)
  # At least a READ and a GRAD event per gradient (41 bytes each: time, kind, worker, num_batches, mix,
  # compute_end) and its busy interval (24 bytes); mixes come on top. Refused before simulating anything.
  check_fits(f"num_steps={num_steps} on {workers.num_workers} replicas: its schedule, at least 106 bytes per "
             "gradient,", 106 * num_steps * workers.num_workers, available_memory())
  if failures is None:
    failures = Failures()
  elif not isinstance(failures, Failures):
    raise TypeError(f"failures must be dj.cluster.failures(...) or None, got {failures!r}.")
  elif not isinstance(paradigm, (DPSGD, ADPSGD)) and (failures.drop > 0 or failures.down):
    raise ValueError(f"failures are supported by d_psgd and ad_psgd, not by {paradigm}.")
  for d in failures.down:
    if d.node >= workers.num_workers:
      raise ValueError(f"node_down node must be in 0..{workers.num_workers - 1}, got {d.node}.")
  time_seq, gossip_seq = _seed_sequences(seed, workers)
  times = _Durations(workers, time_seq)
  rng = np.random.default_rng(gossip_seq)
  total = num_steps * workers.num_workers
  if isinstance(paradigm, (AllReduce, DPSGD, GossipGraD)):
    builder = _round_engine(paradigm, workers, times, num_steps, failures, rng)
  elif isinstance(paradigm, ADPSGD):
    builder = _ad_psgd_engine(paradigm, workers, times, total, failures, rng)
  elif isinstance(paradigm, SGP):
    builder = _sgp_engine(paradigm, workers, times, total)
  elif isinstance(paradigm, ASAP):
    builder = _asap_engine(paradigm, workers, times, total)
  else:
    builder = paradigm.events(workers, times, total, gossip_seq)
  return builder.build(str(paradigm))
