"""Delay compensation: DC-ASGD-c and DC-ASGD-a (Zheng et al., ICML 2017)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from delayjax.transforms._extra_args import check_worker, like_updates, nan_unless, require_extra
from delayjax.transforms._hooks import table_rows
from delayjax.transforms._hyperparams import check_number, check_static_int, coefficient
from delayjax.transforms._rows import written_row


class DelayCompensationState(NamedTuple):
  """State of :func:`delay_compensation`."""

  mean_square: Any  # pytree like params; () when not adaptive


class PerWorkerDelayCompensationState(DelayCompensationState):
  """State of :func:`delay_compensation` with ``adaptive=True`` and ``num_workers``: one mean square per worker."""

  # mean_square: pytree, [num_workers, *shape] per leaf: row m is worker m's mean square

  def worker_capacity(self) -> int | None:
    return table_rows(self.mean_square)


def delay_compensation(
    lam: float | jax.Array | None = None,
    *,
    adaptive: bool = False,
    momentum: float | jax.Array = 0.95,
    eps: float | jax.Array = 1e-7,
    num_workers: int | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Compensates a stale gradient with a first-order Taylor term (DC-ASGD).

  A gradient :math:`g` computed at the stale parameters :math:`w_{bak}`
  (``stale_params``) is corrected towards the gradient at the current
  parameters :math:`w` with the diagonal outer-product approximation of the
  Hessian:

  .. math::

    \text{DC-ASGD-c:}\quad \tilde g = g + \lambda \, g \odot g \odot (w - w_{bak})

  With ``adaptive=True`` (DC-ASGD-a) the coefficient follows a running mean
  square of the gradient, updated before it is used:

  .. math::

    MS \leftarrow \mu \, MS + (1 - \mu) \, g \odot g, \qquad
    \tilde g = g + \frac{\lambda}{\sqrt{MS + \epsilon}} \, g \odot g \odot (w - w_{bak})

  ``MS`` starts at zero. With ``num_workers`` it is kept per worker and
  selected by the ``worker`` extra argument, as in the authors' parameter
  server (Multiverso's ``DCASGDAUpdater``); without it one ``MS`` is shared
  (what a single-process wrapper such as ``dj.delayed`` can offer). The output
  is a gradient: put this transformation *before* the base optimizer in an
  ``optax.chain`` (the paper uses plain SGD,
  ``optax.chain(delay_compensation(...), optax.sgd(lr))``).

  When ``stale_params`` equals ``params`` (zero staleness) the correction
  is exactly zero and the gradient passes through bit for bit.

  Per gradient: the correction uses the gradient's own backup weights
  :math:`w_{bak}` (and, per worker, its worker's mean square), as the
  paper's parameter server does for each push. When an update averages
  several gradients read at different versions (n-softsync, K-async),
  ``optax.chain(dj.per_contribution(dj.delay_compensation(...)), ...)``
  corrects each with its own ``stale_params`` and ``worker`` before they are
  combined; used directly, it corrects the combined gradient with the one
  ``stale_params`` it is given.

  Hyper-parameters (``lam``, ``momentum``, ``eps``) are Python numbers or
  scalar arrays, so ``optax.inject_hyperparams`` can change them between
  steps and ``jax.vmap`` can sweep them; ``num_workers`` sizes the state and
  must be a Python int (with ``inject_hyperparams``, name it in
  ``static_args``).

  Args:
    lam: the variance-control parameter :math:`\lambda` (``>= 0``). Defaults
      to 2.0 with ``adaptive=True`` (the paper's :math:`\lambda_0` for
      CIFAR-10) and 0.04 otherwise (MXNet's ``DCASGD`` default).
    adaptive: use DC-ASGD-a instead of DC-ASGD-c.
    momentum: :math:`\mu` of the mean square, in ``[0, 1)``.
    eps: :math:`\epsilon` under the square root, ``>= 0``.
    num_workers: keep one mean square per worker (needs ``worker=``); only
      used with ``adaptive=True``.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` that needs ``params`` and the
    ``stale_params`` extra argument (and ``worker`` with ``num_workers``).

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import delayjax as dj
    >>> tx = optax.chain(dj.delay_compensation(0.5), optax.sgd(1.0))
    >>> w, w_read = jnp.array([1.0]), jnp.array([0.0])
    >>> updates, _ = tx.update(jnp.array([2.0]), tx.init(w), w, stale_params=w_read)
    >>> updates  # -(2 + 0.5 * 2 * 2 * (1 - 0))
    Array([-4.], dtype=float32)

  References:
    Zheng, Meng, Wang, Chen, Yu, Ma, Liu, `Asynchronous Stochastic Gradient
    Descent with Delay Compensation <https://arxiv.org/abs/1609.08326>`_,
    ICML 2017.
  """
  if lam is None:
    lam = 2.0 if adaptive else 0.04
  lam = check_number("lam", lam, minimum=0.0)
  if not isinstance(adaptive, bool):
    raise TypeError(f"adaptive must be a bool, got {adaptive!r}.")
  # mu = 1 would freeze the mean square at zero.
  mu = check_number("momentum", momentum, minimum=0.0, maximum=1.0, strict_maximum=True)
  eps = check_number("eps", eps, minimum=0.0)
  if num_workers is not None:
    num_workers = check_static_int("num_workers", num_workers, minimum=1)
  per_worker = adaptive and num_workers is not None

  def init_fn(params):
    if not adaptive:
      return DelayCompensationState(mean_square=())
    if per_worker:
      return PerWorkerDelayCompensationState(
          mean_square=jax.tree.map(lambda p: jnp.zeros((num_workers,) + jnp.shape(p), jnp.result_type(p)), params))
    else:
      ms = jax.tree.map(jnp.zeros_like, params)
    return DelayCompensationState(mean_square=ms)

  def update_fn(updates, state, params=None, *, stale_params=None, worker=None, **extra_args):
    del extra_args
    params = require_extra("delay_compensation", "params", params)
    stale_params = require_extra("delay_compensation", "stale_params", stale_params)
    stale_params = like_updates("stale_params", stale_params, updates)
    diff = jax.tree.map(lambda w, w_bak: w - w_bak, params, stale_params)
    if not adaptive:
      out = jax.tree.map(lambda g, d: g + coefficient(lam, g.dtype) * g * g * d, updates, diff)
      return out, state

    def mean_square(old):
      return jax.tree.map(
          lambda ms, g: coefficient(mu, ms.dtype) * ms + coefficient(1.0 - mu, ms.dtype) * g * g, old, updates)

    in_range = None
    if per_worker:
      m, in_range = check_worker("delay_compensation", worker, num_workers)
      table = written_row(state.mean_square, m, mean_square)
      new = jax.tree.map(lambda ms: ms[m], table)
    else:
      new = table = mean_square(state.mean_square)
    out = jax.tree.map(
        lambda g, d, ms: g + nan_unless(in_range, coefficient(lam, ms.dtype), ms.dtype)
        / jnp.sqrt(ms + coefficient(eps, ms.dtype)) * g * g * d,
        updates, diff, new)
    return out, type(state)(mean_square=table)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
