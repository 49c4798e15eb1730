"""Pipeline schedules: K stages, micro-batches, and which weight version each forward and backward pass uses.

A model is split depth-wise into stages placed on ``K`` devices. Mini-batch
``u`` (update ``u``) is cut into ``m`` micro-batches ``n = u m .. u m + m - 1``;
each stage runs the forward pass ``F(n)`` and the backward pass of every
micro-batch and applies its update ``u`` (the mean of its ``m`` micro-batch
gradients) after the backward pass of the last micro-batch of mini-batch
``u``. A stage's *version* ``v`` is its weights after ``v`` of its own
updates. With ``virtual_stages = v`` (interleaved 1F1B) each device holds
``v`` model stages (chunks), so the model has ``S = K v`` stages; otherwise
``S = K`` and stage ``k`` is device ``k``. Model stage ``j`` runs on device
``j mod K``.

The backward pass computes the gradient of the stage's input (``B``,
which the stage before waits for) and of its weights (``W``, which only the
stage's update waits for). Most schedules run both at once, one pass; the
zero-bubble schedule runs them as two passes and places the ``W`` passes in
what would be bubbles.

A schedule fixes the order of each device's operations; the simulation runs
them as early as their data allow: ``F(n, j)`` needs ``F(n, j - 1)`` (plus the
activation's communication time), ``B(n, j)`` needs ``F(n, j)`` and
``B(n, j + 1)``, ``W(n, j)`` needs ``B(n, j)``, and a device runs one
operation at a time. Operation times come from per-stage time models (the
cluster simulator's, see ``dj.cluster.constant`` and friends), drawn from one
generator per model stage.

Schedules (bubble fractions for equal stage times ``t_f``, ``t_b`` per pass,
no communication time; each is pinned by a test against the simulation):

- ``"gpipe"`` (Huang et al. 2019): each stage runs the forward passes of all
  ``m`` micro-batches of a mini-batch, then their backward passes, then its
  update; the next mini-batch enters once stage 0 has updated (a flush).
  Every pass of mini-batch ``u`` uses version ``u``: no staleness; the bubble
  is :math:`(K - 1) / (m + K - 1)`.
- ``"dapple"`` (Fan et al. 2021): the same flush and versions, but each
  stage starts its backward passes early (one forward, one backward after
  ``K - 1 - k`` warm-up forwards), so it holds at most ``K - k`` micro-batches'
  activations instead of ``m``; same bubble as GPipe.
- ``"interleaved"`` (Narayanan et al. 2021, `Efficient Large-Scale Language
  Model Training on GPU Clusters Using Megatron-LM
  <https://arxiv.org/abs/2104.04473>`_, Section 2.2.2): DAPPLE's flush and
  versions with ``v`` model chunks per device: device ``d`` holds model stages
  ``d, d + K, .., d + (v - 1) K``, and runs Megatron-LM's order: forward passes
  in groups of ``K`` micro-batches, chunk by chunk (the ``i``-th forward of a
  device is chunk ``(i // K) mod v`` of micro-batch ``(i // (K v)) K + i mod K``;
  backward passes likewise, chunks in reverse), ``2 (K - 1 - d) + (v - 1) K``
  warm-up forwards, then one forward, one backward. ``m`` must be a multiple
  of ``K``. With ``t_f``, ``t_b`` the times of one chunk, a mini-batch takes
  :math:`(m v + K - 1)(t_f + t_b)` seconds, the bubble
  :math:`(K - 1) / (m v + K - 1)`: the paper's bubble time fraction
  :math:`\\frac{1}{v} \\frac{K - 1}{m}` of the ideal time.
- ``"zb-h1"`` (Qi, Wan, Huang, Lin 2024, `Zero Bubble Pipeline Parallelism
  <https://arxiv.org/abs/2401.10241>`_, ICLR 2024, Section 2.1): DAPPLE's flush
  and versions, the backward pass split into ``B`` and ``W``. Device ``d``
  runs DAPPLE's ``K - 1 - d`` warm-up forwards and its one-forward-one-backward
  order, but holds back its ``W`` passes: the ``W`` of a micro-batch follows
  the ``B`` of the micro-batch ``d`` places later, so every device has up to
  ``K`` micro-batches in flight (the first device's 1F1B peak, which bounds
  the activation memory), and the held-back ``W`` passes fill the drain at the
  end. With ``t_b`` the time of ``B`` and ``t_w`` that of ``W``
  (``weight_fraction`` of the backward time), a mini-batch takes
  :math:`m (t_f + t_b + t_w) + (K - 1)(t_f + t_b - t_w)` seconds (the paper's
  bubble :math:`(K - 1)(T_F + T_B - T_W)`, a third of 1F1B's when the three
  times are equal), so the bubble fraction is
  :math:`(K - 1)(t_f + t_b - t_w) / (m (t_f + t_b + t_w) + (K - 1)(t_f + t_b - t_w))`,
  for :math:`m \\ge K` and :math:`t_w \\le \\min(t_f, t_b)` (the paper's analysis
  takes the three times equal); with fewer micro-batches, or longer ``W``
  passes, the held-back passes no longer fit the drain and the bubble is
  larger.
- ``"1f1b"`` (PipeDream, Narayanan et al. 2019): the same one-forward-one-
  backward order without flushes: micro-batches enter continuously and each
  stage updates as soon as its share of a mini-batch is done. With ``m = 1``
  and a steady pipeline, stage ``k``'s forward pass is ``K - 1 - k`` versions
  stale, and the bubble is only the pipeline's fill and drain once per run:
  the ``N = U m`` micro-batches take :math:`(N + K - 1)(t_f + t_b)` seconds,
  a bubble of :math:`(K - 1) / (N + K - 1)`. Which version the backward pass
  uses is ``weights``:

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
- ``"2bw"`` (PipeDream-2BW: Narayanan, Phanishayee, Shi, Chen, Zaharia 2021,
  `Memory-Efficient Pipeline-Parallel DNN Training
  <https://arxiv.org/abs/2006.09503>`_, ICML 2021): 1F1B's order without
  flushes and ``m`` micro-batches coalesced per update, with two weight
  buffers: every pass of every micro-batch of mini-batch ``u``, at every
  stage, uses version ``max(u - 1, 0)``, so

  .. math::  w^{(u+1)} = w^{(u)} - \\nu \\nabla f(w^{(u-1)}),

  one uniform staleness of 1 (0 for the first mini-batch) and at most two
  versions per stage (the one in use and the newest). **Only the abstract
  and summaries of this paper were reachable here**; the update rule and the
  one-step delay are from the paper's abstract-level description (a double
  buffer, "weight update semantics similar to data parallelism") and the
  rule above. The timing is 1F1B's; ``m >= K - 1`` is required, so that
  every stage has made version ``u - 1`` (its update ``u - 2``) before 1F1B's
  order reaches the first forward pass of mini-batch ``u``.

Which version each pass reads, and which it writes (``j`` a model stage,
``n`` a micro-batch of mini-batch ``u = n // m``): the gradient of every
``W`` pass (or fused backward pass) of mini-batch ``u`` goes into update
``u``, which writes version ``u + 1``; the passes read

=================================  ===================  ===================  ===================
schedule                           ``F(n, j)``          ``B(n, j)``          ``W(n, j)``
=================================  ===================  ===================  ===================
gpipe, dapple, interleaved, zb-h1  ``u``                ``u``                ``u``
1f1b / stash                       current at ``F``     as ``F``             as ``B``
1f1b / latest                      current at ``F``     current at ``B``     as ``B``
1f1b / vertical_sync               stage 0's at ``F``   as ``F``             as ``B``
2bw                                ``max(u - 1, 0)``    ``max(u - 1, 0)``    ``max(u - 1, 0)``
=================================  ===================  ===================  ===================

The result records, per micro-batch and model stage, the start and end time
of the passes and their versions, and per update and model stage when it was
applied; from these follow the staleness (update index minus version), the
bubble fraction, and the weight versions and activations each stage must keep.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from delayjax._checks import check_choice, check_float, check_int, check_seed
from delayjax.cluster._distributions import TimeModel, as_time_model
from delayjax._memory import available_memory, check_fits

__all__ = ["PipelineSchedule", "pipeline", "PIPELINE_SCHEDULES", "PIPELINE_WEIGHTS"]

PIPELINE_SCHEDULES = ("gpipe", "dapple", "interleaved", "zb-h1", "1f1b", "2bw")
PIPELINE_WEIGHTS = ("stash", "latest", "vertical_sync")
_SPLIT = ("zb-h1",)  # schedules whose backward pass is two passes, B and W
_F, _B, _W, _U = 0, 1, 2, 3


@dataclasses.dataclass(frozen=True, eq=False)
class PipelineSchedule:
  """A simulated pipeline run: the time and the weight version of every forward and backward pass.

  Attributes (``N = num_updates * num_microbatches`` micro-batches, ``S = K v``
  model stages on ``K`` devices):
    schedule: one of ``PIPELINE_SCHEDULES``.
    weights: the backward pass's version rule (``"stash"``, ``"latest"``,
      ``"vertical_sync"``) of ``"1f1b"``; the other schedules report ``"stash"``.
    num_stages: ``K``, devices (pipeline stages).
    num_microbatches: ``m``, micro-batches per mini-batch (per update).
    num_updates: ``U``, updates every stage applies.
    forward_version: int64 ``[N, S]``, the version of model stage ``j``'s
      weights the forward pass of micro-batch ``n`` used.
    backward_version: int64 ``[N, S]``, likewise for its backward pass (the
      input-gradient pass ``B`` where the backward pass is split).
    forward_start, forward_end, backward_start, backward_end: float64
      ``[N, S]``, simulated seconds.
    update_time: float64 ``[U, S]``, when model stage ``j`` applied update
      ``u`` (producing version ``u + 1``).
    virtual_stages: ``v``, model stages per device (1 but for ``"interleaved"``).
    weight_version: int64 ``[N, S]``, the version the weight-gradient pass
      ``W`` used; where the backward pass is one pass, its version.
    weight_start, weight_end: float64 ``[N, S]``, the ``W`` pass's times;
      where the backward pass is one pass, both are its end (the weight
      gradient is part of it and takes no time of its own).
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
  virtual_stages: int = 1
  weight_version: np.ndarray | None = None
  weight_start: np.ndarray | None = None
  weight_end: np.ndarray | None = None

  def __post_init__(self):
    # A schedule built without the weight-gradient pass's fields has it fused into the backward pass.
    if self.weight_version is None:
      object.__setattr__(self, "weight_version", self.backward_version)
    for name in ("weight_start", "weight_end"):
      if getattr(self, name) is None:
        object.__setattr__(self, name, self.backward_end)

  @property
  def num_passes(self) -> int:
    """``N``: micro-batches that flow through the pipeline."""
    return self.num_updates * self.num_microbatches

  @property
  def num_model_stages(self) -> int:
    """``S = K v``: the model's stages (one stage function each in ``dj.simulate_pipeline``)."""
    return self.num_stages * self.virtual_stages

  @property
  def device_of(self) -> np.ndarray:
    """int64 ``[S]``: the device that runs each model stage (``j mod K``)."""
    return np.arange(self.num_model_stages) % self.num_stages

  @property
  def update_of(self) -> np.ndarray:
    """int64 ``[N]``: the update each micro-batch's gradient belongs to (``n // m``)."""
    return np.arange(self.num_passes) // self.num_microbatches

  @property
  def forward_staleness(self) -> np.ndarray:
    """int64 ``[N, S]``: update index minus the forward pass's version (0: synchronous)."""
    return self.update_of[:, None] - self.forward_version

  @property
  def backward_staleness(self) -> np.ndarray:
    """int64 ``[N, S]``: update index minus the backward pass's version."""
    return self.update_of[:, None] - self.backward_version

  @property
  def total_time(self) -> float:
    """Simulated seconds until the last update of the last stage."""
    return float(self.update_time.max())

  def busy_time(self) -> np.ndarray:
    """float64 ``[K]``: seconds each device spent computing (all its model stages' passes)."""
    per_stage = ((self.forward_end - self.forward_start) + (self.backward_end - self.backward_start)
                 + (self.weight_end - self.weight_start)).sum(axis=0)
    return np.bincount(self.device_of, weights=per_stage, minlength=self.num_stages)

  def bubble_fraction(self) -> float:
    """The fraction of device-seconds spent idle: :math:`1 - \\sum_d \\mathrm{busy}_d / (K T)`."""
    return float(1.0 - self.busy_time().sum() / (self.num_stages * self.total_time))

  def versions_kept(self) -> np.ndarray:
    """int64 ``[S]``: the most weight versions each model stage holds at once (the weights' memory, in copies).

    Version ``v`` of a stage lives from the update that made it (time 0
    for ``v = 0``) until the later of the update that replaces it and the
    end of the last pass that uses it.
    """
    out = np.zeros(self.num_model_stages, np.int64)
    for j in range(self.num_model_stages):
      born = np.r_[0.0, self.update_time[:, j]]  # version v is made by update v - 1
      dies = np.r_[self.update_time[:, j], self.total_time]
      for version, end in ((self.forward_version[:, j], self.forward_end[:, j]),
                           (self.backward_version[:, j], self.backward_end[:, j]),
                           (self.weight_version[:, j], self.weight_end[:, j])):
        np.maximum.at(dies, version, end)
      out[j] = _max_overlap(born, dies)
    return out

  def activations_kept(self) -> np.ndarray:
    """int64 ``[S]``: the most micro-batches whose activations a model stage holds at once (from the start of
    the forward pass to the end of the pass that computes the weight gradient, the last to need them)."""
    return np.array([_max_overlap(self.forward_start[:, j], self.weight_end[:, j])
                     for j in range(self.num_model_stages)], np.int64)

  def summary(self) -> dict[str, Any]:
    """Headline numbers: time, bubble fraction, mean staleness per stage, versions and activations kept."""
    return {
        "schedule": self.schedule if self.schedule != "1f1b" else f"1f1b/{self.weights}",
        "num_stages": self.num_stages,
        "virtual_stages": self.virtual_stages,
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


def _zero_bubble_h1(stage: int, num_stages: int, micro: list[int]) -> list[tuple[int, int]]:
  """ZB-H1 on one device: 1F1B's order, each ``W`` after the ``B`` ``stage`` micro-batches later, the held-back
  ``W`` passes at the end."""
  ops, done = [], 0
  for kind, n in _one_f_one_b(stage, num_stages, micro):
    ops.append((kind, n))
    if kind == _B and n - micro[0] - done >= stage:
      ops.append((_W, micro[done]))
      done += 1
  return ops + [(_W, n) for n in micro[done:]]


def _interleaved(device: int, num_stages: int, virtual: int, micro: list[int]) -> list[tuple[int, int, int]]:
  """Megatron-LM's interleaved 1F1B on one device: ``(kind, micro-batch, model stage)``."""
  K, total = num_stages, len(micro) * virtual

  def op(kind: int, i: int) -> tuple[int, int, int]:
    chunk = (i // K) % virtual
    if kind == _B:
      chunk = virtual - 1 - chunk
    return kind, micro[(i // (K * virtual)) * K + i % K], chunk * K + device

  warmup = min(2 * (K - 1 - device) + (virtual - 1) * K, total)
  ops = [op(_F, i) for i in range(warmup)]
  for i in range(total - warmup):
    ops += [op(_F, warmup + i), op(_B, i)]
  return ops + [op(_B, i) for i in range(total - warmup, total)]


def _device_ops(schedule: str, device: int, K: int, v: int, m: int, U: int) -> list[tuple[int, int, int]]:
  """The ordered operations ``(kind, index, model stage)`` of one device; ``index`` is a micro-batch, or an
  update for ``_U``."""
  if schedule in ("1f1b", "2bw"):
    ops: list[tuple[int, int, int]] = []
    for kind, n in _one_f_one_b(device, K, list(range(U * m))):
      ops.append((kind, n, device))
      if kind == _B and (n + 1) % m == 0:
        ops.append((_U, n // m, device))
    return ops
  ops = []
  for u in range(U):
    micro = list(range(u * m, (u + 1) * m))
    if schedule == "interleaved":
      ops += _interleaved(device, K, v, micro)
      ops += [(_U, u, c * K + device) for c in range(v)]
      continue
    if schedule == "gpipe":
      order = [(_F, n) for n in micro] + [(_B, n) for n in reversed(micro)]
    elif schedule == "zb-h1":
      order = _zero_bubble_h1(device, K, micro)
    else:
      order = _one_f_one_b(device, K, micro)
    ops += [(kind, n, device) for kind, n in order] + [(_U, u, device)]
  return ops


def _per_stage(name: str, value: Any, num_stages: int, virtual: int) -> tuple[TimeModel, ...]:
  if isinstance(value, (list, tuple)):
    if len(value) != num_stages:
      count = f"{num_stages}: num_stages x virtual_stages" if virtual > 1 else f"{num_stages}"
      raise ValueError(f"{name} as a sequence must have one time model per stage ({count}), got {len(value)}.")
    return tuple(as_time_model(f"{name}[{k}]", v) for k, v in enumerate(value))
  return (as_time_model(name, value),) * num_stages


def _check_layout(schedule: str, K: int, m: int, weights: str, virtual_stages: Any, weight_fraction: Any
                  ) -> tuple[int, float | None]:
  """The schedule's own options checked against it: ``(v, weight_fraction)``."""
  if schedule != "1f1b" and weights != "stash":
    raise ValueError(f"weights={weights!r} applies only to schedule='1f1b'; schedule={schedule!r} fixes its own "
                     f"versions (leave weights='stash').")
  v = check_int("virtual_stages", virtual_stages, minimum=1)
  if schedule == "interleaved":
    if v < 2:
      raise ValueError(f"virtual_stages must be >= 2 for schedule='interleaved' (model chunks per device), got {v}; "
                       f"one chunk per device is schedule='dapple'.")
    if m % K:
      raise ValueError(f"num_microbatches must be a multiple of num_stages ({K}) for schedule='interleaved' "
                       f"(Megatron-LM's order runs micro-batches in groups of K), got {m}.")
  elif schedule == "2bw" and m < K - 1:
    raise ValueError(f"num_microbatches must be >= num_stages - 1 ({K - 1}) for schedule='2bw', got {m}: with fewer, "
                     f"1F1B's order reaches a mini-batch's first forward pass before the version it reads exists.")
  if schedule != "interleaved" and v != 1:
    raise ValueError(f"virtual_stages={v} applies only to schedule='interleaved'; schedule={schedule!r} has one "
                     f"model stage per device (leave virtual_stages=1).")
  if weight_fraction is None:
    return v, 0.5 if schedule in _SPLIT else None
  if schedule not in _SPLIT:
    raise ValueError(f"weight_fraction applies only to schedules that split the backward pass {_SPLIT}; "
                     f"schedule={schedule!r} runs it as one pass (leave weight_fraction=None).")
  return v, check_float("weight_fraction", weight_fraction, minimum=0.0, maximum=1.0)


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
    virtual_stages: int = 1,
    weight_fraction: float | None = None,
    seed: int = 0,
) -> PipelineSchedule:
  """Simulates a pipeline schedule: when each pass runs and which weight version it uses.

  Args:
    schedule: ``"gpipe"``, ``"dapple"``, ``"interleaved"``, ``"zb-h1"``
      (synchronous, a flush every mini-batch), ``"1f1b"`` (PipeDream's
      asynchronous one-forward-one-backward) or ``"2bw"`` (PipeDream-2BW);
      see the module docstring.
    num_stages: ``K >= 1`` devices.
    num_updates: ``U >= 1``, mini-batches (updates of every stage).
    num_microbatches: ``m >= 1`` micro-batches per mini-batch (a multiple of
      ``K`` for ``"interleaved"``).
    weights: for ``"1f1b"``, which version the backward pass uses:
      ``"stash"``, ``"latest"`` or ``"vertical_sync"``. The other schedules
      fix their versions and accept only ``"stash"``.
    forward: seconds of one forward pass of one micro-batch on a model stage:
      a time model, a distribution name or a number (as in
      ``dj.cluster.workers``), or a sequence with one per model stage.
    backward: the same for a backward pass (default twice the forward); for
      ``"zb-h1"`` the two passes it splits into together.
    comm: seconds to send an activation or its gradient to the next stage
      (the same forms; default 0).
    virtual_stages: ``v``, model stages per device, ``>= 2`` for
      ``"interleaved"`` (its model has ``K v`` stages), 1 otherwise.
    weight_fraction: for ``"zb-h1"``, the share of each backward time that
      is the weight-gradient pass ``W`` (default 0.5; the rest is ``B``).
    seed: seeds the time draws (model stage ``j`` draws from its own generator).

  Returns:
    A :class:`PipelineSchedule`.

  Example::

    >>> import delayjax as dj
    >>> p = dj.cluster.pipeline("gpipe", num_stages=4, num_updates=2, num_microbatches=8)
    >>> round(p.bubble_fraction(), 4)  # (K - 1) / (m + K - 1)
    0.2727
    >>> dj.cluster.pipeline("1f1b", 4, 50).forward_staleness[-10].tolist()  # K - 1 - k
    [3, 2, 1, 0]
    >>> p = dj.cluster.pipeline("interleaved", 4, 2, num_microbatches=8, virtual_stages=2)
    >>> round(p.bubble_fraction(), 4)  # (K - 1) / (m v + K - 1)
    0.1579
    >>> round(dj.cluster.pipeline("zb-h1", 4, 2, num_microbatches=8).bubble_fraction(), 4)
    0.1111
    >>> dj.cluster.pipeline("2bw", 4, 6, num_microbatches=4).forward_staleness[::4].tolist()[:3]
    [[0, 0, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]]
  """
  schedule = check_choice("schedule", schedule, PIPELINE_SCHEDULES)
  K = check_int("num_stages", num_stages, minimum=1)
  U = check_int("num_updates", num_updates, minimum=1)
  m = check_int("num_microbatches", num_microbatches, minimum=1)
  weights = check_choice("weights", weights, PIPELINE_WEIGHTS)
  v, split = _check_layout(schedule, K, m, weights, virtual_stages, weight_fraction)
  seed = check_seed("seed", seed)
  S = K * v
  fwd_models = _per_stage("forward", forward, S, v)
  bwd_models = _per_stage("backward", backward, S, v)
  comm_models = _per_stage("comm", comm, S, v)
  N = U * m
  # Thirteen [micro-batches, model stages] tables of 8 bytes and the update times, allocated at once below.
  chunks = f" x virtual_stages={v}" if v > 1 else ""
  check_fits(f"num_updates={U} x num_microbatches={m} on num_stages={K}{chunks}: the pipeline schedule's tables",
             8 * S * (13 * N + U), available_memory())
  fwd_time, bwd_time, comm_f, comm_b = (np.empty((N, S)) for _ in range(4))
  for j in range(S):
    rng = np.random.default_rng([seed, j])
    fwd_time[:, j] = fwd_models[j].sample(rng, N)
    bwd_time[:, j] = bwd_models[j].sample(rng, N)
    comm_f[:, j] = comm_models[j].sample(rng, N)
    comm_b[:, j] = comm_models[j].sample(rng, N)
  w_time = None
  if split is not None:
    w_time = split * bwd_time
    bwd_time = bwd_time - w_time
  times = _simulate([_device_ops(schedule, d, K, v, m, U) for d in range(K)], K, S, N, U, fwd_time, bwd_time,
                    w_time, comm_f, comm_b, schedule)
  fv, bv, wv, fs, fe, bs, be, ws, we, update_time = times
  if schedule == "2bw":  # mini-batch u reads version u - 1 (0 for the first two), made before its first pass
    fv = np.repeat(np.maximum(np.arange(N) // m - 1, 0)[:, None], S, axis=1)
    bv = wv = fv
  elif schedule != "1f1b" or weights == "stash":
    bv = fv.copy()
  elif weights == "vertical_sync":
    fv = np.repeat(fv[:, :1], S, axis=1)
    bv = fv.copy()
  if w_time is None:  # one backward pass: the weight gradient is part of it
    wv, ws, we = bv, be, be
  for a in (fv, bv, wv, fs, fe, bs, be, ws, we, update_time):
    a.setflags(write=False)
  return PipelineSchedule(schedule, weights, K, m, U, fv, bv, fs, fe, bs, be, update_time, virtual_stages=v,
                          weight_version=wv, weight_start=ws, weight_end=we)


def _simulate(ops: list[list[tuple[int, int, int]]], K: int, S: int, N: int, U: int, fwd_time: np.ndarray,
              bwd_time: np.ndarray, w_time: np.ndarray | None, comm_f: np.ndarray, comm_b: np.ndarray,
              schedule: str) -> tuple[np.ndarray, ...]:
  """Runs each device's operations in order, each as early as its inputs allow: the passes' versions (the
  model stage's current one) and times, and the update times."""
  fs, fe, bs, be, ws, we = (np.full((N, S), np.nan) for _ in range(6))
  fv, bv, wv = (np.full((N, S), -1, np.int64) for _ in range(3))
  update_time = np.full((U, S), np.nan)
  pointer, free, version = [0] * K, [0.0] * K, [0] * S
  remaining = sum(len(o) for o in ops)
  while remaining:
    progressed = False
    for d in range(K):
      while pointer[d] < len(ops[d]):
        kind, i, j = ops[d][pointer[d]]
        if kind == _F:
          if j > 0 and np.isnan(fe[i, j - 1]):
            break
          ready = fe[i, j - 1] + comm_f[i, j - 1] if j > 0 else 0.0
          fs[i, j] = max(free[d], ready)
          fe[i, j] = free[d] = fs[i, j] + fwd_time[i, j]
          fv[i, j] = version[j]
        elif kind == _B:
          if j < S - 1 and np.isnan(be[i, j + 1]):
            break
          ready = be[i, j + 1] + comm_b[i, j + 1] if j < S - 1 else fe[i, j]
          bs[i, j] = max(free[d], ready)
          be[i, j] = free[d] = bs[i, j] + bwd_time[i, j]
          bv[i, j] = version[j]
        elif kind == _W:
          ws[i, j] = max(free[d], be[i, j])
          we[i, j] = free[d] = ws[i, j] + w_time[i, j]
          wv[i, j] = version[j]
        else:
          update_time[i, j] = free[d]
          version[j] += 1
        pointer[d] += 1
        remaining -= 1
        progressed = True
    if not progressed:  # cannot happen for the schedules above: each device's order respects the data flow
      raise RuntimeError(f"pipeline schedule {schedule!r} deadlocked; this is a bug in delayjax.")
  return fv, bv, wv, fs, fe, bs, be, ws, we, update_time
