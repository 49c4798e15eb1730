"""Workers: how long each worker of a simulated cluster takes per gradient.

The ``j``-th gradient of worker ``m`` takes

.. math::  d_{j,m} = \\frac{c_{j,m}}{v_m}\\, s_{j,m}\\, w_m(t) + l_{j,m}

seconds from its read to its push, where ``c`` is drawn from the worker's
compute-time model (or replayed from measurements), ``v_m`` is the worker's
speed, ``s`` is a random straggler slowdown (``random_stragglers``), ``w_m(t)``
is the slowdown of any ``straggler_window`` containing the read time ``t``, and
``l`` is the communication latency of the push. Each worker draws from its
own random stream, in blocks of gradient indices, so the ``j``-th gradient of
a worker takes the same time whatever the paradigm does and whatever the
other workers draw: the same seed gives the same durations.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Sequence

import numpy as np

from delayjax._checks import check_float, check_int, check_seed
from delayjax.cluster._distributions import Constant, TimeModel, Uniform, as_time_model
from delayjax._memory import available_memory, check_fits

__all__ = [
    "Workers", "Replay", "RandomStragglers", "StragglerWindow",
    "workers", "replay", "random_stragglers", "straggler_window",
]

_SMALLEST_TIME = float(np.finfo(np.float64).smallest_subnormal)
_MAX_WORKERS = 2**31 - 1


def _check_positive_compute(name: str, model: TimeModel) -> TimeModel:
  """``model`` if its draws are positive, else a ValueError naming ``name``.

  A gradient that takes no time lets its worker push again at the same
  instant, forever: under ASP worker 0 gets every update and the schedule
  reports infinite updates per second. A constant of 0 (or less) and a
  uniform whose ``high`` is 0 draw only 0; the other models, with the
  positive parameters their factories require, draw positive times.
  """
  if isinstance(model, Constant) and not model.value > 0:
    raise ValueError(f"{name} must be a compute time > 0 seconds (a gradient takes time; with 0 one worker "
                     f"pushes without end at one instant), got the constant {model.value}.")
  if isinstance(model, Uniform) and not model.high > 0:
    raise ValueError(f"{name} must draw compute times > 0 seconds, got uniform(low={model.low}, high={model.high}), "
                     "which draws only 0; give high > 0.")
  return model


def _check_worker_subset(value: Any, num_workers: int | None = None) -> tuple[int, ...] | None:
  if value is None:
    return None
  if isinstance(value, (numbers.Integral, np.integer)):
    value = (value,)
  subset = tuple(check_int("workers", w, minimum=0) for w in value)
  if not subset:
    raise ValueError("workers must name at least one worker (or be None for all), got an empty sequence.")
  if num_workers is not None and max(subset) >= num_workers:
    raise ValueError(f"workers must be indices in 0..{num_workers - 1}, got {subset}.")
  return subset


@dataclasses.dataclass(frozen=True)
class RandomStragglers:
  """Each gradient of the chosen workers is, independently with ``probability``, ``slowdown`` times slower.

  Attributes:
    probability: chance that one gradient straggles, in ``[0, 1]``.
    slowdown: the factor (``>= 1``) its compute time is multiplied by.
    workers: indices of the workers that may straggle, or ``None`` for all.
  """

  probability: float
  slowdown: float = 10.0
  workers: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class StragglerWindow:
  """Gradients of the chosen workers read in ``[start, stop)`` seconds are ``slowdown`` times slower.

  Attributes:
    start: simulated second the window opens.
    stop: simulated second it closes (exclusive).
    slowdown: the factor (``> 0``) the compute time is multiplied by.
    workers: indices of the affected workers, or ``None`` for all.
  """

  start: float
  stop: float
  slowdown: float = 10.0
  workers: tuple[int, ...] | None = None


def random_stragglers(probability: float, slowdown: float = 10.0,
                      workers: Sequence[int] | int | None = None) -> RandomStragglers:
  """Each gradient straggles (is ``slowdown`` times slower) independently with ``probability``."""
  return RandomStragglers(check_float("probability", probability, minimum=0.0, maximum=1.0),
                          check_float("slowdown", slowdown, minimum=1.0), _check_worker_subset(workers))


def straggler_window(start: float, stop: float, slowdown: float = 10.0,
                     workers: Sequence[int] | int | None = None) -> StragglerWindow:
  """Gradients read during ``[start, stop)`` simulated seconds are ``slowdown`` times slower."""
  start = check_float("start", start, minimum=0.0)
  stop = check_float("stop", stop, minimum=0.0)
  if stop < start:
    raise ValueError(f"stop must be >= start, got start={start}, stop={stop}.")
  return StragglerWindow(start, stop, check_float("slowdown", slowdown, minimum=0.0, strict_minimum=True),
                         _check_worker_subset(workers))


@dataclasses.dataclass(frozen=True, eq=False)
class Replay:
  """Measured compute times replayed per worker: gradient ``j`` of worker ``m`` takes ``times[m, j % n]``.

  Attributes:
    times: float64 ``[M, n]``, seconds; finite and positive.
  """

  times: np.ndarray

  def __post_init__(self):
    times = np.array(self.times, dtype=np.float64)
    if times.ndim != 2 or times.shape[0] < 1 or times.shape[1] < 1:
      raise ValueError(f"times must be a non-empty 2-D array [num_workers, num_measurements], "
                       f"got shape {times.shape}.")
    if not np.all(np.isfinite(times)) or np.any(times <= 0):
      bad = times[~np.isfinite(times) | (times <= 0)][0]
      raise ValueError(f"times must be finite and > 0 seconds (a gradient takes time: with 0 a worker pushes "
                       f"without end at one instant), got {bad.item()}.")
    times.setflags(write=False)
    object.__setattr__(self, "times", times)

  @property
  def mean(self) -> np.ndarray:
    return self.times.mean(axis=1)

  def __repr__(self) -> str:
    return f"Replay(times=<{self.times.shape[0]} workers x {self.times.shape[1]} measurements>)"


def replay(times: Any) -> Replay:
  """Replays measured per-worker compute times ``[num_workers, num_measurements]``, cycling each row."""
  return Replay(times)


@dataclasses.dataclass(frozen=True, eq=False)
class Workers:
  """A simulated cluster's workers: per-worker compute and communication time models.

  Build it with :func:`workers`. Attributes:
    num_workers: ``M``.
    compute: one ``TimeModel`` per worker, or a ``Replay`` of measured times.
    comm: one ``TimeModel`` per worker (latency added to every push), or
      ``None`` for none.
    speed: float64 ``[M]``, a worker's compute time is divided by its speed.
    stragglers: the straggler injections, applied in order.
    seed: an extra seed mixed into the simulation's seed, or ``None``.
  """

  num_workers: int
  compute: tuple[TimeModel, ...] | Replay
  comm: tuple[TimeModel, ...] | None
  speed: np.ndarray
  stragglers: tuple[RandomStragglers | StragglerWindow, ...] = ()
  seed: int | None = None

  @property
  def windows(self) -> tuple[StragglerWindow, ...]:
    return tuple(s for s in self.stragglers if isinstance(s, StragglerWindow))

  def mean_time(self) -> np.ndarray:
    """float64 ``[M]``: each worker's expected seconds per gradient, ignoring stragglers."""
    if isinstance(self.compute, Replay):
      compute = self.compute.mean
    else:
      compute = np.array([c.mean for c in self.compute])
    comm = np.zeros(self.num_workers) if self.comm is None else np.array([c.mean for c in self.comm])
    return compute / self.speed + comm

  def draw(self, rng: np.random.Generator, worker: int, start: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Durations of gradients ``start .. start + size - 1`` of one worker, from that worker's generator.

    Returns:
      ``(compute, comm)``, float64 ``[size]`` each: the compute time with
      speed and random stragglers applied (``straggler_window`` is applied at
      read time by the simulator), and the communication latency.
    """
    if isinstance(self.compute, Replay):
      times = self.compute.times[worker]
      compute = times[(start + np.arange(size)) % times.shape[0]]
    else:
      compute = self.compute[worker].sample(rng, size)
    compute = compute / self.speed[worker]
    for s in self.stragglers:
      if isinstance(s, RandomStragglers):
        hit = rng.random(size) < s.probability
        if s.workers is None or worker in s.workers:
          compute = np.where(hit, compute * s.slowdown, compute)
    # Compute times are strictly positive: a draw of exactly 0 (uniform from 0, exponential or gamma with a
    # uniform variate of 0, a huge speed) would be a push taking no time; it becomes the smallest positive
    # float, which changes no other draw.
    compute = np.maximum(compute, _SMALLEST_TIME)
    comm = np.zeros(size) if self.comm is None else self.comm[worker].sample(rng, size)
    return compute, comm

  def __repr__(self) -> str:
    def models(ms):
      if ms is None or isinstance(ms, Replay):
        return repr(ms)
      return repr(ms[0]) if all(m == ms[0] for m in ms) else f"<{len(set(ms))} models>"
    speed = (f"{self.speed[0]:g}" if np.all(self.speed == self.speed[0])
             else f"<{self.speed.min():g}..{self.speed.max():g}>")
    return (f"Workers(num_workers={self.num_workers}, compute={models(self.compute)}, "
            f"comm={models(self.comm)}, speed={speed}, stragglers={self.stragglers!r}, seed={self.seed})")


def _is_table(value: Any) -> bool:
  """Whether ``value`` is a 2-D table of numbers (measured times to replay)."""
  try:
    return np.asarray(value).ndim == 2 and np.asarray(value).dtype.kind in "iuf"
  except (ValueError, TypeError):
    return False


def _per_worker(name: str, value: Any, num_workers: int) -> tuple[TimeModel, ...]:
  if isinstance(value, (list, tuple)):
    if len(value) != num_workers:
      raise ValueError(f"{name} as a sequence must have one model per worker ({num_workers}), got {len(value)}.")
    return tuple(as_time_model(f"{name}[{m}]", v) for m, v in enumerate(value))
  model = as_time_model(name, value)
  return (model,) * num_workers


def workers(
    num_workers: int,
    compute: Any = "exponential",
    comm: Any = None,
    speed: Any = None,
    stragglers: Any = (),
    seed: int | None = None,
) -> Workers:
  """Describes ``num_workers`` workers and how long each gradient takes them.

  Args:
    num_workers: ``M >= 1``.
    compute: the compute-time model: a distribution name (``"constant"``,
      ``"uniform"``, ``"exponential"``, ``"gamma"``, ``"lognormal"``; each with
      mean 1 second), a model such as ``dj.cluster.gamma(shape=4, mean=2.0)``,
      a number of seconds (constant), a sequence of those with one per worker,
      or measured times to replay: ``dj.cluster.replay(times)`` or a 2-D array
      ``[num_workers, num_measurements]`` (each row is cycled). Compute times
      are strictly positive: a constant ``<= 0``, a uniform with ``high = 0``
      and replayed times ``<= 0`` are refused (a gradient that takes no time
      lets its worker push without end at one instant), and a random draw of
      exactly 0 is taken as the smallest positive float.
    comm: communication latency added to every push, in the same forms
      (``None``: no latency; replay is not accepted here), or a
      ``dj.cluster.link(bandwidth, message_bytes, latency)``: latency plus
      the push's bytes over the bandwidth.
    speed: per-worker speed factors (a worker's compute time is divided by
      its speed): ``None`` (all 1), a positive number, or ``M`` positive numbers.
    stragglers: one or a sequence of ``random_stragglers(...)`` /
      ``straggler_window(...)``.
    seed: optional extra seed mixed into ``simulate``'s seed, so that two
      clusters simulated with the same seed can draw different times.

  Returns:
    A frozen :class:`Workers`.

  Example::

    >>> import delayjax as dj
    >>> w = dj.cluster.workers(4, compute="gamma", speed=[1, 1, 1, 0.5])
    >>> w.mean_time().tolist()
    [1.0, 1.0, 1.0, 2.0]
  """
  num_workers = check_int("num_workers", num_workers, minimum=1)
  if num_workers > _MAX_WORKERS:
    raise ValueError(f"num_workers must be an integer in [1, 2**31 - 1 = {_MAX_WORKERS}] (worker indices are int32 "
                     f"in the runtimes), got {num_workers}.")
  # A time model reference and a speed per worker, at least (one more per straggler injection).
  check_fits(f"num_workers={num_workers}: the per-worker tables", 16 * num_workers, available_memory())
  if isinstance(compute, Replay) or (not isinstance(compute, (str, TimeModel)) and _is_table(compute)):
    if isinstance(compute, Replay):
      compute_models: tuple[TimeModel, ...] | Replay = compute
    else:
      try:
        compute_models = Replay(compute)
      except ValueError as error:
        raise ValueError(f"compute (measured times to replay): {error}") from None
    if compute_models.times.shape[0] != num_workers:
      raise ValueError(f"compute replay times must have one row per worker ({num_workers}), "
                       f"got shape {compute_models.times.shape}.")
  else:
    compute_models = _per_worker("compute", compute, num_workers)
    names = ["compute"] * num_workers if not isinstance(compute, (list, tuple)) else [
        f"compute[{m}]" for m in range(num_workers)]
    compute_models = tuple(_check_positive_compute(n, c) for n, c in zip(names, compute_models))
  comm_models = None if comm is None else _per_worker("comm", comm, num_workers)
  if speed is None:
    speeds = np.ones(num_workers)
  else:
    try:
      kind = None if isinstance(speed, (str, bytes)) else np.asarray(speed).dtype.kind
    except (TypeError, ValueError):
      kind = None
    if kind not in ("i", "u", "f"):
      raise TypeError(f"speed must be None, a positive number or {num_workers} positive numbers, got {speed!r}.")
    speeds = np.array(np.broadcast_to(np.asarray(speed, dtype=np.float64), (num_workers,))
                      if np.ndim(speed) == 0 else np.asarray(speed, dtype=np.float64))
    if speeds.shape != (num_workers,):
      raise ValueError(f"speed must be a number or have one entry per worker ({num_workers}), "
                       f"got shape {speeds.shape}.")
    if not np.all(np.isfinite(speeds)) or np.any(speeds <= 0):
      raise ValueError(f"speed must be finite and > 0 for every worker, got {speeds.tolist()}.")
  speeds.setflags(write=False)
  if isinstance(stragglers, (RandomStragglers, StragglerWindow)):
    stragglers = (stragglers,)
  stragglers = tuple(stragglers)
  for s in stragglers:
    if not isinstance(s, (RandomStragglers, StragglerWindow)):
      raise TypeError(f"stragglers must be random_stragglers(...) or straggler_window(...) objects, got {s!r}.")
    _check_worker_subset(s.workers, num_workers)
  if seed is not None:
    seed = check_seed("seed", seed)
  return Workers(num_workers, compute_models, comm_models, speeds, stragglers, seed)
