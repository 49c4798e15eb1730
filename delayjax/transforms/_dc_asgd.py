"""Delay compensation: DC-ASGD-c and DC-ASGD-a (Zheng et al., ICML 2017), and with the inner optimizer's moment."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from delayjax._sharding import stacked_zeros
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
          mean_square=jax.tree.map(lambda p: stacked_zeros(p, num_workers), params))
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


class DelayCompensatedState(NamedTuple):
  """State of :func:`delay_compensated`: the inner optimizer's, whose second moment is the curvature."""

  inner_state: Any  # the wrapped optimizer's state


def _is_masked(x: Any) -> bool:
  return isinstance(x, optax.MaskedNode)


def _second_moments(inner_state: Any, params: Any) -> list[Any]:
  """Every ``nu`` field inside ``inner_state`` (Adam, RMSProp, AdaBelief, AMSGrad, ...) shaped like ``params``."""
  params_tree = jax.tree.structure(params)
  found: list[Any] = []

  def visit(x: Any) -> bool:
    # Called on every node while flattening, so a moment inside chains, masks and partitions is found.
    nu = getattr(x, "nu", None) if hasattr(x, "_fields") else None
    if nu is not None and jax.tree.structure(nu, is_leaf=_is_masked) == params_tree:
      found.append(nu)
    return False

  jax.tree.leaves(inner_state, is_leaf=visit)
  return found


def _inner_moment(inner_state: Any, params: Any) -> Any:
  """The inner optimizer's second moment, one leaf per parameter (``None`` where no state keeps one)."""
  moments = _second_moments(inner_state, params)
  if not moments:
    raise ValueError(
        "dj.delay_compensated found no second moment in its inner optimizer's state (a field named nu shaped "
        "like the parameters, as optax.adam, optax.rmsprop, optax.adabelief and optax.amsgrad keep): wrap an "
        "Adam-family optimizer, or pass moment=, a function of the inner state returning the curvature tree.")
  per_leaf = [jax.tree.leaves(nu, is_leaf=_is_masked) for nu in moments]
  merged = []
  for i, leaves in enumerate(zip(*per_leaf)):
    kept = [x for x in leaves if not _is_masked(x)]
    if len(kept) > 1:
      raise ValueError(
          f"dj.delay_compensated found {len(kept)} second moments for parameter leaf {i} in its inner optimizer's "
          f"state (several Adam-family states chained): pass moment=, a function of the inner state returning "
          f"the one to use.")
    merged.append(kept[0] if kept else None)
  return jax.tree.unflatten(jax.tree.structure(params), merged)


def delay_compensated(
    inner: optax.GradientTransformation,
    lam: float | jax.Array = 1.0,
    *,
    moment: Callable[[Any], Any] | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""DC-ASGD whose curvature is the inner optimizer's own running second moment.

  DC-ASGD (:func:`delay_compensation`) corrects a gradient :math:`g` computed
  at the stale parameters :math:`w_{bak}` with a diagonal Hessian estimate,
  the outer product :math:`g \odot g`. An Adam-family optimizer already keeps
  a running mean of :math:`g \odot g`, its second moment :math:`\nu`; this
  wrapper uses it instead, at no extra state:

  .. math::

    \tilde g = g + \lambda \, \nu \odot (w - w_{bak}), \qquad
    (u, s) = \text{inner}(\tilde g)

  :math:`\nu` is read from ``inner``'s state as it stands when the gradient
  arrives (before :math:`g` enters it): Adam's ``nu``, not bias-corrected,
  :math:`\nu_t = \beta_2 \nu_{t-1} + (1 - \beta_2) \tilde g_t^2`. It starts at
  zero, so the first update is not corrected. The inner optimizer's ``nu``
  is found by name anywhere in its state (through chains, ``inject_hyperparams``,
  masks and partitions); parameters that no second moment covers (the
  matrices of ``optax.contrib.muon``, which Adam's partition masks out) are
  not corrected, and ``moment`` picks a curvature tree by hand (``None``
  leaves are not corrected).

  When ``stale_params`` equals ``params`` (zero staleness) the correction is
  exactly zero and this is ``inner``, bit for bit.

  **Source.** The correction is DC-ASGD-c's (Zheng et al. 2017) with
  :math:`g \odot g` replaced by the optimizer's EMA of it. That replacement is
  not in the paper: it is the ``dc_asgd_ema`` corrector of marin's
  delayed-gradient harness (marin-community/marin, ``delay_optim.py``, which
  keeps an EMA of its own rather than reading the optimizer's).

  Args:
    inner: an Adam-family Optax optimizer (its state keeps ``nu``), or any
      optimizer with ``moment`` given. It receives the corrected gradient and
      every extra argument.
    lam: :math:`\lambda \ge 0`, a Python number or a scalar array.
    moment: optional function of ``inner``'s state returning the curvature,
      a pytree like the parameters.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` that needs ``params`` and
    the ``stale_params`` extra argument (``dj.delayed`` and the runtimes pass
    it).

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import delayjax as dj
    >>> tx = dj.delay_compensated(optax.rmsprop(0.1, decay=0.75), lam=1.0)
    >>> w = jnp.array([1.0])
    >>> u, state = tx.update(jnp.array([2.0]), tx.init(w), w, stale_params=w)
    >>> state.inner_state[0].nu  # 0.25 * 2 ** 2: the curvature of the next correction
    Array([1.], dtype=float32)
    >>> u, state = tx.update(jnp.array([2.0]), state, w, stale_params=w - 0.5)
    >>> state.inner_state[0].nu  # the gradient entered corrected: 0.75 * 1 + 0.25 * (2 + 1 * 1 * 0.5) ** 2
    Array([2.3125], dtype=float32)

  References:
    Zheng, Meng, Wang, Chen, Yu, Ma, Liu, `Asynchronous Stochastic Gradient
    Descent with Delay Compensation <https://arxiv.org/abs/1609.08326>`_,
    ICML 2017.
  """
  if not isinstance(inner, optax.GradientTransformation):
    raise TypeError(f"inner must be an optax.GradientTransformation, got {type(inner).__name__}.")
  lam = check_number("lam", lam, minimum=0.0)
  if moment is not None and not callable(moment):
    raise TypeError(f"moment must be a function of the inner optimizer's state, got {moment!r}.")
  inner = optax.with_extra_args_support(inner)
  find = _inner_moment if moment is None else (lambda state, params: moment(state))

  def init_fn(params):
    state = inner.init(params)
    find(state, params)  # an inner optimizer without a second moment is refused here, not at the first update
    return DelayCompensatedState(inner_state=state)

  def update_fn(updates, state, params=None, *, stale_params=None, **extra_args):
    params = require_extra("delay_compensated", "params", params)
    stale_params = require_extra("delay_compensated", "stale_params", stale_params)
    stale_params = like_updates("stale_params", stale_params, updates)
    nu = find(state.inner_state, params)

    def corrected(g, w, w_bak, v):
      if v is None or _is_masked(v):
        return g
      return g + coefficient(lam, g.dtype) * v.astype(g.dtype) * (w - w_bak)

    # Flattened by hand: a None or MaskedNode leaf of the curvature would otherwise be an empty subtree.
    treedef = jax.tree.structure(updates)
    curvature = jax.tree.leaves(nu, is_leaf=lambda x: x is None or _is_masked(x))
    if len(curvature) != treedef.num_leaves:
      raise ValueError(f"dj.delay_compensated: the curvature (moment) must have one leaf per parameter leaf, "
                       f"{treedef.num_leaves}; got {len(curvature)}.")
    grads = jax.tree.unflatten(treedef, [
        corrected(g, w, w_bak, v) for g, w, w_bak, v in zip(
            jax.tree.leaves(updates), jax.tree.leaves(params), jax.tree.leaves(stale_params), curvature)])
    u, inner_state = inner.update(grads, state.inner_state, params, stale_params=stale_params, **extra_args)
    return u, DelayCompensatedState(inner_state=inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
