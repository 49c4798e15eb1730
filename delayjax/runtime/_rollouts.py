r"""Stale data: a worker that generates its batch (rollouts) from the parameters it read.

In asynchronous RL the rollout workers sample from the policy they last
read, :math:`\mu = \pi_{\theta_v}`, while the learner trains; the learner's
gradient at update :math:`u` is taken at its *current* parameters
:math:`\theta_u` on data of the policy :math:`u - v` versions old.
:class:`Rollouts` is that worker as a ``dj.simulate`` plug-in:

* ``contribute`` (the worker, at the parameters read): generates rollouts
  ``generate(read, key, prompts)``, recording the behaviour log-probs, and
  pushes them as its payload (the runtime buffers them until their update);
* ``at_update`` (the learner, at the server's parameters when the update is
  applied): the gradient of ``dj.policy_gradient_loss`` with the correction,
  the contribution's staleness deciding the discard budget and reaching the
  correction's objective (for a correction that depends on it).

Which version each contribution reads and when it is applied is the
schedule's: a ``dj.cluster`` schedule of rollout workers, or a delay model.

Data-dependent delays, and what is exact. A rollout's generation time grows
with its length. When the length is a property of the *prompt* (the data
drawn), the delays are exact: give the worker a table ``prompts [M, n, B]``
(contribution :math:`j` of worker :math:`m` answers ``prompts[m, j % n]``)
and the cluster the same table's times (``ContextualBandit.generation_times``
into ``dj.cluster.workers(M, compute=times)``, which replays
``times[m, j % n]`` for worker :math:`m`'s :math:`j`-th gradient): every
contribution's compute time is then the time of the very prompts it answers.
This needs every gradient a worker computes to reach the schedule in order
(ASP, SSP, BSP, ``dj.cluster.version_budget``; not the paradigms that drop pushes, K-sync or backup
workers, whose dropped gradients still advance the worker's table but are
never computed here). When the length depends on the sampled *response*
(hence on the parameters), the schedule would have to be made while the run
computes; that feedback is not simulated: the time model is then a
stand-in (e.g. the prompt's expected length) and the delays approximate.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from delayjax._checks import check_int
from delayjax.runtime._workers import Worker
from delayjax.transforms._off_policy import Correction, discard_stale, no_correction, policy_gradient_loss

__all__ = ["Rollouts"]


def _advantages(rollouts: dict[str, Any]) -> jax.Array:
  """The rollouts' ``advantages``, or their rewards minus the batch's mean (a group baseline, as GRPO's)."""
  if "advantages" in rollouts:
    return rollouts["advantages"]
  rewards = rollouts["rewards"]
  return rewards - jnp.mean(rewards)


@dataclasses.dataclass(frozen=True, eq=False)
class Rollouts(Worker):
  r"""A rollout worker: generates its batch at the parameters it read; the learner corrects for staleness.

  Worker :math:`m` reading version :math:`v` draws rollouts
  :math:`(s_i, a_i) \sim \mu = \pi_{\theta_v}` with their behaviour log-probs
  :math:`\log \mu(a_i \mid s_i)` and advantages :math:`A_i`; at update
  :math:`u` the learner pushes the gradient

  .. math::

    g_u = \nabla_\theta \Big[-\frac{\sum_i m_i J_i(\theta; u - v)}{\max(1, \sum_i m_i)}\Big]_{\theta = \theta_u},
    \qquad m_i = [u - v \le k]

  with :math:`J_i` the ``correction``'s objective (``dj.no_correction``,
  ``dj.importance_weighting``, ``dj.truncated_is``, ``dj.ppo_clip``,
  ``dj.m2po``, or a ``dj.Correction`` of one's own; one with
  ``uses_staleness`` receives the lag :math:`u - v`, the contribution's
  staleness, for each of its samples) and :math:`k` the discard budget
  (``max_staleness``; all kept without it). ``tx`` then applies :math:`g_u` as any gradient (e.g.
  ``optax.sgd(lr)``). At zero staleness every correction gives the on-policy
  policy gradient :math:`-\frac1B \sum_i A_i \nabla \log \pi_\theta(a_i \mid s_i)`.

  Args:
    generate: ``generate(params, key, prompts) -> rollouts``, a dict of
      ``[B]`` arrays holding ``"behaviour_logp"`` and ``"rewards"`` (or
      ``"advantages"``; without them the advantage is the reward minus the
      batch's mean reward) and whatever ``log_prob`` needs.
    log_prob: ``log_prob(params, rollouts) -> [B]``, the learner's log-probs
      of the rollouts' actions at ``params``.
    correction: the off-policy correction (default none).
    max_staleness: discard a contribution's rollouts when its staleness
      exceeds :math:`k` (their gradient is then 0); ``None``: keep all.
    prompts: int ``[M, n, B]`` or ``None``. With a table, contribution
      :math:`j` of worker :math:`m` answers ``prompts[m, j % n]`` (so the
      cluster can replay the times those very prompts take; module
      docstring) and the worker's contributions run in order. Without one,
      the prompts are the contribution's first minibatch as ``dj.Sampling``
      draws it from ``data``.

  References:
    Espeholt et al., `IMPALA: Scalable Distributed Deep-RL with Importance
    Weighted Actor-Learner Architectures <https://arxiv.org/abs/1802.01561>`_,
    ICML 2018; Noukhovitch et al., `Asynchronous RLHF: Faster and More
    Efficient Off-Policy RL for Language Models
    <https://arxiv.org/abs/2410.18252>`_, ICLR 2025.
  """

  generate: Callable[[Any, jax.Array, Any], dict[str, jax.Array]]
  log_prob: Callable[[Any, dict[str, jax.Array]], jax.Array]
  correction: Correction = dataclasses.field(default_factory=no_correction)
  max_staleness: int | None = None
  prompts: Any = None

  def __post_init__(self):
    for name in ("generate", "log_prob"):
      if not callable(getattr(self, name)):
        raise TypeError(f"Rollouts.{name} must be callable, got {type(getattr(self, name)).__name__}.")
    if not isinstance(self.correction, Correction):
      raise TypeError(f"Rollouts.correction must be a dj.Correction (dj.truncated_is(2.0), ...), got "
                      f"{type(self.correction).__name__} {self.correction!r}.")
    if self.max_staleness is not None:
      object.__setattr__(self, "max_staleness", check_int("Rollouts.max_staleness", self.max_staleness, minimum=0))
    if self.prompts is not None:
      table = np.asarray(self.prompts)
      if table.ndim != 3 or 0 in table.shape or table.dtype.kind not in "iu":
        raise ValueError(f"Rollouts.prompts must be an int array [num_workers, n, batch] of prompt indices, got "
                         f"shape {table.shape} of dtype {table.dtype}.")
      table = table.astype(np.int32)
      table.setflags(write=False)
      object.__setattr__(self, "prompts", table)

  @property
  def sequential(self) -> bool:  # type: ignore[override]
    # With a table, a worker's j-th contribution must be the j-th it computes.
    return self.prompts is not None

  def bind(self, num_workers, padded_workers):
    if self.prompts is not None and self.prompts.shape[0] != num_workers:
      raise ValueError(f"Rollouts.prompts must hold one row per worker ({num_workers}), got shape "
                       f"{self.prompts.shape}.")
    return self

  def init_state(self, params):
    # How many contributions the worker has made: its next row of the prompt table.
    return jnp.zeros((), jnp.int32) if self.prompts is not None else ()

  def contribute(self, ctx, read, state):
    if self.prompts is None:
      prompts, _ = ctx.minibatch(0)
    else:
      table = jnp.asarray(self.prompts)
      # Padding workers (beyond the table) never contribute; their index is clamped only to stay in range.
      row = jnp.minimum(ctx.worker, table.shape[0] - 1)
      prompts = table[row, state % table.shape[1]]
      state = state + 1
    rollouts = self.generate(read, ctx.key, prompts)
    if not isinstance(rollouts, dict) or "behaviour_logp" not in rollouts or not (
        "rewards" in rollouts or "advantages" in rollouts):
      raise TypeError(f"Rollouts.generate must return a dict holding 'behaviour_logp' and 'rewards' (or "
                      f"'advantages'), got {jax.tree.structure(rollouts)}.")
    rollouts = {**rollouts, "advantages": _advantages(rollouts)}
    reward = jnp.mean(rollouts["rewards"]) if "rewards" in rollouts else jnp.zeros((), jnp.float32)
    # The push's loss is minus the behaviour policy's mean reward; the learner's loss replaces it in the record.
    return -reward.astype(jnp.float32), {"rollouts": rollouts}, state

  def at_update(self, ctx, params, payload):
    rollouts = payload["rollouts"]
    size = rollouts["behaviour_logp"].shape[0]
    mask = None
    if self.max_staleness is not None:
      mask = jnp.broadcast_to(discard_stale(ctx.staleness, self.max_staleness), (size,))

    def loss(p):
      # The lag reaches the objective too: a correction may weigh the samples by how many versions old they are.
      return policy_gradient_loss(self.correction, self.log_prob(p, rollouts), rollouts["behaviour_logp"],
                                  rollouts["advantages"], mask, staleness=ctx.staleness)

    value, grad = jax.value_and_grad(loss)(params)
    return value, {"grad": grad}

  def identity(self):
    table = None if self.prompts is None else hashlib.sha256(self.prompts.tobytes()).hexdigest()
    correction = (self.correction.name, self.correction.hyperparams)
    if self.correction.uses_staleness:
      # Only then: the runs of the built-in corrections keep the identity (and checkpoints) they had.
      correction += (("uses_staleness", True),)
    return {"correction": correction, "max_staleness": self.max_staleness,
            "prompts": table, "prompts_shape": None if self.prompts is None else self.prompts.shape,
            "functions": {"generate": self.generate, "log_prob": self.log_prob,
                          "correction": self.correction.objective}}

  def requests_allowed(self):
    return False
