"""Growing minibatches (Async-SGDI): a schedule whose contributions average more minibatches as updates go on."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from delayjax import delays as delays_lib
from delayjax._checks import check_float, check_int, check_seed
from delayjax.cluster._schedule import Schedule
from delayjax.runtime._simulate import schedule_from_delays


def batch_growth(num_updates: int, *, initial: int = 1, rate: float = 1.0, power: float = 1.0,
                 maximum: int | None = None) -> np.ndarray:
  r"""Minibatches per contribution of each update: :math:`b_u = \min(b_{\max}, \lceil b_0 (1 + r u)^p \rceil)`.

  Args:
    num_updates: :math:`U`.
    initial: :math:`b_0 \ge 1`.
    rate: :math:`r \ge 0` (0: constant batches).
    power: :math:`p \ge 0` (1: linear growth).
    maximum: :math:`b_{\max} \ge b_0`, or ``None`` for no cap.

  Returns:
    int64 ``[U]``.

  Examples:
    >>> from delayjax.runtime import batch_growth
    >>> batch_growth(6, initial=2, rate=0.5)  # ceil(2 (1 + u / 2))
    array([2, 3, 4, 5, 6, 7])
  """
  steps = check_int("num_updates", num_updates, minimum=1)
  b0 = check_int("initial", initial, minimum=1)
  r = check_float("rate", rate, minimum=0.0)
  p = check_float("power", power, minimum=0.0)
  cap = math.inf if maximum is None else check_int("maximum", maximum, minimum=b0)
  u = np.arange(steps, dtype=np.float64)
  # The small slack keeps exact integers (2 * 1.5 = 3.0000000000000004) from rounding up.
  grown = np.ceil(b0 * (1.0 + r * u) ** p - 1e-9)
  return np.minimum(grown, cap).astype(np.int64)


def growing_batches(source: Schedule | delays_lib.DelayModel, num_updates: int | None = None, *,
                    initial: int = 1, rate: float = 1.0, power: float = 1.0, maximum: int | None = None,
                    seed: int = 0) -> Schedule:
  r"""Async-SGDI: the schedule of ``source`` whose update :math:`u` averages :math:`b_u` minibatches per contribution.

  ``dj.simulate`` gives every contribution to update :math:`u` the mean of
  ``num_batches[u, m]`` minibatch gradients, all at the version its worker
  read. This sets ``num_batches[u, m]`` to :math:`b_u` =
  :func:`batch_growth` (times the schedule's own count, for K-batch
  schedules) wherever a worker contributes, so with ``optax.sgd(lr)`` the
  run is

  .. math::

    w_{u+1} = w_u - \frac{\eta}{b_u} \sum_{s=1}^{b_u} \nabla f_{i_{u,s}}(w_{u - \tau_u}),

  asynchronous SGD whose batch grows with the update index (Async-SGDI);
  ``rate=0`` is plain Async-SGD. The delays, reads and times are those of
  ``source`` unchanged; only the work per contribution grows (the runtime
  pads every lane to the largest :math:`b_u`, so a run costs about
  :math:`U \max_u b_u` gradients: cap it with ``maximum``).

  What is confirmed: Zhang, Liu and Zhu analyse Async-SGD and its variant
  with increasing batch sizes (Async-SGDI) under unbounded delays, with an
  :math:`o(1/\sqrt k)` rate for the first and :math:`o(1/k)` for the second
  (their abstract, reachable on arXiv). The growth law they use could not
  be read from a reachable source; the polynomial law here, linear by
  default, is delayjax's choice.

  Args:
    source: a ``dj.cluster.Schedule`` or a delay model (not ``per_leaf``),
      turned into its stale-read schedule with
      :func:`~delayjax.runtime.schedule_from_delays` and ``seed``.
    num_updates: the updates to keep (default: all of a schedule; required
      for a delay model).
    initial: :math:`b_0`, see :func:`batch_growth`.
    rate: :math:`r`.
    power: :math:`p`.
    maximum: :math:`b_{\max}`.
    seed: draws a delay model's delays.

  Returns:
    A ``Schedule`` with the grown ``num_batches``.

  Examples:
    >>> import delayjax as dj
    >>> s = dj.growing_batches(dj.delays.constant(2), 5, rate=1.0)
    >>> s.num_batches.max(axis=1)
    array([1, 2, 3, 4, 5])

  References:
    Zhang, Liu, Zhu, `Taming Convergence for Asynchronous Stochastic
    Gradient Descent with Unbounded Delay in Non-Convex Learning
    <https://arxiv.org/abs/1805.09470>`_, IEEE CDC 2020.
  """
  if isinstance(source, Schedule):
    steps = source.num_updates if num_updates is None else check_int("num_updates", num_updates, minimum=1)
    if steps > source.num_updates:
      raise ValueError(f"num_updates must be <= the schedule's {source.num_updates} updates, got {steps}.")
    schedule = source[:steps]
  else:
    delays_lib.check_model("source", source)
    if isinstance(source, (delays_lib.PerLeaf, delays_lib.Torn)):
      raise ValueError(f"source must not be a per_leaf or torn model, got {source!r}: a schedule holds one read "
                       "version per contribution; pass its models' common delay model or a Schedule.")
    if num_updates is None:
      raise ValueError("num_updates is required with a delay model as source.")
    steps = check_int("num_updates", num_updates, minimum=1)
    schedule = schedule_from_delays(source, steps, check_seed("seed", seed))
  grown = batch_growth(steps, initial=initial, rate=rate, power=power, maximum=maximum)
  num_batches = np.where(schedule.contributes, schedule.num_batches * grown[:, None], 0).astype(np.int64)
  return dataclasses.replace(schedule, num_batches=num_batches,
                             paradigm=f"{schedule.paradigm}, growing batches")
