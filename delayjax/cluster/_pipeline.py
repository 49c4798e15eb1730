"""Pipeline schedules: K stages, micro-batches, and which weight version each forward and backward pass uses.

A model is split depth-wise into ``K`` stages, one per device. Mini-batch
``u`` (update ``u``) is cut into ``m`` micro-batches ``n = u m .. u m + m - 1``;
stage ``k`` runs the forward pass ``F(n, k)`` and the backward pass ``B(n, k)``
of every micro-batch and applies its update ``u`` (the mean of its ``m``
micro-batch gradients) right after the backward pass of the last micro-batch
of mini-batch ``u``. Stage ``k``'s *version* ``v`` is its weights after ``v``
of its own updates.

A schedule fixes the order of each stage's operations; the simulation runs
them as early as their data allow: ``F(n, k)`` needs ``F(n, k - 1)`` (plus the
activation's communication time), ``B(n, k)`` needs ``F(n, k)`` and
``B(n, k + 1)``, and a stage runs one operation at a time. Operation times
come from per-stage time models (the cluster simulator's, see
``dj.cluster.constant`` and friends), drawn from one generator per stage.

Schedules:

- ``"gpipe"`` (Huang et al. 2019): each stage runs the forward passes of all
  ``m`` micro-batches of a mini-batch, then their backward passes, then its
  update; the next mini-batch enters once stage 0 has updated (a flush).
  Every pass of mini-batch ``u`` uses version ``u``: no staleness; with equal
  stage times the bubble is :math:`(K - 1) / (m + K - 1)`.
- ``"dapple"`` (Fan et al. 2021): the same flush and versions, but each
  stage starts its backward passes early (one forward, one backward after
  ``K - 1 - k`` warm-up forwards), so it holds at most ``K - k`` micro-batches'
  activations instead of ``m``; same bubble as GPipe with equal stage times.
- ``"1f1b"`` (PipeDream, Narayanan et al. 2019): the same one-forward-one-
  backward order without flushes: micro-batches enter continuously and each
  stage updates as soon as its share of a mini-batch is done. With ``m = 1``
  and a steady pipeline, stage ``k``'s forward pass is ``K - 1 - k`` versions
  stale. Which version the backward pass uses is ``weights``:

  - ``"stash"`` (PipeDream's weight stashing): the forward pass's version,
    kept until the backward pass (one stashed copy per micro-batch in
    flight);
  - ``"latest"`` (no stashing: PipeMare; decoupled learning such as ADL and
    Diversely Stale Parameters, which recompute the stage's forward pass at
    the current weights): the stage's current version, newer than the
    forward pass's;
  - ``"vertical_sync"`` (PipeDream's vertical sync): every stage uses, in
    both passes, the version stage 0 used for that micro-batch, so the whole
    micro-batch sees one consistent model (each stage keeps older versions).

  ADL's accumulation (Zhuang et al. 2021) is ``"1f1b"`` with ``weights="latest"``
  and ``m`` micro-batches accumulated per update: the delay counted in
  updates shrinks about ``m`` times.

The result records, per micro-batch and stage, the start and end time of both
passes and their versions, and per update and stage when it was applied;
from these follow the staleness (update index minus version), the bubble
fraction, and the weight versions and activations each stage must keep.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from delayjax._checks import check_choice, check_int, check_seed
from delayjax.cluster._distributions import TimeModel, as_time_model
from delayjax._memory import available_memory, check_fits

__all__ = ["PipelineSchedule", "pipeline", "PIPELINE_SCHEDULES", "PIPELINE_WEIGHTS"]

PIPELINE_SCHEDULES = ("gpipe", "dapple", "1f1b")
PIPELINE_WEIGHTS = ("stash", "latest", "vertical_sync")
_F, _B, _U = 0, 1, 2


@dataclasses.dataclass(frozen=True, eq=False)
class PipelineSchedule:
  """A simulated pipeline run: the time and the weight version of every forward and backward pass.

  Attributes (``N = num_updates * num_microbatches`` micro-batches, ``K`` stages):
    schedule: ``"gpipe"``, ``"dapple"`` or ``"1f1b"``.
    weights: the backward pass's version rule (``"stash"``, ``"latest"``,
      ``"vertical_sync"``); synchronous schedules report ``"stash"``.
    num_stages: ``K``.
    num_microbatches: ``m``, micro-batches per mini-batch (per update).
    num_updates: ``U``, updates every stage applies.
    forward_version: int64 ``[N, K]``, the version of stage ``k``'s weights
      the forward pass of micro-batch ``n`` used.
    backward_version: int64 ``[N, K]``, likewise for its backward pass.
    forward_start, forward_end, backward_start, backward_end: float64
      ``[N, K]``, simulated seconds.
    update_time: float64 ``[U, K]``, when stage ``k`` applied update ``u``
      (producing version ``u + 1``).
  """

  schedule: str
  weights: str
  num_stages: int
  num_microbatches: int
  num_updates: int
  forward_version: np.ndarray
  backward_version: np.ndarray
  forward_start: np.ndarray
  forward_end: np.ndarray
  backward_start: np.ndarray
  backward_end: np.ndarray
  update_time: np.ndarray

  @property
  def num_passes(self) -> int:
    """``N``: micro-batches that flow through the pipeline."""
    return self.num_updates * self.num_microbatches

  @property
  def update_of(self) -> np.ndarray:
    """int64 ``[N]``: the update each micro-batch's gradient belongs to (``n // m``)."""
    return np.arange(self.num_passes) // self.num_microbatches

  @property
  def forward_staleness(self) -> np.ndarray:
    """int64 ``[N, K]``: update index minus the forward pass's version (0: synchronous)."""
    return self.update_of[:, None] - self.forward_version

  @property
  def backward_staleness(self) -> np.ndarray:
    """int64 ``[N, K]``: update index minus the backward pass's version."""
    return self.update_of[:, None] - self.backward_version

  @property
  def total_time(self) -> float:
    """Simulated seconds until the last update of the last stage."""
    return float(self.update_time.max())

  def busy_time(self) -> np.ndarray:
    """float64 ``[K]``: seconds each stage spent computing."""
    return ((self.forward_end - self.forward_start) + (self.backward_end - self.backward_start)).sum(axis=0)

  def bubble_fraction(self) -> float:
    """The fraction of stage-seconds spent idle: :math:`1 - \\sum_k \\mathrm{busy}_k / (K T)`."""
    return float(1.0 - self.busy_time().sum() / (self.num_stages * self.total_time))

  def versions_kept(self) -> np.ndarray:
    """int64 ``[K]``: the most weight versions each stage holds at once (the weights' memory, in copies).

    Version ``v`` of stage ``k`` lives from the update that made it (time 0
    for ``v = 0``) until the later of the update that replaces it and the
    end of the last pass that uses it.
    """
    out = np.zeros(self.num_stages, np.int64)
    for k in range(self.num_stages):
      born = np.r_[0.0, self.update_time[:, k]]  # version v is made by update v - 1
      dies = np.r_[self.update_time[:, k], self.total_time]
      for version, end in ((self.forward_version[:, k], self.forward_end[:, k]),
                           (self.backward_version[:, k], self.backward_end[:, k])):
        np.maximum.at(dies, version, end)
      out[k] = _max_overlap(born, dies)
    return out

  def activations_kept(self) -> np.ndarray:
    """int64 ``[K]``: the most micro-batches whose activations a stage holds at once (forward done, backward not)."""
    return np.array([_max_overlap(self.forward_start[:, k], self.backward_end[:, k])
                     for k in range(self.num_stages)], np.int64)

  def summary(self) -> dict[str, Any]:
    """Headline numbers: time, bubble fraction, mean staleness per stage, versions and activations kept."""
    return {
        "schedule": self.schedule if self.schedule != "1f1b" else f"1f1b/{self.weights}",
        "num_stages": self.num_stages,
        "num_microbatches": self.num_microbatches,
        "num_updates": self.num_updates,
        "total_time": self.total_time,
        "updates_per_second": self.num_updates / self.total_time,
        "bubble_fraction": self.bubble_fraction(),
        "forward_staleness": self.forward_staleness.mean(axis=0).tolist(),
        "backward_staleness": self.backward_staleness.mean(axis=0).tolist(),
        "versions_kept": self.versions_kept().tolist(),
        "activations_kept": self.activations_kept().tolist(),
    }


def _max_overlap(begin: np.ndarray, end: np.ndarray) -> int:
  """The most intervals ``[begin, end)`` open at one time (an end and a begin at one instant do not overlap)."""
  times = np.concatenate([begin, end])
  steps = np.concatenate([np.ones(begin.shape, np.int64), -np.ones(end.shape, np.int64)])
  order = np.lexsort((steps, times))  # ends (-1) before begins (+1) at equal times
  return int(np.max(np.cumsum(steps[order]), initial=0))


def _one_f_one_b(stage: int, num_stages: int, micro: list[int]) -> list[tuple[int, int]]:
  """One stage's operations for ``micro``: ``K - 1 - k`` warm-up forwards, then alternate, then drain."""
  warmup = min(num_stages - 1 - stage, len(micro))
  ops = [(_F, n) for n in micro[:warmup]]
  for i in range(len(micro) - warmup):
    ops += [(_F, micro[warmup + i]), (_B, micro[i])]
  ops += [(_B, n) for n in micro[len(micro) - warmup:]]
  return ops


def _stage_ops(schedule: str, stage: int, num_stages: int, m: int, num_updates: int) -> list[tuple[int, int]]:
  """The ordered operations ``(kind, index)`` of one stage; ``index`` is a micro-batch, or an update for ``_U``."""
  ops: list[tuple[int, int]] = []
  if schedule == "1f1b":
    for kind, n in _one_f_one_b(stage, num_stages, list(range(num_updates * m))):
      ops.append((kind, n))
      if kind == _B and (n + 1) % m == 0:
        ops.append((_U, n // m))
    return ops
  for u in range(num_updates):
    micro = list(range(u * m, (u + 1) * m))
    if schedule == "gpipe":
      ops += [(_F, n) for n in micro] + [(_B, n) for n in reversed(micro)]
    else:
      ops += _one_f_one_b(stage, num_stages, micro)
    ops.append((_U, u))
  return ops


def _per_stage(name: str, value: Any, num_stages: int) -> tuple[TimeModel, ...]:
  if isinstance(value, (list, tuple)):
    if len(value) != num_stages:
      raise ValueError(f"{name} as a sequence must have one time model per stage ({num_stages}), got {len(value)}.")
    return tuple(as_time_model(f"{name}[{k}]", v) for k, v in enumerate(value))
  return (as_time_model(name, value),) * num_stages


def pipeline(
    schedule: str,
    num_stages: int,
    num_updates: int,
    *,
    num_microbatches: int = 1,
    weights: str = "stash",
    forward: Any = 1.0,
    backward: Any = 2.0,
    comm: Any = 0.0,
    seed: int = 0,
) -> PipelineSchedule:
  """Simulates a pipeline schedule: when each pass runs and which weight version it uses.

  Args:
    schedule: ``"gpipe"``, ``"dapple"`` (synchronous, a flush every
      mini-batch) or ``"1f1b"`` (PipeDream's asynchronous one-forward-one-
      backward); see the module docstring.
    num_stages: ``K >= 1``.
    num_updates: ``U >= 1``, mini-batches (updates of every stage).
    num_microbatches: ``m >= 1`` micro-batches per mini-batch.
    weights: for ``"1f1b"``, which version the backward pass uses:
      ``"stash"``, ``"latest"`` or ``"vertical_sync"``. Synchronous schedules
      have no choice to make and accept only ``"stash"``.
    forward: seconds of one forward pass of one micro-batch on a stage: a
      time model, a distribution name or a number (as in
      ``dj.cluster.workers``), or a sequence with one per stage.
    backward: the same for a backward pass (default twice the forward).
    comm: seconds to send an activation or its gradient to the next stage
      (the same forms; default 0).
    seed: seeds the time draws (stage ``k`` draws from its own generator).

  Returns:
    A :class:`PipelineSchedule`.

  Example::

    >>> import delayjax as dj
    >>> p = dj.cluster.pipeline("gpipe", num_stages=4, num_updates=2, num_microbatches=8)
    >>> round(p.bubble_fraction(), 4)  # (K - 1) / (m + K - 1)
    0.2727
    >>> dj.cluster.pipeline("1f1b", 4, 50).forward_staleness[-10].tolist()  # K - 1 - k
    [3, 2, 1, 0]
  """
  schedule = check_choice("schedule", schedule, PIPELINE_SCHEDULES)
  K = check_int("num_stages", num_stages, minimum=1)
  U = check_int("num_updates", num_updates, minimum=1)
  m = check_int("num_microbatches", num_microbatches, minimum=1)
  weights = check_choice("weights", weights, PIPELINE_WEIGHTS)
  if schedule != "1f1b" and weights != "stash":
    raise ValueError(f"weights={weights!r} applies only to schedule='1f1b'; the synchronous schedule "
                     f"{schedule!r} always uses one version per mini-batch (leave weights='stash').")
  seed = check_seed("seed", seed)
  fwd_models = _per_stage("forward", forward, K)
  bwd_models = _per_stage("backward", backward, K)
  comm_models = _per_stage("comm", comm, K)
  N = U * m
  # Ten [micro-batches, stages] tables of 8 bytes and the update times, allocated at once below.
  check_fits(f"num_updates={U} x num_microbatches={m} on num_stages={K}: the pipeline schedule's tables",
             8 * K * (10 * N + U), available_memory())
  fwd_time, bwd_time, comm_f, comm_b = (np.empty((N, K)) for _ in range(4))
  for k in range(K):
    rng = np.random.default_rng([seed, k])
    fwd_time[:, k] = fwd_models[k].sample(rng, N)
    bwd_time[:, k] = bwd_models[k].sample(rng, N)
    comm_f[:, k] = comm_models[k].sample(rng, N)
    comm_b[:, k] = comm_models[k].sample(rng, N)

  ops = [_stage_ops(schedule, k, K, m, U) for k in range(K)]
  fs, fe, bs, be = (np.full((N, K), np.nan) for _ in range(4))
  fv, bv = np.full((N, K), -1, np.int64), np.full((N, K), -1, np.int64)
  update_time = np.full((U, K), np.nan)
  pointer, free, version = [0] * K, [0.0] * K, [0] * K
  remaining = sum(len(o) for o in ops)
  while remaining:
    progressed = False
    for k in range(K):
      while pointer[k] < len(ops[k]):
        kind, i = ops[k][pointer[k]]
        if kind == _F:
          if k > 0 and np.isnan(fe[i, k - 1]):
            break
          ready = fe[i, k - 1] + comm_f[i, k - 1] if k > 0 else 0.0
          fs[i, k] = max(free[k], ready)
          fe[i, k] = free[k] = fs[i, k] + fwd_time[i, k]
          fv[i, k] = version[k]
        elif kind == _B:
          if k < K - 1 and np.isnan(be[i, k + 1]):
            break
          ready = be[i, k + 1] + comm_b[i, k + 1] if k < K - 1 else fe[i, k]
          bs[i, k] = max(free[k], ready)
          be[i, k] = free[k] = bs[i, k] + bwd_time[i, k]
          bv[i, k] = version[k]
        else:
          update_time[i, k] = free[k]
          version[k] += 1
        pointer[k] += 1
        remaining -= 1
        progressed = True
    if not progressed:  # cannot happen for the schedules above: each stage's order respects the data flow
      raise RuntimeError(f"pipeline schedule {schedule!r} deadlocked; this is a bug in delayjax.")
  if schedule != "1f1b" or weights == "stash":
    bv = fv.copy()
  elif weights == "vertical_sync":
    fv = np.repeat(fv[:, :1], K, axis=1)
    bv = fv.copy()
  for a in (fv, bv, fs, fe, bs, be, update_time):
    a.setflags(write=False)
  return PipelineSchedule(schedule, weights, K, m, U, fv, bv, fs, fe, bs, be, update_time)
