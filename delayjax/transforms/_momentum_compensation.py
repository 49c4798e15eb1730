"""Momentum compensation: Nesterov momentum whose look-ahead spans the delay (after Fang, Huang & Lin 2018)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from delayjax.transforms._extra_args import check_updates_like
from delayjax.transforms._hyperparams import (LearningRate, check_number, check_positive_rate, coefficient, descend,
                                              rate_at)
from delayjax.transforms._staleness import broadcast_staleness


class MomentumCompensationState(NamedTuple):
  """State of :func:`momentum_compensation`."""

  count: jax.Array  # shape=(), int32: updates applied so far (a schedule's step)
  momentum: Any  # pytree like params: the momentum m (sum of gradients, decayed by beta)
  lookahead: Any  # pytree like params' leaves, each shape=() int32: the delay the current parameters look ahead over


def lookahead_excess(beta: Any, delay: jax.Array, dtype: Any) -> jax.Array:
  r""":math:`c(\tau) - \beta = \sum_{i=2}^{\tau+1} \beta^i = \beta^2 (1 - \beta^\tau) / (1 - \beta)` in ``dtype``.

  Written so that it is exactly zero at :math:`\tau = 0` (then the rule is
  Optax's Nesterov bit for bit) and at :math:`\beta = 0`.
  """
  b = coefficient(beta, dtype)
  return b * b * (1 - jnp.power(b, delay.astype(dtype))) / (1 - b)


def momentum_compensation(
    learning_rate: LearningRate,
    momentum: float | jax.Array = 0.9,
) -> optax.GradientTransformationExtraArgs:
  r"""Nesterov momentum compensated for the delay: the parameters look ahead over the momentum of the delay.

  Nesterov's method evaluates the gradient at the look-ahead point
  :math:`y_t = x_t + \beta v_t`, where the momentum will carry the iterate
  :math:`x_t` in one update. A gradient that comes back :math:`\tau` updates
  after it was read should instead have been evaluated where the momentum
  carries the iterate by the time it is applied, :math:`\tau + 1` updates
  on: the parameters the workers read look ahead over
  :math:`c(\tau) = \sum_{i=1}^{\tau+1} \beta^i` momentum steps. With
  :math:`v_t = -\eta\, m_t` and a gradient :math:`g_t` of staleness
  :math:`\tau_t`:

  .. math::

    m_{t+1} = g_t + \beta m_t, \qquad x_{t+1} = x_t - \eta\, m_{t+1}, \qquad
    y_{t+1} = x_{t+1} - \eta\, c(\tau_t)\, m_{t+1},

    c(\tau) = \sum_{i=1}^{\tau+1} \beta^i = \frac{\beta (1 - \beta^{\tau+1})}{1 - \beta},

  and the parameters (the :math:`y` sequence, which the workers read) move by

  .. math::

    \Delta_t = y_{t+1} - y_t = -\eta \left[ g_t + \beta m_{t+1}
      + \bigl(c(\tau_t) - \beta\bigr) m_{t+1} - \bigl(c(\tau_{t-1}) - \beta\bigr) m_t \right]

  (:math:`\tau_{-1} = 0`). The staleness just seen predicts the next read's
  delay (exact for a constant delay, and for ``M`` round-robin workers).
  Why it helps: when the iterate moves mostly by momentum, a read at
  :math:`y_{t-\tau}` is, to first order in the gradient steps taken since,
  the point :math:`x_t + \beta v_t` where synchronous Nesterov evaluates its
  gradient at update :math:`t`. Without it, a stale gradient is evaluated
  :math:`\tau` momentum steps behind, and momentum tuned for the
  synchronous method oscillates or diverges. The look-ahead is bounded:
  :math:`c(\tau) < \beta / (1 - \beta)`, the whole remaining travel of the
  momentum. At staleness 0 (every :math:`\tau_t = 0`) the rule is
  ``optax.sgd(learning_rate, momentum, nesterov=True)`` bit for bit. A
  per-leaf ``staleness`` (layer-wise delays) gives each leaf its own look-ahead.
  With a schedule, :math:`\eta` is the current update's rate in :math:`\Delta_t`.

  **Only the paper's title and a third party's description of it could be
  read here**: the paper (arXiv 1802.09747) was not found in the search
  tools' page, code and documentation stores; the A2BCD paper (Hannah, Feng
  & Yin, ICLR 2019) describes it as accelerated schemes for asynchronous
  coordinate descent and SVRG "using momentum compensation techniques", with
  a complexity that keeps the accelerated :math:`\sqrt\kappa` and is
  :math:`\tau` times the serial one. The rule above, the look-ahead :math:`c(\tau)` and its derivation are
  the library's construction in the paper's spirit (acceleration whose
  momentum compensates the delay), not the paper's algorithm box or step
  sizes; its coordinate-descent and SVRG variants are not built. The step
  must shrink with the delay for stability (on a quadratic,
  :math:`\eta = 0.35 / (L (1 + \tau)^2)` in this library's reproduction,
  ``experiments/momentum_compensation.py``).

  Args:
    learning_rate: :math:`\eta`, a number ``> 0``, a scalar array or an Optax
      schedule of the update count.
    momentum: :math:`\beta`, in ``[0, 1)``, a number or a scalar array.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` that needs the extra
    argument ``staleness`` (the delayjax runtimes pass it).

  Examples:
    >>> import jax.numpy as jnp
    >>> import delayjax as dj
    >>> tx = dj.momentum_compensation(1.0, momentum=0.5)
    >>> state = tx.init(jnp.zeros(1))
    >>> u, state = tx.update(jnp.array([2.0]), state, staleness=2)
    >>> u  # m = 2, c(2) = 0.5 + 0.25 + 0.125: -(2 + 0.875 * 2)
    Array([-3.75], dtype=float32)

  References:
    Fang, Huang, Lin, `Accelerating Asynchronous Algorithms for Convex
    Optimization by Momentum Compensation <https://arxiv.org/abs/1802.09747>`_,
    arXiv 2018.
  """
  learning_rate = check_positive_rate("learning_rate", learning_rate)
  beta = check_number("momentum", momentum, minimum=0.0, maximum=1.0, strict_maximum=True)

  def init_fn(params):
    return MomentumCompensationState(
        count=jnp.zeros([], jnp.int32), momentum=jax.tree.map(jnp.zeros_like, params),
        lookahead=jax.tree.map(lambda _: jnp.zeros([], jnp.int32), params))

  def update_fn(updates, state, params=None, *, staleness=None, **extra_args):
    del params, extra_args
    check_updates_like("dj.momentum_compensation", updates, state.momentum, "momentum")
    delays = broadcast_staleness(staleness, updates)
    # Written in optax.trace's order (g + beta * m) so that staleness 0 matches optax.sgd bit for bit.
    new_momentum = jax.tree.map(lambda g, m: g + coefficient(beta, m.dtype) * m, updates, state.momentum)

    def direction(g, m_new, m_old, tau, tau_old):
      excess_new, excess_old = lookahead_excess(beta, tau, g.dtype), lookahead_excess(beta, tau_old, g.dtype)
      return (g + coefficient(beta, g.dtype) * m_new) + (excess_new * m_new - excess_old * m_old)

    step = rate_at(learning_rate, state.count)
    out = jax.tree.map(lambda g, m_new, m_old, tau, tau_old: descend(step, direction(g, m_new, m_old, tau, tau_old)),
                       updates, new_momentum, state.momentum, delays, state.lookahead)
    return out, MomentumCompensationState(count=optax.safe_increment(state.count), momentum=new_momentum,
                                          lookahead=delays)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
