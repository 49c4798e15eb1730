"""SMA: synchronous model averaging of CROSSBOW (Koliousis et al., VLDB 2019)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from delayjax._checks import check_float
from delayjax.gossip._method import PARAMS, GossipMethod, params_themselves


class SMAState(NamedTuple):
  """Per-replica state of :func:`sma` (the same on every replica, up to float rounding, when every mix is an
  all-reduce: each replica adds the messages in its own order)."""

  central: Any  # pytree like params: the central average model z, the initial params at the start
  velocity: Any  # pytree like params: z's last change z - z_prev (its momentum), zeros at the start
  correction: Any  # pytree like params: the replica's correction c_i not yet applied (zeros after each GRAD)


def sma(alpha: float = 0.1, momentum: float = 0.9) -> GossipMethod:
  r"""SMA: learners step on their own minibatches and are pulled toward a central average model with momentum.

  Every replica (a *learner*, CROSSBOW's model replica) trains with its own
  minibatches; a ``PARAMS`` mix (an all-reduce of all :math:`k` replicas,
  weights :math:`1/k`) synchronizes them through a central average model
  :math:`z` that every replica keeps a copy of. In a round a learner reads
  :math:`w_i`, the all-reduce sums the corrections, and the learner applies
  its gradient step and its correction:

  .. math::

    c_i = \alpha\, (w_i - z), \qquad
    w_i \leftarrow w_i + u_i - c_i, \quad (u_i, s_i) = \text{tx.update}(g_i(w_i), s_i, w_i), \\
    v \leftarrow \sum_{j=1}^{k} c_j + \mu\, v, \qquad z \leftarrow z + v

  with :math:`v = z - z_{\text{prev}}` (zero at the start, :math:`z` the
  initial model), i.e. :math:`z \leftarrow z + \sum_j c_j + \mu (z -
  z_{\text{prev}})`. The runtime's events carry it so: a ``PARAMS`` mix
  sends :math:`c_i` (computed at the replica's current :math:`w_i`, before
  its step), and each receiver takes :math:`\sum_j W_{ij} c_j / W_{ii}`
  as the sum (on an all-reduce, where every weight is :math:`1/k`, the sum
  to float rounding; each replica adds the messages in its own order, so
  the copies of :math:`z` agree to rounding, not bit for bit),
  updates :math:`v` and :math:`z`, and keeps :math:`c_i` pending; its next
  ``GRAD`` applies ``tx``'s update (``tx`` sees :math:`w_i`) and subtracts
  :math:`c_i`. The synchronous rounds of ``dj.cluster.d_psgd`` on
  ``dj.topology.complete(k)`` (``READ``, ``MIX``, ``GRAD``) are exactly
  CROSSBOW's iterations. The learner's gradient is taken at :math:`w_i`; the
  model CROSSBOW tests is :math:`z` (``extra.central``), and the runtime's
  average model is the learners' mean :math:`\bar w`. On
  ``dj.cluster.allreduce`` (gradient mixes, no ``PARAMS`` mix) no correction
  is ever made and the learners run synchronous SGD.

  Checked against the authors' code (``lsds/Crossbow``,
  ``clib-multigpu/synch/sma.c`` and ``kernels/optimisers/sma.cu``): a
  learner's step copies its model to ``diff`` before applying its
  (momentum) update; the synchronization computes ``diff - z``, subtracts
  ``alpha`` times it from the updated replica, all-reduces (``ncclSum``) the
  sum of ``alpha (diff - z)``, adds ``0.9`` times the previous sum to it
  (``EAMSGD__APPLY_MOMENTUM``, on when the learners use momentum), keeps it
  as the new previous sum and adds it to ``z``. The code's default
  ``alpha`` is 0.5 (``SolverConf``); its benchmark scripts use 0.1 (0.2 for
  VGG) with learner momentum 0.9, the defaults here. **Only the paper's
  abstract could be read here** (its Algorithm was not reachable): the rule
  above is the code's, written with the correction :math:`c_j = \alpha (w_j -
  z)`. Differences: a mix whose weights are not all equal
  (not an all-reduce) makes each replica's :math:`z` its own weighted
  estimate, the library's generalization, not the paper's; and two mixes
  without a ``GRAD`` between them add both corrections, each taken at the
  replica's last stepped model. Late messages are refused.

  Args:
    alpha: :math:`\alpha \ge 0`, the correction's strength (:math:`\alpha = 0`:
      independent learners, :math:`z` fixed).
    momentum: :math:`0 \le \mu < 1`, the central model's momentum.

  Returns:
    A :class:`GossipMethod` with an :class:`SMAState` per replica.

  Examples:
    >>> import delayjax as dj
    >>> dj.gossip.sma(alpha=0.1, momentum=0.9).name
    'sma'

  References:
    Koliousis, Watcharapichat, Weidlich, Mai, Costa, Pietzuch, `Crossbow:
    Scaling Deep Learning with Small Batch Sizes on Multi-GPU Servers
    <https://arxiv.org/abs/1901.02244>`_, PVLDB 12(11), 2019
  """
  alpha = check_float("alpha", alpha, minimum=0.0)
  momentum = check_float("momentum", momentum, minimum=0.0, maximum=1.0, strict_maximum=True)

  def init(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    return SMAState(jax.tree.map(jnp.array, params), zeros, zeros)

  def own_correction(params, extra):
    return jax.tree.map(lambda w, z: jnp.asarray(alpha, w.dtype) * (w - z), params, extra.central)

  def apply(tx, grads, opt_state, params, extra, dt):
    del dt
    update, opt_state = tx.update(grads, opt_state, params)
    stepped = optax.apply_updates(params, update)
    new = jax.tree.map(jnp.subtract, stepped, extra.correction)
    return new, opt_state, extra._replace(correction=jax.tree.map(jnp.zeros_like, extra.correction))

  def receive(params, extra, mixed, self_weight, dt):
    del dt
    # sum_j W_ij c_j / W_ii is sum_j c_j when every weight is 1/k (an all-reduce); a replica without a weight of
    # its own adds nothing rather than dividing by zero.
    inverse = jnp.where(self_weight > 0, 1.0 / jnp.where(self_weight > 0, self_weight, 1.0), 0.0)
    total = jax.tree.map(lambda m: m * inverse.astype(m.dtype), mixed)
    velocity = jax.tree.map(lambda s, v: s + jnp.asarray(momentum, v.dtype) * v, total, extra.velocity)
    central = jax.tree.map(jnp.add, extra.central, velocity)
    correction = jax.tree.map(jnp.add, extra.correction, own_correction(params, extra))
    return params, SMAState(central, velocity, correction)

  # A late correction would be taken against an older z than the receiver's, which the rule does not define.
  return GossipMethod("sma", init, params_themselves, apply, own_correction, receive, mixes=PARAMS,
                      late_messages=False)
