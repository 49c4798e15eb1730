"""Local-SGD workers: a contribution is the pseudo-gradient of several local optimizer steps."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from delayjax._checks import check_int


def dylu_local_steps(speeds: Sequence[float] | np.ndarray, max_steps: int) -> np.ndarray:
  r"""DyLU's local steps per worker: proportional to its speed, the fastest taking ``max_steps``.

  .. math::  H_w = \max\left(1, \left\lfloor \frac{v_w}{\max_{w'} v_{w'}}\, H \right\rfloor\right)

  so that slow workers push after fewer local steps, as fast ones do after
  ``H``, and their pseudo-gradients are less stale.

  Args:
    speeds: :math:`v_w > 0`, one per worker (e.g. inverse mean compute times).
    max_steps: :math:`H \ge 1`, the fastest worker's local steps.

  Returns:
    int64 ``[M]``, for ``dj.simulate(..., worker=dj.workers.LocalSteps(steps, optimizer))``.

  Raises:
    ValueError: if ``speeds`` is not a non-empty 1-D array of finite positive
      numbers, or ``max_steps < 1``.

  Examples:
    >>> import delayjax as dj
    >>> dj.dylu_local_steps([2.0, 1.0, 0.3, 0.1], max_steps=8)  # floor(8 v / 2), at least 1
    array([8, 4, 1, 1])

  References:
    Liu, Chhaparia, Douillard, Kale, Rusu, Shen, Szlam, Ranzato,
    `Asynchronous Local-SGD Training for Language Modeling
    <https://arxiv.org/abs/2401.09135>`_, 2024 (Dynamic Local Updates).
  """
  max_steps = check_int("max_steps", max_steps, minimum=1)
  v = np.asarray(speeds, np.float64)
  if v.ndim != 1 or v.size == 0 or not np.all(np.isfinite(v)) or np.any(v <= 0):
    raise ValueError(f"speeds must be a non-empty 1-D array of finite numbers > 0, got {speeds!r}.")
  return np.maximum(1, np.floor(v / v.max() * max_steps)).astype(np.int64)


def local_pseudo_gradient(step_grad: Callable[[Any, jax.Array], tuple[jax.Array, Any]],
                          local_optimizer: optax.GradientTransformationExtraArgs, read: Any,
                          steps: jax.Array, max_steps: int, state: Any = None) -> tuple[jax.Array, Any, Any]:
  """Runs ``steps`` local optimizer steps from ``read``; returns the first step's loss, the pseudo-gradient
  and the local optimizer's final state.

  ``step_grad(w, h) -> (loss, grad)`` is local step ``h``'s minibatch
  gradient at ``w``. The optimizer starts from ``state``, or from
  ``local_optimizer.init(read)`` without one. The loop runs ``max_steps``
  (static) times, steps ``h >= steps`` masked, so lanes with different
  ``steps`` share one shape. The pseudo-gradient ``read - w_local`` is formed
  as ``-(d_0 + ... + d_{H-1})`` of the local updates ``d_h``, summed in that
  order: equal to it up to rounding, and exactly ``-d_0`` for one step, so one
  step of ``optax.sgd`` under an outer ``optax.sgd(1.0)`` is plain SGD bit
  for bit.
  """
  masked = not (isinstance(steps, int) and steps == max_steps)

  def body(carry, h):
    w, state, total = carry
    loss, grad = step_grad(w, h)
    delta, new_state = local_optimizer.update(grad, state, w)
    new = (optax.apply_updates(w, delta), new_state, jax.tree.map(jnp.add, total, delta))
    if masked:
      new = jax.tree.map(lambda n, o: jnp.where(h < steps, n, o), new, carry)
    return new, loss

  zeros = jax.tree.map(jnp.zeros_like, read)
  start = local_optimizer.init(read) if state is None else state
  (_, final, total), losses = jax.lax.scan(body, (read, start, zeros), jnp.arange(max_steps, dtype=jnp.int32))
  return losses[0], jax.tree.map(jnp.negative, total), final
