"""AET-SGD: gossip in which a replica sends its model only when it has moved far enough (Nguyen & Han 2021)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from delayjax._checks import check_float
from delayjax.gossip._method import PARAMS, GossipMethod, optimizer_step, params_themselves


class AETState(NamedTuple):
  """Per-replica state of :func:`aet_sgd`."""

  broadcast: Any  # pytree like params: the model the replica last sent, what its neighbours hold (params at start)
  steps: jax.Array  # int32 []: the replica's gradient steps so far (minibatches processed)
  events: jax.Array  # int32 []: the mixes in which the trigger fired (broadcasts actually sent)


def _distance(params: Any, broadcast: Any) -> jax.Array:
  """:math:`\\lVert x - \\hat x\\rVert_2` over all leaves, in float32."""
  return jnp.sqrt(sum(jnp.sum(jnp.square((x - b).astype(jnp.float32)))
                      for x, b in zip(jax.tree.leaves(params), jax.tree.leaves(broadcast))))


def aet_sgd(threshold: float, growth: float = 0.01) -> GossipMethod:
  r"""AET-SGD: event-triggered gossip whose threshold grows with the samples processed.

  Replica :math:`i` trains its model :math:`x_i` with its own optimizer (a
  ``GRAD`` is ``tx`` at :math:`x_i`) and keeps :math:`\hat x_i`, the model
  it last broadcast (``params`` at the start): what its neighbours hold of
  it. After :math:`k_i` gradient steps (:math:`k_i` minibatches processed)
  its event-triggered threshold is

  .. math::

    \tau(k_i) = \tau_0\, (1 + \rho\, k_i)

  (``threshold`` :math:`\tau_0`, ``growth`` :math:`\rho`: linear in the
  samples processed, so broadcasts become rarer as training goes on). At a
  ``PARAMS`` mix each member fires its event when its model has moved more
  than that since its last broadcast, and its message is then its current
  model, otherwise the stale one its neighbours already hold:

  .. math::

    e_i = \bigl[\lVert x_i - \hat x_i\rVert_2 > \tau(k_i)\bigr], \qquad
    \hat x_i \leftarrow e_i\, x_i + (1 - e_i)\, \hat x_i, \qquad
    x_i \leftarrow x_i + \sum_j W_{ij}\, (\hat x_j - \hat x_i)

  (the mix's weights :math:`W`, rows summing to 1, the new :math:`\hat x`
  on the right). A replica thus moves towards what it has heard of its
  neighbours, relative to what they have heard of it: the disagreement of
  the broadcast models is removed and its own local progress
  :math:`x_i - \hat x_i` is kept. With a doubly-stochastic :math:`W` (the
  Metropolis weights of ``dj.cluster.d_psgd``) the mix keeps the replicas'
  average. With ``threshold=0`` every member whose model changed fires, and
  the rule is D-PSGD's :math:`x_i \leftarrow \sum_j W_{ij} x_j` exactly; with
  a threshold never reached the replicas train alone. ``AETState.events``
  counts the broadcasts sent (a broadcast goes to every neighbour in the
  mix), which ``result.extra.events`` returns per replica.

  Whether a replica communicates depends on its parameters, so the rule is
  decided inside the step: it runs on an ordinary gossip schedule (e.g.
  ``dj.cluster.d_psgd(topology)`` rounds or ``dj.cluster.ad_psgd``), whose
  mixes are the occasions to send, and a mix in which nobody fires changes
  nothing. The schedule's timing is the schedule's: saving the messages
  not sent is a cost the caller counts from ``events``. Every member of a
  mix is expected to receive (so it is on ``d_psgd`` and ``ad_psgd``
  schedules): a member that only sends records no event. A schedule with
  late messages is refused (``late_messages=False``): the message is decided
  from the replica's current state.

  **Only the paper's abstract could be read here**: it confirms an
  asynchronous event-triggered SGD for decentralized training whose
  event-triggered threshold increases linearly with the sample size, to
  reduce communication among the compute nodes and mitigate delays. The
  authors' code (github.com/mlconference/AET-SGD, ``main_SGD_event.py``)
  was read: a node sends its model to its neighbours when
  :math:`\lVert x - \hat x\rVert` since its last send reaches a threshold,
  and moves by :math:`-\beta_t \sum_j (\hat x_i - \hat x_j)` over the models
  it last received, which is the mixing rule above with :math:`W` in place
  of the code's step size :math:`\beta_t`. That file scales its threshold by
  a decaying step size times a multiple of the parameter count; the linear
  schedule :math:`\tau_0 (1 + \rho k)` in the number of local steps is the
  library's construction of the abstract's "linearly increasing sample
  size" threshold, not the paper's verified formula.

  Args:
    threshold: :math:`\tau_0 \ge 0`, the threshold on the L2 distance (over
      all leaves) before any step; 0 gives D-PSGD.
    growth: :math:`\rho \ge 0`, the threshold's relative growth per gradient
      step (0: a constant threshold).

  Returns:
    A :class:`GossipMethod` with an :class:`AETState` per replica.

  Raises:
    TypeError: if ``threshold`` or ``growth`` is not a real number.
    ValueError: if either is negative or not finite.

  Examples:
    >>> import delayjax as dj
    >>> method = dj.gossip.aet_sgd(threshold=0.1, growth=0.02)
    >>> method.name, method.late_messages
    ('aet_sgd', False)
    >>> state = method.init({"w": [0.0, 0.0]})
    >>> int(state.steps), int(state.events)
    (0, 0)

  References:
    Nguyen, Nhuong and Han, Song, `AET-SGD: Asynchronous Event-triggered
    Stochastic Gradient Descent <https://arxiv.org/abs/2112.13935>`_, arXiv
    2112.13935, 2021
  """
  threshold = check_float("threshold", threshold, minimum=0.0)
  growth = check_float("growth", growth, minimum=0.0)

  def init(params):
    return AETState(jax.tree.map(jnp.array, params), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))

  def fires(params, extra):
    limit = jnp.float32(threshold) * (1.0 + jnp.float32(growth) * extra.steps.astype(jnp.float32))
    return _distance(params, extra.broadcast) > limit

  def apply(tx, grads, opt_state, params, extra, dt):
    del dt
    params, opt_state = optimizer_step(tx, grads, opt_state, params)
    return params, opt_state, extra._replace(steps=extra.steps + 1)

  def message(params, extra):
    fire = fires(params, extra)
    return jax.tree.map(lambda x, b: jnp.where(fire, x, b), params, extra.broadcast)

  def receive(params, extra, mixed, self_weight, dt):
    del self_weight, dt
    fire = fires(params, extra)
    sent = jax.tree.map(lambda x, b: jnp.where(fire, x, b), params, extra.broadcast)
    # mixed + (x - x_hat) rather than x + (mixed - x_hat): when the event fires x - x_hat is exactly 0, so the
    # threshold-0 rule is D-PSGD's bit for bit.
    new = jax.tree.map(lambda m, x, s: m + (x - s), mixed, params, sent)
    return new, AETState(sent, extra.steps, extra.events + fire.astype(jnp.int32))

  return GossipMethod("aet_sgd", init, params_themselves, apply, message, receive, mixes=PARAMS,
                      late_messages=False)
