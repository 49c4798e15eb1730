"""LayUp: asynchronous decentralized SGD with layer-wise gossip (the library's construction from the abstract)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from delayjax.gossip._method import PARAMS, GossipMethod, params_themselves, plain_apply

# A layer counts as pushed to a receiver when the weight of the members that pushed it exceeds this.
_PUSHED = 1e-6


class LayUpState(NamedTuple):
  """Per-replica state of :func:`layup`."""

  cursor: jax.Array  # shape=(), int32: the layer this replica pushes at its next mix, in backpropagation order


def _num_layers(params: Any) -> int:
  return len(jax.tree.leaves(params))


def _layer_mask(cursor: jax.Array, num_layers: int) -> jax.Array:
  """float32 ``[L]``, one at the leaf the cursor points to: position ``p`` in backpropagation order is leaf
  ``L - 1 - p`` of ``jax.tree.leaves(params)`` (the last leaves first, as a backward pass produces them)."""
  return (jnp.arange(num_layers - 1, -1, -1, dtype=jnp.int32) == cursor).astype(jnp.float32)


def layup() -> GossipMethod:
  r"""LayUp: asynchronous gossip in which every mix exchanges one layer, each layer with its own random peer.

  The layers are the leaves of ``params``, taken in backpropagation order
  (the last of ``jax.tree.leaves(params)`` first). Replica :math:`i` keeps
  its model :math:`x_i` and a cursor :math:`c_i` (0 at the start), the layer
  it pushes at its next exchange. A ``GRAD`` applies the replica's own
  optimizer to its model at once, every layer (as AD-PSGD, :func:`ad_psgd`):
  :math:`(u, s_i) = \text{tx.update}(g_i, s_i, x_i)`,
  :math:`x_i \leftarrow x_i + u`, with :math:`g_i` taken at the model read
  before. A ``PARAMS`` mix of members :math:`b` with weights :math:`W`:
  every member pushes the layer :math:`\ell_b` its cursor points to (a late
  message is refused: ``lag`` must be 0), and every receiving member :math:`a`
  averages each layer :math:`\ell` with the members that pushed it, keeping
  its own weight,

  .. math::

    x_a^{\ell} \leftarrow
      \frac{W_{aa}\, x_a^{\ell} + \sum_{b \ne a,\ \ell_b = \ell} W_{ab}\, x_b^{\ell}}
           {W_{aa} + \sum_{b \ne a,\ \ell_b = \ell} W_{ab}},
    \qquad c_a \leftarrow (c_a + 1) \bmod L

  and leaves the layers nobody pushed to it as they are. On a pairwise
  schedule (``dj.cluster.ad_psgd``) whose mixes come :math:`L` times as often
  as gradients, every layer is thus exchanged about once per gradient, each
  with a partner of its own, the last layers first. With one replica
  (its only mixes with itself) this is plain training with ``tx``, bit for
  bit.

  **What is confirmed and what is the library's construction.** Only the
  paper's abstract (arXiv 2410.05985, v4; v3 titled "Asynchronous stochastic
  gradient descent with decoupled backpropagation and layer-wise updates",
  PD-ASGD) was reachable; no public code was found. It confirms: an
  asynchronous, decentralized SGD; incremental *layer-wise* updates
  exchanged during backpropagation; randomized gossip communication;
  updates applied as soon as they are available, without buffering; less
  parameter drift than whole-model exchanges. The rule above (one layer per
  mix, chosen by a cursor that walks the layers in backpropagation order;
  the receiver averaging the pushed layer with its own copy, renormalized
  over the members that pushed it; the gradient step applied to every
  layer at the ``GRAD`` event, since the runtime's events are instantaneous
  and cannot split one backward pass in time) is delayjax's construction of
  that description, **not the paper's verified algorithm**; its mixing
  weights, its peer selection and whether the pushed quantity is the layer's
  values or its increment could not be checked.

  Returns:
    A :class:`GossipMethod` with a :class:`LayUpState` per replica.

  References:
    `LayUp: Asynchronous decentralized gradient descent with layer-wise
    updates <https://arxiv.org/abs/2410.05985>`_, arXiv 2410.05985, 2024
    (v4; earlier versions: Partial Decoupled ASGD)
  """

  def init(params):
    del params
    return LayUpState(jnp.zeros((), jnp.int32))

  def message(params, extra):
    mask = _layer_mask(extra.cursor, _num_layers(params))
    leaves, treedef = jax.tree.flatten(params)
    pushed = [x * mask[k].astype(x.dtype) for k, x in enumerate(leaves)]
    return jax.tree.unflatten(treedef, pushed), mask

  def receive(params, extra, mixed, self_weight, dt):
    del dt
    pushed_sum, mask_sum = mixed
    num_layers = _num_layers(params)
    own = _layer_mask(extra.cursor, num_layers)
    leaves, treedef = jax.tree.flatten(params)
    sums = jax.tree.leaves(pushed_sum)
    out = []
    for k, (x, total) in enumerate(zip(leaves, sums)):
      w_self = self_weight.astype(x.dtype)
      # The other members' share of this layer: the mixed messages less the receiver's own term.
      others_weight = mask_sum[k] - self_weight.astype(jnp.float32) * own[k]
      others = total - w_self * own[k].astype(x.dtype) * x
      pushed = others_weight > _PUSHED
      safe = jnp.where(pushed, self_weight.astype(jnp.float32) + others_weight, 1.0).astype(x.dtype)
      out.append(jnp.where(pushed, (w_self * x + others) / safe, x))
    return jax.tree.unflatten(treedef, out), LayUpState((extra.cursor + 1) % num_layers)

  # The receiver takes its own share out of the mixed messages as its current layer, which a late message
  # of its own would not be.
  return GossipMethod("layup", init, params_themselves, plain_apply, message, receive, mixes=PARAMS,
                      late_messages=False)
