"""Proximal steps for composite objectives (AsyProx-SVRG, ProxASAGA): L1, elastic net, box."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from delayjax.transforms._hyperparams import check_number, check_positive_rate, rate_at

ProxFn = Callable[[Any, Any], Any]


def _as(value: Any, x: jax.Array) -> jax.Array:
  return jnp.asarray(value, x.dtype)


def prox_l1(strength: float) -> ProxFn:
  r"""The proximal operator of :math:`R(w) = \lambda \|w\|_1` (soft thresholding).

  .. math::

    \text{prox}_{\gamma R}(x) = \text{sign}(x) \max(|x| - \gamma\lambda, 0)

  Args:
    strength: :math:`\lambda \ge 0`, a number or a scalar array.

  Returns:
    A function ``(x, step) -> prox_{step R}(x)`` on pytrees.
  """
  lam = check_number("strength", strength, minimum=0.0)

  def prox(tree, step):
    return jax.tree.map(lambda x: jnp.sign(x) * jnp.maximum(jnp.abs(x) - _as(step, x) * _as(lam, x), _as(0, x)), tree)

  return prox


def prox_elastic_net(l1: float, l2: float) -> ProxFn:
  r"""The proximal operator of :math:`R(w) = \lambda_1 \|w\|_1 + \frac{\lambda_2}{2} \|w\|_2^2`.

  .. math::

    \text{prox}_{\gamma R}(x) = \frac{\text{sign}(x) \max(|x| - \gamma\lambda_1, 0)}{1 + \gamma\lambda_2}

  Args:
    l1: :math:`\lambda_1 \ge 0`, a number or a scalar array.
    l2: :math:`\lambda_2 \ge 0`, a number or a scalar array.

  Returns:
    A function ``(x, step) -> prox_{step R}(x)`` on pytrees.
  """
  soft = prox_l1(l1)
  l2 = check_number("l2", l2, minimum=0.0)

  def prox(tree, step):
    return jax.tree.map(lambda z: z / (_as(1, z) + _as(step, z) * _as(l2, z)), soft(tree, step))

  return prox


def prox_box(lower: float | Any, upper: float | Any) -> ProxFn:
  r"""The proximal operator of the indicator of the box :math:`[l, u]`: the projection onto it.

  .. math::

    \text{prox}_{\gamma R}(x) = \min(\max(x, l), u)

  whatever :math:`\gamma`.

  Args:
    lower: :math:`l`, a float or a pytree like the parameters (``-inf`` allowed).
    upper: :math:`u`, the same, with :math:`l \le u` everywhere.

  Returns:
    A function ``(x, step) -> prox_{step R}(x)`` on pytrees.
  """
  lows, highs = jax.tree.leaves(lower), jax.tree.leaves(upper)
  for name, leaves in (("lower", lows), ("upper", highs)):
    if not leaves or any(np.isnan(np.asarray(v, np.float64)).any() for v in leaves):
      raise ValueError(f"{name} must be a number or a pytree of numbers without NaN, got {leaves!r}.")
  scalar = len(lows) == 1 and len(highs) == 1 and np.ndim(lows[0]) == 0 and np.ndim(highs[0]) == 0
  if scalar and float(lows[0]) > float(highs[0]):
    raise ValueError(f"lower must be <= upper, got lower={float(lows[0])} and upper={float(highs[0])}.")

  def prox(tree, step):
    del step
    if scalar:
      return jax.tree.map(lambda x: jnp.clip(x, _as(lows[0], x), _as(highs[0], x)), tree)
    low = jax.tree.map(lambda _: lows[0], tree) if len(lows) == 1 else lower
    high = jax.tree.map(lambda _: highs[0], tree) if len(highs) == 1 else upper
    return jax.tree.map(lambda x, lo, hi: jnp.clip(x, _as(lo, x), _as(hi, x)), tree, low, high)

  return prox


class ProximalState(NamedTuple):
  """State of :func:`proximal`."""

  count: jax.Array  # shape=(), int32: updates applied so far (indexes a learning-rate schedule)


def proximal(prox: ProxFn, learning_rate: float | optax.Schedule) -> optax.GradientTransformationExtraArgs:
  r"""Applies a proximal operator after the step: :math:`w^+ = \text{prox}_{\gamma R}(w + \Delta)`.

  Put it *last* in a chain whose step :math:`\Delta` has rate :math:`\gamma`,
  with the same rate here, e.g. proximal SVRG / SAGA for
  :math:`F(w) + R(w)`:

  .. math::

    w^+ = \text{prox}_{\gamma R}(w - \gamma v), \qquad
    \text{output} = w^+ - w

  ``optax.chain(dj.saga(n), optax.sgd(lr), dj.proximal(dj.prox_l1(lam), lr))``
  is ProxSAGA, and with stale reads ProxASAGA's dense form; with
  :func:`svrg` it is Prox-SVRG (Xiao & Zhang), and under stale reads
  AsyProx-SVRG's update (Meng et al.). The smooth part's gradients must not
  include :math:`R`. The prox is applied to the whole parameter vector at
  every update (the dense form); for sparse data, ProxASAGA's
  per-coordinate reweighted update on each sample's support is
  :func:`~delayjax.transforms.prox_asaga`.

  Args:
    prox: ``(x, step) -> prox_{step R}(x)`` on pytrees, e.g. :func:`prox_l1`,
      :func:`prox_elastic_net`, :func:`prox_box`.
    learning_rate: :math:`\gamma`, a number ``> 0``, a scalar array or a schedule of the
      update count; the same as the chained step's.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` that needs ``params``.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import delayjax as dj
    >>> tx = optax.chain(optax.sgd(0.5), dj.proximal(dj.prox_l1(1.0), 0.5))
    >>> w = jnp.array([2.0, 0.2])
    >>> u, _ = tx.update(jnp.array([1.0, 0.0]), tx.init(w), w)
    >>> w + u  # soft-threshold [1.5, 0.2] by 0.5
    Array([1., 0.], dtype=float32)

  References:
    Xiao, Zhang, `A Proximal Stochastic Gradient Method with Progressive
    Variance Reduction <https://arxiv.org/abs/1403.4699>`_, SIAM J. Optim. 2014.

    Meng, Chen, Yu, Wang, Ma, Liu, `Asynchronous Stochastic Proximal Optimization
    Algorithms with Variance Reduction <https://arxiv.org/abs/1609.08435>`_, AAAI 2017.

    Pedregosa, Leblond, Lacoste-Julien, `Breaking the Nonsmooth Barrier: A
    Scalable Parallel Method for Composite Optimization
    <https://arxiv.org/abs/1707.06468>`_, NeurIPS 2017.
  """
  if not callable(prox):
    raise TypeError(f"prox must be a callable (x, step) -> x, got {prox!r}.")
  learning_rate = check_positive_rate("learning_rate", learning_rate)

  def init_fn(params):
    del params
    return ProximalState(count=jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    if params is None:
      raise ValueError("proximal needs params: the prox is applied to params + updates.")
    step = rate_at(learning_rate, state.count)
    moved = prox(jax.tree.map(lambda w, u: w + u.astype(w.dtype), params, updates), step)
    out = jax.tree.map(lambda new, w, u: (new - w).astype(u.dtype), moved, params, updates)
    return out, ProximalState(count=optax.safe_increment(state.count))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
