"""Zeno++: accept a stale gradient only if it passes a descent test on a validation gradient."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from delayjax.transforms._extra_args import like_updates, require_extra
from delayjax.transforms._hyperparams import check_number, coefficient


class ZenoState(NamedTuple):
  """State of :func:`zeno_plus_plus`."""

  count: jax.Array  # shape=(), int32: candidate gradients tested
  accepted: jax.Array  # shape=(), int32: candidates that passed the test
  inner_state: Any  # the inner optimizer's state, untouched by rejected candidates

  def runtime_inputs(self) -> tuple[str, ...]:
    # dj.simulate finds this (dj.transforms.runtime_inputs) and passes zeno_grad to every update.
    return ("zeno_grad",)


def _dot(a: Any, b: Any) -> jax.Array:
  # Elementwise products summed per leaf, not jnp.vdot: vdot flattens each leaf, which gathers a sharded
  # parameter onto every device (and is refused on a mesh of explicit axes).
  return sum((jnp.sum(x * y).astype(jnp.float32) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))),
             jnp.zeros([], jnp.float32))


def zeno_plus_plus(
    learning_rate: float | jax.Array,
    rho: float | jax.Array = 0.0,
    eps: float | jax.Array = 0.0,
    *,
    inner: optax.GradientTransformation | None = None,
    normalize: bool = True,
) -> optax.GradientTransformationExtraArgs:
  r"""Zeno++: a stale (possibly Byzantine) gradient is applied only if it passes a descent test.

  The server holds :math:`v`, a gradient of the loss on a small validation
  batch at the *current* parameters, passed as the extra argument
  ``zeno_grad``. A candidate :math:`g` (computed at stale parameters, or
  forged) is first rescaled to the validation gradient's norm, then scored:

  .. math::

    \tilde g = \frac{\|v\|}{\|g\|}\, g, \qquad
    \text{score} = \gamma \langle v, \tilde g \rangle - \rho \|g\|^2 + \gamma \epsilon

  and accepted iff :math:`\text{score} \ge 0`, i.e.
  :math:`\gamma \langle v, \tilde g\rangle - \rho\|g\|^2 \ge -\gamma\epsilon`:
  the first-order estimate of the validation-loss descent of the step
  :math:`-\gamma\tilde g`, minus a penalty on its size, must not fall below
  :math:`-\gamma\epsilon`. An accepted :math:`\tilde g` goes to the inner
  optimizer (default ``optax.sgd(learning_rate)``, the paper's server); a
  rejected one gives an exactly zero update and leaves the inner state
  unchanged. Norms and inner products are over the whole pytree.

  Source: the authors' code (github.com/xcgoner/iclr2020_zeno_async,
  ``train_cifar10.py``): it rescales the candidate to the validation
  gradient's norm and computes the score as above — note that its
  :math:`\rho` term uses the candidate's squared norm *before* rescaling,
  which this implementation follows; defaults ``rho = 0`` and ``eps = 0``
  are that script's. The paper's text could not be read with the search
  tools available. The paper refreshes the validation gradient only every
  few updates, on a fresh validation batch; here it is the caller's input.
  The state requests it through the ``runtime_inputs`` hook, so
  ``dj.simulate`` computes it for every update (a gradient at the current
  server parameters on a fresh minibatch); other loops pass it themselves.

  With ``normalize=False`` the candidate is not rescaled; with a large
  ``eps`` every candidate passes and the result is the inner optimizer's,
  bit for bit.

  Args:
    learning_rate: :math:`\gamma`, the server step in the score (and of the
      default inner optimizer), ``> 0``; a number or a scalar array.
    rho: :math:`\rho \ge 0`, the weight of the step-size penalty (a number
      or a scalar array).
    eps: :math:`\epsilon \ge 0`, the tolerated ascent (a number or a scalar
      array).
    inner: the server optimizer for accepted candidates; default
      ``optax.sgd(learning_rate)``.
    normalize: rescale the candidate to :math:`\|v\|` before scoring and
      applying it.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` that needs the
    ``zeno_grad`` extra argument (a pytree like the updates).

  Examples:
    >>> import jax.numpy as jnp
    >>> import delayjax as dj
    >>> tx = dj.zeno_plus_plus(0.5)
    >>> state = tx.init(jnp.zeros(2))
    >>> v = jnp.array([1.0, 0.0])
    >>> u, state = tx.update(jnp.array([-3.0, 0.0]), state, zeno_grad=v)  # ascent: rejected
    >>> u
    Array([0., 0.], dtype=float32)
    >>> u, state = tx.update(jnp.array([3.0, 4.0]), state, zeno_grad=v)  # rescaled to norm 1
    >>> u
    Array([-0.3, -0.4], dtype=float32)

  References:
    Xie, Koyejo, Gupta, `Zeno++: Robust Fully Asynchronous SGD
    <https://arxiv.org/abs/1903.07020>`_, ICML 2020.
  """
  gamma = check_number("learning_rate", learning_rate, minimum=0.0, strict_minimum=True)
  rho = check_number("rho", rho, minimum=0.0)
  eps = check_number("eps", eps, minimum=0.0)
  if not isinstance(normalize, bool):
    raise TypeError(f"normalize must be a bool, got {normalize!r}.")
  if inner is not None and not isinstance(inner, optax.GradientTransformation):
    raise TypeError(f"inner must be None or an optax.GradientTransformation (the server optimizer), got "
                    f"{type(inner).__name__} {inner!r}.")
  inner = optax.with_extra_args_support(optax.sgd(gamma) if inner is None else inner)

  def init_fn(params):
    zero = jnp.zeros([], jnp.int32)
    return ZenoState(count=zero, accepted=zero, inner_state=inner.init(params))

  def update_fn(updates, state, params=None, *, zeno_grad=None, **extra_args):
    require_extra("zeno_plus_plus", "zeno_grad", zeno_grad,
                  "the gradient of a validation batch at the current params, a pytree like the updates")
    zeno_grad = like_updates("zeno_grad", zeno_grad, updates)
    g_sq = _dot(updates, updates)
    if normalize:
      v_norm = jnp.sqrt(_dot(zeno_grad, zeno_grad))
      # A zero candidate stays zero instead of becoming 0/0.
      c = jnp.where(g_sq > 0, v_norm / jnp.sqrt(jnp.where(g_sq > 0, g_sq, 1.0)), 0.0)
      candidate = jax.tree.map(lambda g: c.astype(g.dtype) * g, updates)
    else:
      candidate = updates
    f32 = jnp.float32
    floats = isinstance(gamma, float) and isinstance(eps, float)
    slack = coefficient(gamma * eps, f32) if floats else coefficient(gamma, f32) * coefficient(eps, f32)
    score = coefficient(gamma, f32) * _dot(zeno_grad, candidate) - coefficient(rho, f32) * g_sq + slack
    accept = score >= 0
    inner_updates, inner_state = inner.update(candidate, state.inner_state, params, **extra_args)
    out = jax.tree.map(lambda u: jnp.where(accept, u, jnp.zeros_like(u)), inner_updates)
    return out, ZenoState(
        count=optax.safe_increment(state.count),
        accepted=state.accepted + accept.astype(jnp.int32),
        inner_state=optax.tree_utils.tree_where(accept, inner_state, state.inner_state))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
