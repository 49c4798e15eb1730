"""Staleness-dependent weights and the ``scale_by_staleness`` transformation."""

from __future__ import annotations

from typing import Any, Callable, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from delayjax.transforms._extra_args import masked_like
from delayjax.transforms._hyperparams import check_number

StalenessFn = Callable[[jax.Array], jax.Array]

# Staleness is int32 in the traced code (every rule casts it): the largest value it can hold.
MAX_STALENESS = 2**31 - 1
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
    **kwargs: the rule's parameters, listed above: Python numbers or scalar
      arrays (traced ones too: ``jax.vmap`` sweeps, ``optax.inject_hyperparams``);
      concrete values are checked.

  Returns:
    A jittable function of an int32 array giving float32 weights; it
    refuses a concrete staleness that is negative or not an integer.

  Raises:
    ValueError: for an unknown rule name or out-of-range parameters.
    TypeError: for arguments the rule does not take, or a missing required one.
  """
  if callable(rule):
    if kwargs:
      raise TypeError(f"a callable staleness rule takes no keyword arguments, got {sorted(kwargs)}.")
    return _checked(lambda tau: _callable_weight(rule, tau))
  if not isinstance(rule, str) or rule not in _RULE_ARGS:
    raise ValueError(f"rule must be one of {', '.join(map(repr, RULES))} or a callable; got {rule!r}.")
  kw = _rule_kwargs(rule, kwargs)

  def as_float(tau):
    return jnp.asarray(tau, jnp.int32).astype(jnp.float32)

  def f32(value):
    # A Python float or an (injected, traced) array parameter, in the weights' dtype.
    return jnp.asarray(value, jnp.float32)

  if rule == "inverse":
    return _checked(lambda tau: 1.0 / jnp.maximum(as_float(tau), 1.0))
  if rule == "polynomial":
    a = check_number("a", kw["a"], minimum=0.0)
    return _checked(lambda tau: jnp.power(1.0 + as_float(tau), -f32(a)))
  if rule == "hinge":
    a = check_number("a", kw["a"], minimum=0.0)
    b = check_number("b", kw["b"], minimum=0.0)
    return _checked(lambda tau: jnp.where(as_float(tau) <= f32(b), 1.0, 1.0 / (f32(a) * (as_float(tau) - f32(b)) + 1.0)))
  if rule == "exponential":
    a = check_number("a", kw["a"], minimum=0.0)
    return _checked(lambda tau: jnp.exp(-f32(a) * as_float(tau)))
  if rule == "constant":
    value = check_number("value", kw["value"])
    return _checked(lambda tau: jnp.full(jnp.shape(tau), value, jnp.float32))
  threshold = check_number("threshold", kw["threshold"], minimum=0, integer=True)
  return _checked(lambda tau: jnp.where(jnp.asarray(tau, jnp.int32) <= jnp.asarray(threshold, jnp.int32), 1.0,
                                        0.0).astype(jnp.float32))


def _callable_weight(rule: StalenessFn, tau: Any) -> jax.Array:
  """A callable rule's weights as float32, refused by name when it returns something that is not numeric."""
  out = rule(jnp.asarray(tau, jnp.int32))
  try:
    return jnp.asarray(out, jnp.float32)
  except (TypeError, ValueError):
    raise TypeError(f"rule, a callable, must return a number or a numeric array (the weight of each staleness), "
                    f"got {out!r} of type {type(out).__name__}.") from None


def _checked(weight: StalenessFn) -> StalenessFn:
  """``weight``, refusing a concrete staleness that is negative or not an integer (see :func:`check_staleness`)."""

  def checked(tau):
    check_staleness("staleness", tau)
    return weight(tau)

  return checked


def check_staleness(name: str, staleness: Any) -> None:
  """Raises unless every concrete value in ``staleness`` (a number, an array or a pytree of them) is an integer
  in ``[0, 2**31 - 1]``.

  A float with an integer value (``3.0``) is accepted; ``2.7``, ``-3``, NaN
  and booleans are not, nor a value of ``2**31`` or more: the rules cast
  staleness to int32, where ``2**32 + 5`` would act as 5 and ``1e10`` as a
  negative number. The message shows the value as given. Traced values (inside ``jit``, ``vmap`` or
  ``lax.scan``) cannot be checked: they are cast to int32 as they are (a
  float is truncated towards zero) and a negative one gives the rule's value
  at that negative staleness. The delayjax runtimes compute staleness as
  ``u - v >= 0`` and never pass such values.
  """
  for leaf in jax.tree.leaves(staleness):
    if isinstance(leaf, jax.core.Tracer):
      continue
    if isinstance(leaf, int) and not isinstance(leaf, bool):
      # A Python int of any size (NumPy would make one past int64 an object array).
      value = np.asarray(min(max(leaf, -1), MAX_STALENESS + 1))
      shown = leaf
    else:
      value = np.asarray(leaf)
      shown = None
    if value.dtype == np.bool_ or not (np.issubdtype(value.dtype, np.integer) or np.issubdtype(value.dtype, np.floating)):
      raise TypeError(f"{name} must be an integer >= 0 (or a pytree of them), got {leaf!r} of dtype {value.dtype}.")
    if np.issubdtype(value.dtype, np.floating):
      bad = ~np.isfinite(value) | (value < 0) | (np.mod(np.nan_to_num(value), 1) != 0)
    else:
      bad = value < 0
    if np.any(bad):
      first = value[bad].flat[0].item() if shown is None else shown
      raise ValueError(f"{name} must be an integer >= 0 (a number of updates), got {first!r}.")
    # Cast to int32 further on, a larger value would wrap around (2**32 + 5 acts as 5): refused as given.
    big = value > MAX_STALENESS
    if np.any(big):
      first = value[big].flat[0].item() if shown is None else shown
      raise ValueError(f"{name} must be an integer in [0, 2**31 - 1 = {MAX_STALENESS}] (it is int32), got {first!r}.")


def broadcast_staleness(staleness: Any, updates: Any, name: str = "staleness") -> Any:
  """Returns one int32 staleness per leaf of ``updates``.

  ``staleness`` is a scalar shared by every leaf, or a pytree with the
  structure of ``updates`` (per-leaf, layer-wise staleness). Concrete values
  are checked with :func:`check_staleness`.

  Raises:
    ValueError: if ``staleness`` is missing, its tree does not match, or a
      concrete value is negative or not an integer.
  """
  if staleness is None:
    raise ValueError(
        f"this transformation needs the extra argument {name}= (int32 scalar or a pytree matching the "
        f"updates); the delayjax runtimes pass it, a hand-written loop must pass it to update().")
  check_staleness(name, staleness)
  if not jax.tree_util.treedef_is_leaf(jax.tree.structure(staleness)):
    # Inside optax.masked / multi_transform, the part of a per-leaf staleness under the group's updates.
    staleness = masked_like(staleness, updates)
    if jax.tree.structure(staleness) != jax.tree.structure(updates):
      raise ValueError(
          f"{name} must be a scalar or a pytree with the structure of the updates "
          f"{jax.tree.structure(updates)}; got {jax.tree.structure(staleness)}.")
    return jax.tree.map(lambda t: jnp.asarray(t, jnp.int32), staleness)
  if jnp.ndim(staleness) != 0:
    raise ValueError(f"{name} must be a scalar or a pytree of scalars, got shape {jnp.shape(staleness)}.")
  tau = jnp.asarray(staleness, jnp.int32)
  return jax.tree.map(lambda _: tau, updates)


def rule_parameters(**given: Any) -> dict[str, Any]:
  """The staleness rule's parameters that were given (not ``None``), for :func:`staleness_weight`.

  Transformations that take a staleness rule name its parameters
  (``a``, ``b``, ``value``, ``threshold``) in their signatures, so that
  ``optax.inject_hyperparams`` can inject them, and pass them on with this.
  """
  return {k: v for k, v in given.items() if v is not None}


def scale_by_staleness(
    rule: Rule = "inverse",
    *,
    a: float | jax.Array | None = None,
    b: float | jax.Array | None = None,
    value: float | jax.Array | None = None,
    threshold: int | jax.Array | None = None,
) -> optax.GradientTransformationExtraArgs:
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

  Per gradient: Zhang et al. define the step :math:`\alpha_0 / \tau` for each
  gradient with that gradient's own staleness. When an update averages
  several gradients of different staleness (n-softsync, K-async, K-batch),
  ``optax.chain(dj.per_contribution(dj.scale_by_staleness(...)), ...)``
  applies the weight to each contribution before they are combined, as the
  paper does; used directly, this transformation sees the combined update
  and one staleness (what the runtimes pass for it) and weights that.

  Concrete staleness values that are negative or not integers are refused
  (``ValueError``); traced ones are not checked (see :func:`check_staleness`).

  Args:
    rule: ``"inverse"``, ``"polynomial"``, ``"hinge"``, ``"exponential"``,
      ``"constant"``, ``"drop"`` or a callable ``tau -> weight``.
    a, b, value, threshold: the rule's parameters (see
      :func:`staleness_weight`; only those of ``rule`` may be given). Each is a
      Python number or a scalar array, so ``optax.inject_hyperparams`` can
      change them between steps and ``jax.vmap`` can sweep them (a callable
      ``rule`` must then be named in its ``static_args``, or it is taken for
      a schedule).

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
  weight = staleness_weight(rule, **rule_parameters(a=a, b=b, value=value, threshold=threshold))

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

