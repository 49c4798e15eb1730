"""What a gossip method is: per-replica rules that the replica runtime applies at each event.

A decentralized method is not one Optax transformation: it decides what each
replica keeps besides its parameters (a push-sum weight, a momentum twin, the
last all-reduced model), where a replica computes its gradient, how a
gradient event applies the replica's own optimizer, and what a mixing event
combines. This module holds that contract; the methods live in the modules
beside it and the runtime (``dj.simulate_gossip``) runs any of them on any
gossip schedule. These rules are written for *one* replica; the runtime
applies them to all replicas at once with ``jax.vmap``.

The methods are a subpackage of their own rather than ``transforms/``
modules because they are not transformations of one parameter tree: their
mixing rules act across replicas, and a method's gradient step wraps a
user's Optax transformation (applied per replica, each with its own state).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

PARAMS, GRADS = "params", "gradients"


class GossipMethod(NamedTuple):
  r"""The rules of a decentralized method, for one replica.

  Attributes:
    name: a short name, e.g. ``"sgp"``.
    init: ``init(params) -> extra``: the replica's state besides its
      parameters and optimizer state (``()`` when there is none).
    grad_params: ``grad_params(params, extra) -> params``: where a ``READ``
      takes the replica's gradient (``x / w`` for push-sum).
    apply: ``apply(tx, grads, opt_state, params, extra, dt) -> (params,
      opt_state, extra)``: a ``GRAD`` event. ``dt`` is the simulated time
      since the replica's previous ``GRAD`` or ``MIX`` (float32; used by
      methods with continuous dynamics).
    message: ``message(params, extra) -> pytree``: what the replica sends in a
      ``PARAMS`` mix; mixed linearly, leaf by leaf.
    receive: ``receive(params, extra, mixed, self_weight, dt) -> (params,
      extra)``: a receiving member of a ``PARAMS`` mix, given
      :math:`\sum_b W_{ab} m_b` of the members' messages and its own weight
      :math:`W_{aa}`.
    mixes: what a ``MIX`` event combines: ``"params"`` (the messages) or
      ``"gradients"`` (the pending gradients, GossipGraD). A schedule's
      ``GRADS`` mixes always combine pending gradients.
    advance: ``advance(params, extra, dt) -> (params, extra)``, or ``None``:
      continuous dynamics between events (A2CiD2), applied to every member of
      a ``PARAMS`` mix before the messages are taken.
    late_messages: whether the rule is defined for late messages (a
      schedule's ``lag > 0``); the runtime refuses such a schedule otherwise.
  """

  name: str
  init: Callable[[Any], Any]
  grad_params: Callable[[Any, Any], Any]
  apply: Callable[..., tuple[Any, Any, Any]]
  message: Callable[[Any, Any], Any]
  receive: Callable[..., tuple[Any, Any]]
  mixes: str = PARAMS
  advance: Callable[..., tuple[Any, Any]] | None = None
  late_messages: bool = True


def optimizer_step(tx: optax.GradientTransformation, grads: Any, opt_state: Any, params: Any,
                   at: Any = None) -> tuple[Any, Any]:
  """``(params + updates, opt_state)`` for ``tx``'s update of ``grads``; ``at`` (default ``params``) is what
  ``tx`` sees as the parameters (weight decay, DC terms)."""
  updates, opt_state = tx.update(grads, opt_state, params if at is None else at)
  return optax.apply_updates(params, updates), opt_state


def no_extra(params: Any) -> tuple[()]:
  del params
  return ()


def params_themselves(params: Any, extra: Any) -> Any:
  del extra
  return params


def replace_params(params: Any, extra: Any, mixed: Any, self_weight: jax.Array, dt: jax.Array) -> tuple[Any, Any]:
  del params, self_weight, dt
  return mixed, extra


def plain_apply(tx, grads, opt_state, params, extra, dt):
  del dt
  params, opt_state = optimizer_step(tx, grads, opt_state, params)
  return params, opt_state, extra


def tree_axpy(a: Any, x: Any, y: Any) -> Any:
  """``a * x + y`` leaf by leaf, ``a`` a scalar cast to each leaf's dtype."""
  return jax.tree.map(lambda u, v: jnp.asarray(a, v.dtype) * u + v, x, y)
