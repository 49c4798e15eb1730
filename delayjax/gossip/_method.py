"""What a gossip method is: per-replica rules that the replica runtime applies at each event.

A decentralized method is not one Optax transformation: it decides what each
replica keeps besides its parameters (a push-sum weight, a momentum twin, the
last all-reduced model), where a replica computes its gradient, how a
gradient event applies the replica's own optimizer, and what a mixing event
combines. This module holds that contract; the methods live in the modules
beside it and the runtime (``dj.simulate_gossip``) runs any of them on any
gossip schedule. These rules are written for *one* replica; the runtime
applies them to all replicas at once with ``jax.vmap``.

The methods are a subpackage of their own rather than ``transforms/``
modules because they are not transformations of one parameter tree: their
mixing rules act across replicas, and a method's gradient step wraps a
user's Optax transformation (applied per replica, each with its own state).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import numpy as np
import optax

from delayjax.cluster._gossip import GRADS as SCHEDULE_GRADS
from delayjax.cluster._gossip import PARAMS as SCHEDULE_PARAMS
from delayjax.cluster._gossip import GossipSchedule

PARAMS, GRADS = "params", "gradients"


class GossipMethod(NamedTuple):
  r"""The rules of a decentralized method, for one replica.

  Attributes:
    name: a short name, e.g. ``"sgp"``.
    init: ``init(params) -> extra``: the replica's state besides its
      parameters and optimizer state (``()`` when there is none).
    grad_params: ``grad_params(params, extra) -> params``: where a ``READ``
      takes the replica's gradient (``x / w`` for push-sum).
    apply: ``apply(tx, grads, opt_state, params, extra, dt) -> (params,
      opt_state, extra)``: a ``GRAD`` event. ``dt`` is the simulated time
      since the replica's previous ``GRAD`` or ``MIX`` (float32; used by
      methods with continuous dynamics).
    message: ``message(params, extra) -> pytree``: what the replica sends in a
      ``PARAMS`` mix; mixed linearly, leaf by leaf.
    receive: ``receive(params, extra, mixed, self_weight, dt) -> (params,
      extra)``: a receiving member of a ``PARAMS`` mix, given
      :math:`\sum_b W_{ab} m_b` of the members' messages and its own weight
      :math:`W_{aa}`.
    mixes: what a ``MIX`` event combines: ``"params"`` (the messages) or
      ``"gradients"`` (the pending gradients, GossipGraD). A schedule's
      ``GRADS`` mixes always combine pending gradients.
    advance: ``advance(params, extra, dt) -> (params, extra)``, or ``None``:
      continuous dynamics between events (A2CiD2), applied to every member of
      a ``PARAMS`` mix before the messages are taken.
    late_messages: whether the rule is defined for late messages (a
      schedule's ``lag > 0``); the runtime refuses such a schedule otherwise.
    push_sum: whether the replica keeps a push-sum weight mixed with the
      same weights as its parameters and divides by it (SGP), so that mixes
      need not average (see :func:`check_method_schedule`).
    needs_param_mixes: whether the rule only moves on through ``PARAMS``
      mixes (DC-S3GD continues from the last mixed model), so that a
      schedule without any is refused.
  """

  name: str
  init: Callable[[Any], Any]
  grad_params: Callable[[Any, Any], Any]
  apply: Callable[..., tuple[Any, Any, Any]]
  message: Callable[[Any, Any], Any]
  receive: Callable[..., tuple[Any, Any]]
  mixes: str = PARAMS
  advance: Callable[..., tuple[Any, Any]] | None = None
  late_messages: bool = True
  push_sum: bool = False
  needs_param_mixes: bool = False


def optimizer_step(tx: optax.GradientTransformation, grads: Any, opt_state: Any, params: Any,
                   at: Any = None) -> tuple[Any, Any]:
  """``(params + updates, opt_state)`` for ``tx``'s update of ``grads``; ``at`` (default ``params``) is what
  ``tx`` sees as the parameters (weight decay, DC terms)."""
  updates, opt_state = tx.update(grads, opt_state, params if at is None else at)
  return optax.apply_updates(params, updates), opt_state


def no_extra(params: Any) -> tuple[()]:
  del params
  return ()


def params_themselves(params: Any, extra: Any) -> Any:
  del extra
  return params


def replace_params(params: Any, extra: Any, mixed: Any, self_weight: jax.Array, dt: jax.Array) -> tuple[Any, Any]:
  del params, self_weight, dt
  return mixed, extra


def plain_apply(tx, grads, opt_state, params, extra, dt):
  del dt
  params, opt_state = optimizer_step(tx, grads, opt_state, params)
  return params, opt_state, extra


# A mix averages when each receiving row of its weights sums to 1, up to this (the weights are float64).
_ROW_TOLERANCE = 1e-9


def check_method_schedule(method: GossipMethod, schedule: GossipSchedule) -> None:
  r"""Raises a ValueError naming the method and the schedule's paradigm when the method cannot run on it.

  The rules, from what each method's update does with a mix's weights
  :math:`W` (receiving rows only; a member that only sends keeps its value):

  - **A method without a push-sum weight** (``d_psgd``, ``ad_psgd``,
    ``gossip_grad``, ``dc_s3gd``, ``a2cid2``, ``layup``,
    ``accelerated_sgd``) sets :math:`x_a \leftarrow \sum_b W_{ab} x_b`. This
    is an average only when every row sums to 1 (row-stochastic): then
    identical replicas stay identical and consensus is a fixed point. The
    push-sum schedules of SGP are column-stochastic instead (a sender halves
    its mass and a receiver adds the half that arrives, rows summing to 1/2
    and 2), and without a weight to divide by, the mass each mix moves stays
    in the parameters: at learning rate 0, identical replicas of value 1
    drift apart (on a 6-step SGP schedule of 4 replicas they end between
    0.56 and 1.44, and in between their average is off 1 by the mass in
    flight). Refused.
  - **A push-sum method** (``sgp``) mixes its weight :math:`w` with the same
    :math:`W` and computes gradients at :math:`x / w`: the ratio is
    invariant to the mass each mix moves, so column-stochastic schedules are
    its own. On a row-stochastic schedule :math:`w` starts at 1 and stays 1
    (each row of :math:`W \mathbf 1` is 1, late messages included, since
    every past :math:`w` is 1), so :math:`x / w = x` and SGP is exactly
    D-PSGD on that schedule: that is right, and accepted.
  - **Gradient mixes** (``GRADS``, all-reduce and GossipGraD) average pending
    gradients for every method, with no weight to correct them: their rows
    must sum to 1 whatever the method (otherwise the step is rescaled).
  - A method that mixes gradients (``mixes == "gradients"``) needs a
    schedule without ``PARAMS`` mixes; one not defined for late messages
    needs ``lag == 0``; one that continues from its last mixed model
    (``needs_param_mixes``, DC-S3GD) needs at least one ``PARAMS`` mix, or
    each of its steps restarts from the initial model.

  Args:
    method: a :class:`GossipMethod`, e.g. ``dj.gossip.d_psgd()``.
    schedule: a ``dj.cluster.GossipSchedule``, e.g. from
      ``dj.cluster.simulate_gossip``.

  Raises:
    TypeError: if ``method`` or ``schedule`` is of another type.
    ValueError: if they disagree, naming both.

  Examples:
    >>> import delayjax as dj
    >>> sgp_schedule = dj.cluster.simulate_gossip(dj.cluster.sgp(), dj.cluster.workers(4), num_steps=3)
    >>> dj.gossip.check_method_schedule(dj.gossip.sgp(), sgp_schedule)  # its own paradigm
    >>> dj.gossip.check_method_schedule(dj.gossip.d_psgd(), sgp_schedule)
    Traceback (most recent call last):
    ...
    ValueError: method 'd_psgd' has no push-sum weight, so its mixes must average ...
  """
  if not isinstance(method, GossipMethod):
    raise TypeError(f"method must be a dj.gossip method (GossipMethod), e.g. dj.gossip.d_psgd(); got "
                    f"{type(method).__name__} {method!r}.")
  if not isinstance(schedule, GossipSchedule):
    raise TypeError(f"schedule must be a dj.cluster.GossipSchedule, got {type(schedule).__name__}.")
  paradigm = repr(schedule.paradigm) if schedule.paradigm else "(unnamed)"
  on = f"the schedule of paradigm {paradigm}"
  params_mixes = schedule.mixes == SCHEDULE_PARAMS
  if method.mixes == GRADS and np.any(params_mixes):
    raise ValueError(f"method {method.name!r} mixes gradients, but {on} has PARAMS mixes; use a schedule whose "
                     "mixes are GRADS (e.g. a GossipGraD paradigm).")
  if method.needs_param_mixes and not np.any(params_mixes):
    raise ValueError(f"method {method.name!r} continues from its last mixed model, but {on} has no PARAMS mixes: "
                     "every step would restart from the initial model; use a schedule with model mixes (e.g. "
                     "d_psgd or allreduce-style rounds of PARAMS mixes).")
  if not method.late_messages and np.any(schedule.lag > 0):
    raise ValueError(f"method {method.name!r} is not defined for late messages, but {on} has mixes with lag up to "
                     f"{int(schedule.lag.max())}; use a schedule without message lag (lag = 0).")
  rows = schedule.weights.sum(axis=2)
  off = schedule.receives & (np.abs(rows - 1.0) > _ROW_TOLERANCE)
  for kind, what in ((SCHEDULE_GRADS, "GRADS"), (SCHEDULE_PARAMS, "PARAMS")):
    if kind == SCHEDULE_PARAMS and method.push_sum:
      continue
    bad = off & (schedule.mixes == kind)[:, None]
    if not np.any(bad):
      continue
    k, a = (int(i[0]) for i in np.nonzero(bad))
    row = f"{what} mix {k} has a receiving row (replica {int(schedule.members[k, a])}) summing to {rows[k, a]:.6g}"
    if kind == SCHEDULE_GRADS:
      raise ValueError(f"{on} cannot run method {method.name!r}: its gradient mixes must average (each receiving "
                       f"row of the weights summing to 1), but {row}, which rescales the step.")
    raise ValueError(
        f"method {method.name!r} has no push-sum weight, so its mixes must average (each receiving row of the "
        f"weights summing to 1), but {on} has push-sum (column-stochastic) weights: {row}. Mixed so, the mass "
        f"each mix moves is never divided out and identical replicas drift apart. Run dj.gossip.sgp() on it, or {method.name} on a row-stochastic paradigm "
        "(d_psgd, ad_psgd, allreduce, gossipgrad).")
