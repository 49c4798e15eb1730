"""Remedies for the staleness of asynchronous pipelines: SpecTrain's weight prediction and PipeMare.

In a pipeline each stage has its own optimizer; a stage's forward pass may
read an older version of its weights than the update its gradient meets, and
its backward pass yet another (see ``dj.cluster.pipeline``). The remedies here
act at two places:

- on the update, as ordinary Optax transformations (PipeMare's learning-rate
  rescheduling reads the stage's ``staleness``);
- on the *read*: the state of a transformation may define which weights a
  pass reads, through two methods (the :class:`ReadsStageWeights` protocol),
  which ``dj.simulate_pipeline`` calls: ``read_direction()``, a tree like
  the stage's parameters stored with each version, and
  ``read_steps(update, forward_version, backward_version)``, the number of
  steps ``s`` each pass moves along it. A pass at version ``v`` then reads
  :math:`w_v - s\\, d_v`.

The other pipeline remedies need no transformation of their own: PipeDream's
weight stashing and vertical sync, and ADL's accumulation over the delay, are
pipeline schedules (``dj.cluster.pipeline(..., weights=..., num_microbatches=...)``),
and the compensation of Diversely Stale Parameters is ``dj.delay_compensation``
fed the stage's ``stale_params`` by the pipeline runtime.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import optax

from delayjax.transforms._extra_args import check_updates_like, require_extra
from delayjax.transforms._hyperparams import (LearningRate, check_number, check_positive_rate, coefficient, descend,
                                              rate_at)
from delayjax.transforms._staleness import check_staleness

__all__ = ["ReadsStageWeights", "stage_read", "spectrain", "SpecTrainState", "pipemare", "PipeMareState",
           "PipeMareCorrectionState"]


@runtime_checkable
class ReadsStageWeights(Protocol):
  """An optimizer state that changes the weights a pipeline stage's passes read."""

  def read_direction(self) -> Any:
    ...

  def read_steps(self, update: Any, forward_version: Any, backward_version: Any) -> tuple[Any, Any]:
    ...


def _defines(x: Any) -> bool:
  return isinstance(x, ReadsStageWeights) and not isinstance(x, type)


def stage_read(opt_state: Any) -> ReadsStageWeights | None:
  """The state inside ``opt_state`` that defines a stage's pipeline reads, or ``None``.

  Raises:
    ValueError: if more than one state inside ``opt_state`` defines them.
  """
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=_defines) if _defines(x)]
  if len(found) > 1:
    raise ValueError(f"at most one transformation in a chain may define a stage's pipeline reads, found "
                     f"{len(found)}: {[type(x).__name__ for x in found]}.")
  return found[0] if found else None


class SpecTrainState(NamedTuple):
  """State of :func:`spectrain`; it predicts the weights a pass's gradient will meet."""

  count: jax.Array  # shape=(), int32: updates applied so far
  smoothed: Any  # pytree like params: the smoothed gradient v
  step: jax.Array  # shape=(), float32: the learning rate of the next update, eta

  def read_direction(self) -> Any:
    """:math:`\\eta v`, the step the next update is predicted to take."""
    return jax.tree.map(lambda v: self.step.astype(v.dtype) * v, self.smoothed)

  def read_steps(self, update: Any, forward_version: Any, backward_version: Any) -> tuple[Any, Any]:
    """Both passes predict the version of the update their gradient is applied at: ``update - version`` steps."""
    return update - forward_version, update - backward_version


def spectrain(learning_rate: LearningRate, smoothing: float = 0.9) -> optax.GradientTransformationExtraArgs:
  """SGD on the smoothed gradient, with SpecTrain's weight prediction for the pipeline's reads.

  .. math::
    v_t = \\gamma v_{t-1} + (1 - \\gamma) g_t, \\qquad w_{t+1} = w_t - \\eta v_t

  and a pass that reads version ``v`` of a stage whose gradient will be
  applied at update ``u`` computes at the predicted weights

  .. math::  \\hat w = w_v - (u - v)\\, \\eta\\, v_v

  (``v_v`` the smoothed gradient when version ``v`` was current): the weights
  ``u - v`` updates ahead, extrapolated along the smoothed gradient. Both the
  forward and the backward pass predict the same target version, so with an
  exact prediction they use the same weights. ``dj.simulate_pipeline`` makes
  the reads; with zero staleness no pass moves and this is SGD on the
  exponential moving average of the gradients (``optax.chain(optax.ema(gamma,
  debias=False), optax.scale(-eta))``).

  Source and status: the rule :math:`\\hat w = w - s\\, \\eta\\, v` with ``s`` the
  versions ahead and ``v`` the smoothed gradient follows the paper's
  description as its abstract summarizes it (the documentation's References page);
  the paper's full text was not reachable with the search tools
  available, so the smoothing :math:`v_t = \\gamma v_{t-1} + (1-\\gamma) g_t`
  (an exponential moving average, as in the paper's momentum-SGD setting)
  and its default ``gamma = 0.9`` are unverified against it.

  Args:
    learning_rate: :math:`\\eta`, a float, a scalar array or an Optax schedule.
    smoothing: :math:`\\gamma \\in [0, 1)`, a float or a scalar array.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state defines the
    pipeline reads.

  Examples:
    >>> import jax.numpy as jnp
    >>> import delayjax as dj
    >>> tx = dj.spectrain(0.1, smoothing=0.5)
    >>> params = {"w": jnp.zeros(2)}
    >>> updates, state = tx.update({"w": jnp.ones(2)}, tx.init(params), params)
    >>> updates["w"], state.read_direction()["w"]  # v = 0.5, -eta v; next prediction direction eta v
    (Array([-0.05, -0.05], dtype=float32), Array([0.05, 0.05], dtype=float32))

  References:
    Chen, Yang, Cheng, `Efficient and Robust Parallel DNN Training through
    Model Parallelism on Multi-GPU Platform <https://arxiv.org/abs/1809.02839>`_,
    arXiv 2018 (SpecTrain)
  """
  learning_rate = check_positive_rate("learning_rate", learning_rate)
  smoothing = check_number("smoothing", smoothing, minimum=0.0, maximum=1.0)
  if not isinstance(smoothing, jax.core.Tracer) and smoothing == 1.0:
    raise ValueError("smoothing must be < 1 (with 1 the smoothed gradient never changes), got 1.0.")

  def init_fn(params):
    return SpecTrainState(count=jnp.zeros([], jnp.int32), smoothed=jax.tree.map(jnp.zeros_like, params),
                          step=jnp.asarray(rate_at(learning_rate, jnp.zeros([], jnp.int32)), jnp.float32))

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    check_updates_like("dj.spectrain", updates, state.smoothed, "smoothed gradient")
    # optax.ema's arithmetic (debias=False): (1 - decay) * g + decay * v.
    smoothed = jax.tree.map(
        lambda g, v: coefficient(1 - smoothing, g.dtype) * g + coefficient(smoothing, v.dtype) * v, updates,
        state.smoothed)
    out = jax.tree.map(lambda v: descend(rate_at(learning_rate, state.count), v), smoothed)
    count = optax.safe_increment(state.count)
    return out, SpecTrainState(count=count, smoothed=smoothed,
                               step=jnp.asarray(rate_at(learning_rate, count), jnp.float32))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class PipeMareState(NamedTuple):
  """State of :func:`pipemare` without discrepancy correction."""

  count: jax.Array  # shape=(), int32: updates applied so far
  momentum: Any  # pytree like params: the momentum buffer (optax.sgd's trace)
  delta: Any  # pytree like params: the moving average of the weight changes, delta (zeros without correction)


class PipeMareCorrectionState(PipeMareState):
  """State of :func:`pipemare` with discrepancy correction: it moves the backward pass's weights."""

  def read_direction(self) -> Any:
    """:math:`\\delta`, the recent weight change per update."""
    return self.delta

  def read_steps(self, update: Any, forward_version: Any, backward_version: Any) -> tuple[Any, Any]:
    """The forward pass reads its version; the backward pass steps back to it: ``backward - forward`` steps."""
    return jnp.zeros_like(update), backward_version - forward_version


def _stage_staleness(name: str, value: Any, what: str) -> jax.Array:
  """A pipeline stage's (scalar) staleness extra argument as int32, refused as every staleness rule refuses it."""
  value = require_extra("pipemare", name, value, f"int32 scalar, {what}")
  if jnp.ndim(value) != 0:
    raise ValueError(f"{name} must be a scalar (one delay per stage), got shape {jnp.shape(value)}.")
  check_staleness(name, value)
  return jnp.asarray(value, jnp.int32)


def pipemare(
    learning_rate: LearningRate,
    *,
    warmup_steps: int,
    momentum: float = 0.0,
    discrepancy_decay: float | None = None,
) -> optax.GradientTransformationExtraArgs:
  """PipeMare: SGD whose step shrinks with the stage's delay early in training, and discrepancy correction.

  Learning-rate rescheduling (PipeMare's technique 1): stage ``i`` with
  forward delay :math:`\\tau_i` (``staleness``) takes, at update ``t``,

  .. math::
    \\alpha_{t,i} = \\alpha_t\\, \\max(\\tau_i, 1)^{-p_t}, \\qquad
    p_t = 1 - \\min(t / T, 1), \\qquad
    v_t = \\mu v_{t-1} + g_t, \\quad w_{t+1} = w_t - \\alpha_{t,i} v_t

  (``T = warmup_steps``): the step starts at :math:`\\alpha / \\tau_i` and
  reaches the base step :math:`\\alpha_t` after ``T`` updates, so the deepest,
  stalest stages start slowest. Discrepancy correction (technique 2, with
  ``discrepancy_decay`` ``D``): the state keeps the moving average of the
  weight changes,

  .. math::
    \\delta_{t+1} = \\gamma \\delta_t + (1 - \\gamma)(w_{t+1} - w_t), \\qquad
    \\gamma = D^{1 / \\max(\\tau^f - \\tau^b, 1)},

  and the backward pass, which reads a newer version :math:`b` than its
  forward pass's :math:`f`, reads instead :math:`w_b - (b - f)\\, \\delta_b`, an
  extrapolation back to the forward pass's weights (``dj.simulate_pipeline``
  makes the reads; ``backward_staleness`` gives :math:`\\tau^b`). With zero
  staleness this is ``optax.sgd(alpha, momentum)``, bit for bit.

  Source and status: the two techniques, their names and purpose are
  confirmed by the paper's abstract (reachable); the exact forms above — the
  exponent :math:`p_t = 1 - \\min(t/T, 1)`, the moving average of weight
  differences and its decay :math:`D^{1/(\\tau^f - \\tau^b)}` — follow the
  paper as recalled and could **not** be checked against its full text or the
  authors' code (``HazyResearch/pipemare`` was not available to the search
  tools). The clamp :math:`\\max(\\tau, 1)` is delayjax's, so that an
  undelayed stage keeps the base step.

  Args:
    learning_rate: :math:`\\alpha`, a float, a scalar array or an Optax schedule
      (each numeric argument below may also be a scalar array).
    warmup_steps: ``T >= 1``, updates over which the delay's exponent
      decays from 1 to 0.
    momentum: :math:`\\mu \\in [0, 1)`.
    discrepancy_decay: ``D`` in ``(0, 1)`` turns discrepancy correction on;
      ``None`` (default) leaves it off.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` that needs ``staleness``
    (and, with correction, ``backward_staleness``): int32 scalars, as every
    staleness rule takes them; a missing, negative, fractional or non-finite
    concrete one is a ``ValueError`` (a missing one is not taken as 0, which
    would silently run without the rescheduling). With correction its state
    defines the pipeline reads.

  Examples:
    >>> import jax.numpy as jnp
    >>> import delayjax as dj
    >>> tx = dj.pipemare(0.1, warmup_steps=100)
    >>> params = {"w": jnp.zeros(2)}
    >>> updates, _ = tx.update({"w": jnp.ones(2)}, tx.init(params), params, staleness=jnp.int32(4))
    >>> updates["w"]  # at t = 0 the step is alpha / tau
    Array([-0.025, -0.025], dtype=float32)

  References:
    Yang, Zhang, Li, Ré, Aberger, De Sa, `PipeMare: Asynchronous Pipeline
    Parallel DNN Training <https://arxiv.org/abs/1910.05124>`_, MLSys 2021
  """
  learning_rate = check_positive_rate("learning_rate", learning_rate)
  warmup_steps = check_number("warmup_steps", warmup_steps, minimum=1, integer=True)
  momentum = check_number("momentum", momentum, minimum=0.0, maximum=1.0)
  if not isinstance(momentum, jax.core.Tracer) and momentum == 1.0:
    raise ValueError("momentum must be < 1, got 1.0.")
  # A Python 0 skips the trace, as optax.sgd(momentum=0) does; an array (injected, swept) always keeps it.
  uses_momentum = not isinstance(momentum, (int, float)) or momentum != 0.0
  if discrepancy_decay is not None:
    discrepancy_decay = check_number("discrepancy_decay", discrepancy_decay, minimum=0.0, maximum=1.0,
                                     strict_minimum=True)
    if not isinstance(discrepancy_decay, jax.core.Tracer) and discrepancy_decay == 1.0:
      raise ValueError("discrepancy_decay must be < 1 (1 never updates the moving average), got 1.0.")

  state_type = PipeMareState if discrepancy_decay is None else PipeMareCorrectionState

  def init_fn(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    return state_type(count=jnp.zeros([], jnp.int32), momentum=zeros, delta=zeros)

  def update_fn(updates, state, params=None, *, staleness=None, backward_staleness=None, **extra_args):
    del params, extra_args
    check_updates_like("dj.pipemare", updates, state.momentum, "momentum")
    tau_f = _stage_staleness("staleness", staleness, "the stage's forward delay")
    if discrepancy_decay is None:
      # Without correction the backward delay is not used; one given is still checked.
      tau_b = (jnp.zeros([], jnp.int32) if backward_staleness is None
               else _stage_staleness("backward_staleness", backward_staleness, "the stage's backward delay"))
    else:
      tau_b = _stage_staleness("backward_staleness", backward_staleness,
                               "the stage's backward delay, for discrepancy correction")
    # optax.sgd's trace arithmetic: v <- g + mu v (the first update is g itself).
    trace = updates
    if uses_momentum:
      trace = jax.tree.map(lambda g, v: g + coefficient(momentum, v.dtype) * v, updates, state.momentum)
    exponent = 1.0 - jnp.minimum(state.count.astype(jnp.float32) / coefficient(warmup_steps, jnp.float32), 1.0)
    scale = jnp.power(jnp.maximum(tau_f, 1).astype(jnp.float32), -exponent)
    base = rate_at(learning_rate, state.count)
    out = jax.tree.map(lambda v: descend(base, scale.astype(v.dtype) * v), trace)
    delta = state.delta
    if discrepancy_decay is not None:
      gap = jnp.maximum(tau_f - tau_b, 1).astype(jnp.float32)
      gamma = jnp.power(coefficient(discrepancy_decay, jnp.float32), 1.0 / gap)
      delta = jax.tree.map(lambda d, u: gamma.astype(d.dtype) * d + (1 - gamma).astype(d.dtype) * u, delta, out)
    new_momentum = trace if uses_momentum else state.momentum
    return out, state_type(count=optax.safe_increment(state.count), momentum=new_momentum, delta=delta)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
