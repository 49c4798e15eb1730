"""HPSGD: local training overlapped with the all-reduce of the previous phase's changes (Zhou et al. 2020)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from delayjax.gossip._method import PARAMS, GossipMethod, params_themselves, plain_apply


class HPSGDState(NamedTuple):
  """Per-replica state of :func:`hpsgd`."""

  central: Any  # pytree like params: the global model g the replica restarts from (params at the start)
  anchor: Any  # pytree like params: where the replica's current phase started (its commit is measured from it)
  commit: Any  # pytree like params: the change the replica committed at its last merge, in flight (zeros at first)
  merged: jax.Array  # shape=(), int32: merges done so far


def hpsgd() -> GossipMethod:
  r"""HPSGD: each replica commits its phase's change and keeps training while the average of the changes is reduced.

  Replica :math:`i` trains its model :math:`x_i` with its own optimizer and
  never waits for the all-reduce (a ``GRAD`` is ``tx`` at :math:`x_i`). A
  ``PARAMS`` mix is a *merge*: the all-reduce (weights :math:`1/M`) of the
  changes the replicas committed at their previous merge completes, and
  each replica, with :math:`g` the global model, :math:`a_i` the start of
  its current phase and :math:`c_i` its commit in flight,

  .. math::

    c_i' = x_i - a_i, \qquad g \leftarrow g + \sum_j W_{ij}\, c_j, \qquad
    x_i \leftarrow g, \qquad a_i \leftarrow g, \qquad c_i \leftarrow c_i'

  commits its new change (reduced in the background during the next phase)
  and restarts from the global model, to which every change, its own
  included, is added one phase after it was made: :math:`g^{k+1} = g^k +
  \tfrac1M \sum_j c_j^{k-1}`. The first merge has no reduced change to apply:
  the replica commits and keeps its model (:math:`a_i \leftarrow x_i`, no
  restart), as the authors' code does. With one replica it is local
  training whose progress reaches the model one phase late.

  Checked against the authors' code (a PyTorch script whose ``HLSGD(model,
  force_async)`` runs after each backward pass; found by the code search,
  its repository not named there): while the previous all-reduce is in
  flight a worker adds its gradient to ``G_sum`` and steps its model
  (``optim.SGD``, momentum 0), the first iteration of a phase taking the
  snapshot ``backup_state_dict``; once the all-reduce is done, the next
  iteration commits ``G_sum + grad`` (its change over ``-lr``, the merge
  iteration's gradient included), restores the snapshot, steps it with the
  reduced commit over the world size and starts the all-reduce of the new
  commit (``dist.all_reduce(..., async_op=True)``). Here the merge
  iteration's gradient is the ``GRAD`` before the mix, and the change is
  committed as a model difference, the same for SGD; with another ``tx``
  the average change is added as it is, not fed to ``tx``. Not modelled: the
  code's epoch-end forced merge (``force_async``), and its rule that the
  iteration right after a merge is always local (a schedule decides when
  mixes happen). **The paper's text could not be read here, only its
  abstract** (which names the commit of updates to a replica of the global
  model and the merge of the average changes, overlapped with local
  training); the schedule, e.g. rounds of local ``GRAD`` events and one
  all-reduce ``MIX``, is the library's. Identities: the method is neither
  ``dc_s3gd(0)`` nor ``lasgd``, which keep a replica's own change at once and
  others' one phase late (:math:`x_i \leftarrow \bar x + (x_i - a_i)`):
  here a replica's own change waits with the others'.

  Returns:
    A :class:`GossipMethod` with an :class:`HPSGDState` per replica.

  Examples:
    >>> import delayjax as dj
    >>> dj.gossip.hpsgd().name
    'hpsgd'

  References:
    Zhou, Ye, Zhang, Lv, `HPSGD: Hierarchical Parallel SGD With Stale
    Gradients Featuring <https://arxiv.org/abs/2009.02701>`_, arXiv 2009.02701, 2020
  """

  def init(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    return HPSGDState(jax.tree.map(jnp.array, params), jax.tree.map(jnp.array, params), zeros,
                      jnp.zeros((), jnp.int32))

  def message(params, extra):
    del params
    return extra.commit

  def receive(params, extra, mixed, self_weight, dt):
    del self_weight, dt
    commit = jax.tree.map(jnp.subtract, params, extra.anchor)
    central = jax.tree.map(jnp.add, extra.central, mixed)
    first = extra.merged == 0
    # The first merge has nothing reduced to apply (every commit is still zero): the replica keeps its progress.
    restart = jax.tree.map(lambda x, g: jnp.where(first, x, g), params, central)
    return restart, HPSGDState(central, restart, commit, extra.merged + 1)

  # A commit is kept in the state until its all-reduce completes, so the messages carry no lag of their own.
  return GossipMethod("hpsgd", init, params_themselves, plain_apply, message, receive, mixes=PARAMS,
                      late_messages=False)
