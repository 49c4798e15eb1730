"""Weight prediction: workers compute their gradient at the weights it will be applied to, extrapolated."""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from delayjax import delays as delays_lib
from delayjax.transforms._extra_args import check_updates_like

__all__ = ["WeightPredictionState", "weight_prediction"]


class WeightPredictionState(NamedTuple):
  """State of :func:`weight_prediction`; its ``read_params`` gives the predicted weights."""

  last_update: Any  # pytree like params: the last update inner returned, -lr * Delta W (zeros before the first)
  horizon: Any  # pytree like params of float32 scalars: how many updates ahead each leaf is predicted
  inner_state: Any  # the wrapped optimizer's state

  def read_params(self, params: Any, worker: Any) -> Any:
    """:math:`\\hat w = w + \\tau\\, u_{last}` per leaf, the same for every worker."""
    del worker
    return jax.tree.map(lambda w, u, h: w + h.astype(w.dtype) * u.astype(w.dtype), params, self.last_update,
                        self.horizon)


def _horizon_tree(horizon: Any, params: Any) -> Any:
  """``horizon`` as one float32 scalar per leaf of ``params``, or a TypeError / ValueError naming it."""
  if isinstance(horizon, delays_lib.DelayModel):
    # A delay model's mean is the expected number of updates between a read and its gradient's update.
    models = delays_lib.leaf_models(horizon, params)
    return jax.tree.map(lambda m, _: jnp.float32(m.mean()), models, params,
                        is_leaf=lambda x: isinstance(x, delays_lib.DelayModel))

  def one(h, sub):
    if isinstance(h, bool) or not isinstance(h, numbers.Real) or not np.isfinite(h) or h < 0:
      raise ValueError(f"horizon must be a number >= 0 of updates ahead (or a pytree of them, or a delay model "
                       f"from dj.delays), got {h!r}.")
    return jax.tree.map(lambda _: jnp.float32(h), sub)

  try:
    return jax.tree.map(one, horizon, params)
  except ValueError as e:
    if "horizon must be" in str(e):
      raise
    raise ValueError(f"horizon's tree {jax.tree.structure(horizon)} is not a prefix of the parameter tree "
                     f"{jax.tree.structure(params)}: {e}") from None


def weight_prediction(inner: optax.GradientTransformation, horizon: Any) -> optax.GradientTransformationExtraArgs:
  r"""Has workers compute their gradient at the weights it will meet, extrapolated along the last update.

  A gradient read now and applied :math:`\tau` updates later meets weights
  that have moved by about :math:`\tau` more updates. With the last update
  ``inner`` returned, :math:`u_{last} = -\eta\, \Delta W` (for Muon the
  orthogonalized step, for Adam the preconditioned one), the worker reads

  .. math::

    \hat w = w - \tau\, \eta\, \Delta W = w + \tau\, u_{last}

  through the ``read_params`` hook (``dj.read_params(state, params)``; the
  runtimes call it at each read) while the update is applied at the real
  weights: ``update`` is ``inner``'s, unchanged. With :math:`\tau = 0`, or
  before the first update (:math:`u_{last} = 0`), workers read the current
  weights. In a hand-written loop around ``dj.delayed``, compute the gradient
  at ``dj.read_params(opt_state, params)``.

  :math:`\tau` is fixed per leaf: a number, a pytree of numbers (a prefix of
  the parameters: one horizon per pipeline stage), or a delay model from
  ``dj.delays``, whose mean is used (a ``per_leaf`` model gives each leaf its
  own, e.g. from ``dj.delays.by_path``).

  **Source.** Predicting the weights a delayed gradient will meet is the
  idea of SpecTrain (Chen et al. 2018) and XPipe (Guan et al. 2019); **only
  their abstracts were reachable, so their exact predictors are not
  reproduced here.** The rule implemented, the last update of any optimizer
  times the delay (post-orthogonalization for Muon), is the ``weight_pred``
  corrector of marin's delayed-gradient harness (marin-community/marin,
  ``delay_optim.py``).

  Args:
    inner: the optimizer whose updates are applied and extrapolated.
    horizon: :math:`\tau \ge 0`: a number, a pytree of numbers, or a delay model.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state defines
    ``read_params``.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import delayjax as dj
    >>> tx = dj.weight_prediction(optax.sgd(0.1), horizon=3)
    >>> w = jnp.array([1.0])
    >>> u, state = tx.update(jnp.array([2.0]), tx.init(w), w)
    >>> dj.read_params(state, w + u)  # 0.8 + 3 * (-0.2)
    Array([0.19999999], dtype=float32)

  References:
    Chen, Yang, Cheng, `Efficient and Robust Parallel DNN Training through
    Model Parallelism on Multi-GPU Platform <https://arxiv.org/abs/1809.02839>`_,
    arXiv 2018 (SpecTrain).

    Guan, Yin, Li, Lu, `XPipe: Efficient Pipeline Model Parallelism for
    Multi-GPU DNN Training <https://arxiv.org/abs/1911.04610>`_, arXiv 2019.
  """
  if not isinstance(inner, optax.GradientTransformation):
    raise TypeError(f"inner must be an optax.GradientTransformation, got {type(inner).__name__}.")
  if not isinstance(horizon, delays_lib.DelayModel):
    # Checked once against a tree of one leaf, so bad numbers fail here rather than at init.
    jax.tree.map(lambda h: _horizon_tree(h, 0.0), horizon)
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    return WeightPredictionState(last_update=jax.tree.map(jnp.zeros_like, params),
                                 horizon=_horizon_tree(horizon, params), inner_state=inner.init(params))

  def update_fn(updates, state, params=None, **extra_args):
    check_updates_like("dj.weight_prediction", updates, state.last_update, "last update")
    u, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
    return u, state._replace(last_update=jax.tree.map(lambda x, old: x.astype(old.dtype), u, state.last_update),
                             inner_state=inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
