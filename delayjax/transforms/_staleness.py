"""Staleness-dependent weights and the ``scale_by_staleness`` transformation."""

from __future__ import annotations

from typing import Any, Callable, Union

import jax
import jax.numpy as jnp
import optax

from delayjax._checks import check_float, check_int

StalenessFn = Callable[[jax.Array], jax.Array]
Rule = Union[str, StalenessFn]

# Each rule: its keyword arguments with defaults (None = required) and the weight it computes.
_RULE_ARGS: dict[str, dict[str, Any]] = {
    "inverse": {},
    "polynomial": {"a": 0.5},
    "hinge": {"a": 10.0, "b": 4},
    "exponential": {"a": 0.1},
    "constant": {"value": 1.0},
    "drop": {"threshold": None},
}
RULES = tuple(_RULE_ARGS)


def _rule_kwargs(rule: str, kwargs: dict[str, Any]) -> dict[str, Any]:
  allowed = _RULE_ARGS[rule]
  unknown = sorted(set(kwargs) - set(allowed))
  if unknown:
    names = ", ".join(allowed) if allowed else "none"
    raise TypeError(f"staleness rule {rule!r} got unexpected arguments {unknown}; it takes: {names}.")
  merged = {**allowed, **kwargs}
  missing = [k for k, v in merged.items() if v is None]
  if missing:
    raise TypeError(f"staleness rule {rule!r} needs the argument(s) {missing}.")
  return merged


def staleness_weight(rule: Rule = "inverse", **kwargs: Any) -> StalenessFn:
  r"""Returns ``s``, a function from staleness ``tau`` (int32) to a float32 weight.

  The rules (``tau >= 0``; every rule gives ``s(0) = 1`` at its defaults):

  * ``"inverse"``: :math:`s(\tau) = 1 / \max(\tau, 1)` — the step
    :math:`\alpha_0 / \tau` of staleness-aware ASGD (Zhang et al. 2016), with
    a fresh gradient treated as :math:`\tau = 1`.
  * ``"polynomial"`` (``a=0.5``): :math:`s(\tau) = (1 + \tau)^{-a}` —
    FedAsync's polynomial rule (Xie et al. 2019); ``a = 0.5`` is FedBuff's
    :math:`1/\sqrt{1 + \tau}` (Nguyen et al. 2022).
  * ``"hinge"`` (``a=10, b=4``): :math:`s(\tau) = 1` if :math:`\tau \le b`,
    else :math:`1 / (a (\tau - b) + 1)` — FedAsync's hinge rule.
  * ``"exponential"`` (``a=0.1``): :math:`s(\tau) = e^{-a \tau}`.
  * ``"constant"`` (``value=1.0``): :math:`s(\tau) = \text{value}`.
  * ``"drop"`` (``threshold`` required): :math:`s(\tau) = 1` if
    :math:`\tau \le \text{threshold}`, else 0 — TensorFlow's
    ``DropStaleGradientOptimizer``.
  * a callable ``tau -> weight``, traced with JAX (no Python control flow on
    ``tau``).

  Args:
    rule: a rule name or a callable.
    **kwargs: the rule's parameters, listed above.

  Returns:
    A jittable function of an int32 array giving float32 weights.

  Raises:
    ValueError: for an unknown rule name or out-of-range parameters.
    TypeError: for arguments the rule does not take, or a missing required one.
  """
  if callable(rule):
    if kwargs:
      raise TypeError(f"a callable staleness rule takes no keyword arguments, got {sorted(kwargs)}.")
    return lambda tau: jnp.asarray(rule(jnp.asarray(tau, jnp.int32)), jnp.float32)
  if not isinstance(rule, str) or rule not in _RULE_ARGS:
    raise ValueError(f"rule must be one of {', '.join(map(repr, RULES))} or a callable; got {rule!r}.")
  kw = _rule_kwargs(rule, kwargs)

  def as_float(tau):
    return jnp.asarray(tau, jnp.int32).astype(jnp.float32)

  if rule == "inverse":
    return lambda tau: 1.0 / jnp.maximum(as_float(tau), 1.0)
  if rule == "polynomial":
    a = check_float("a", kw["a"], minimum=0.0)
    return lambda tau: jnp.power(1.0 + as_float(tau), -a)
  if rule == "hinge":
    a = check_float("a", kw["a"], minimum=0.0)
    b = check_float("b", kw["b"], minimum=0.0)
    return lambda tau: jnp.where(as_float(tau) <= b, 1.0, 1.0 / (a * (as_float(tau) - b) + 1.0))
  if rule == "exponential":
    a = check_float("a", kw["a"], minimum=0.0)
    return lambda tau: jnp.exp(-a * as_float(tau))
  if rule == "constant":
    value = check_float("value", kw["value"])
    return lambda tau: jnp.full(jnp.shape(tau), value, jnp.float32)
  threshold = check_int("threshold", kw["threshold"], minimum=0)
  return lambda tau: jnp.where(jnp.asarray(tau, jnp.int32) <= threshold, 1.0, 0.0).astype(jnp.float32)


def broadcast_staleness(staleness: Any, updates: Any, name: str = "staleness") -> Any:
  """Returns one int32 staleness per leaf of ``updates``.

  ``staleness`` is a scalar shared by every leaf, or a pytree with the
  structure of ``updates`` (per-leaf, layer-wise staleness).

  Raises:
    ValueError: if ``staleness`` is missing or its tree does not match.
  """
  if staleness is None:
    raise ValueError(
        f"this transformation needs the extra argument {name}= (int32 scalar or a pytree matching the "
        f"updates); the delayjax runtimes pass it, a hand-written loop must pass it to update().")
  if not jax.tree_util.treedef_is_leaf(jax.tree.structure(staleness)):
    if jax.tree.structure(staleness) != jax.tree.structure(updates):
      raise ValueError(
          f"{name} must be a scalar or a pytree with the structure of the updates "
          f"{jax.tree.structure(updates)}; got {jax.tree.structure(staleness)}.")
    return jax.tree.map(lambda t: jnp.asarray(t, jnp.int32), staleness)
  if jnp.ndim(staleness) != 0:
    raise ValueError(f"{name} must be a scalar or a pytree of scalars, got shape {jnp.shape(staleness)}.")
  tau = jnp.asarray(staleness, jnp.int32)
  return jax.tree.map(lambda _: tau, updates)


def scale_by_staleness(rule: Rule = "inverse", **rule_kwargs: Any) -> optax.GradientTransformationExtraArgs:
  r"""Scales each update by a function of its staleness.

  .. math::

    u_t = s(\tau_t) \, g_t

  where :math:`\tau_t` is the ``staleness`` extra argument (a scalar, or a
  pytree of per-leaf values for layer-wise staleness) and :math:`s` a rule of
  :func:`staleness_weight`. A weight of zero gives an exactly zero update, even
  for a non-finite gradient. Put it before or after the base optimizer in an
  ``optax.chain``: before, it weights the gradient that enters the
  optimizer's statistics (momentum sees the damped gradient); after, it scales
  the step itself (``alpha_0 / tau`` of Zhang et al.).

  With ``staleness=0`` every built-in rule at its default parameters has
  :math:`s = 1` and the update is returned bit for bit.

  Args:
    rule: ``"inverse"``, ``"polynomial"``, ``"hinge"``, ``"exponential"``,
      ``"constant"``, ``"drop"`` or a callable ``tau -> weight``.
    **rule_kwargs: the rule's parameters (see :func:`staleness_weight`).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` that needs the ``staleness``
    extra argument.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import delayjax as dj
    >>> tx = optax.chain(dj.scale_by_staleness("inverse"), optax.sgd(0.1))
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.ones(2)}, state, params, staleness=4)
    >>> updates["w"]
    Array([-0.025, -0.025], dtype=float32)

  References:
    Zhang, Gupta, Lian, Liu, `Staleness-aware Async-SGD for Distributed Deep
    Learning <https://arxiv.org/abs/1511.05950>`_, IJCAI 2016;
    Xie, Koyejo, Gupta, `Asynchronous Federated Optimization
    <https://arxiv.org/abs/1903.03934>`_, 2019;
    Nguyen et al., `Federated Learning with Buffered Asynchronous Aggregation
    <https://arxiv.org/abs/2106.06639>`_, AISTATS 2022.
  """
  weight = staleness_weight(rule, **rule_kwargs)

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None, *, staleness=None, **extra_args):
    del params, extra_args
    taus = broadcast_staleness(staleness, updates)

    def scale(u, tau):
      w = weight(tau)
      return jnp.where(w != 0, u * w.astype(u.dtype), jnp.zeros_like(u))

    return jax.tree.map(scale, updates, taus), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)

