"""Training on PipeDream-2BW, interleaved 1F1B and ZB-H1 through ``dj.simulate_pipeline``, against the papers' rules.

The reference is written from each paper's update rule, not from the
schedule's tables: the whole staged model's gradient by ``jax.grad`` of the
composed stages, on the micro-batches ``dj.runtime.minibatch_indices``
draws, and SGD with heavy-ball momentum by hand. Synchronous schedules
(interleaved, ZB-H1) are minibatch SGD; 2BW applies the gradient at the
version before the current one, :math:`w_{u+1} = w_u - \\nu \\nabla f(w_{u-1})`.
"""

import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj

sys.path.insert(0, os.path.dirname(__file__))
from pipeline_reference import _indices, assert_trees_close, mlp_problem  # noqa: E402

LR, MOMENTUM, B, SEED, U = 0.2, 0.5, 6, 3, 4
# One 4-stage model for every schedule, so the two synchronous runs share one compiled program.
STAGES, LOSS_FN, PARAMS, DATA = mlp_problem(4, width=5, n=48)


@jax.jit
def _value_and_grad(params, batch):
  def total(ps):
    h = batch["x"]
    for f, p in zip(STAGES, ps):
      h = f(p, h)
    return LOSS_FN(h, batch)

  return jax.value_and_grad(total)(params)


def _rule_reference(*, m, lag):
  """Minibatch SGD with momentum on the composed model; update u's gradient at version ``max(u - lag, 0)``."""
  versions, trace, losses = [list(PARAMS)], jax.tree.map(jnp.zeros_like, list(PARAMS)), []
  for u in range(U):
    read = versions[max(u - lag, 0)]
    gs, ls = [], []
    for j in range(m):
      idx = _indices(SEED, u, j, num_examples=DATA["x"].shape[0], batch_size=B)
      loss, g = _value_and_grad(read, jax.tree.map(lambda a: a[idx], DATA))
      gs.append(g)
      ls.append(loss)
    g = jax.tree.map(lambda *x: sum(x) / m, *gs)
    trace = jax.tree.map(lambda t, x: x + MOMENTUM * t, trace, g)
    versions.append(jax.tree.map(lambda w, t: w - LR * t, versions[-1], trace))
    losses.append(np.mean(ls))
  return versions[-1], np.array(losses)


@pytest.mark.parametrize("schedule,K,v,lag", [("2bw", 4, 1, 1), ("interleaved", 2, 2, 0), ("zb-h1", 4, 1, 0)])
def test_training_follows_the_papers_update_rule(schedule, K, v, lag):
  m = 4
  sched = dj.cluster.pipeline(schedule, K, U, num_microbatches=m, virtual_stages=v)
  result = dj.simulate_pipeline(STAGES, LOSS_FN, optax.sgd(LR, momentum=MOMENTUM), PARAMS, DATA, sched, seed=SEED,
                                sampling=dj.Sampling(batch_size=B), execution=dj.Execution(chunk_size=2))
  want, losses = _rule_reference(m=m, lag=lag)
  assert_trees_close(result.params, want)
  np.testing.assert_allclose(result.history.loss, losses, rtol=2e-6)
  np.testing.assert_array_equal(result.history.forward_staleness,
                                np.repeat(np.minimum(np.arange(U), lag)[:, None], K * v, axis=1))


def test_the_runtime_refuses_what_it_would_not_compute():
  sched = dj.cluster.pipeline("interleaved", 2, 2, num_microbatches=2, virtual_stages=2)
  with pytest.raises(ValueError, match=r"stage_fns has 3 stages but the schedule has 4 model stages"):
    dj.simulate_pipeline(STAGES[1:], LOSS_FN, optax.sgd(0.1), PARAMS[1:], DATA, sched)
  # A split backward pass whose W half read another version than its B half.
  other = dataclasses.replace(sched, weight_version=sched.backward_version - 1)
  with pytest.raises(ValueError, match=r"weight_version != backward_version"):
    dj.simulate_pipeline(STAGES, LOSS_FN, optax.sgd(0.1), PARAMS, DATA, other)
