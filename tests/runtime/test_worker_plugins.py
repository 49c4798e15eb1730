"""The worker plug-in protocol: a new kind of worker is a subclass of dj.workers.Worker, checked against NumPy.

Two plug-ins written here as a user would:

* ``PushBatch`` pushes the minibatch it drew instead of a gradient, and takes
  the gradient when its update is applied (``at_update``), at the server's
  parameters then: stale *data*, fresh parameters, as an asynchronous-RL
  learner does. Whatever the delays, that is plain SGD on the minibatches
  in update order.
* ``NoisyGradient`` adds noise drawn from its own key (``ctx.key``) to the
  gradient: the same run whatever the lanes, as the key is a function of
  the contribution, not of where it runs.
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj
from delayjax.runtime._sampling import contribution_key, minibatch_indices

sys.path.insert(0, os.path.dirname(__file__))
from simulate_reference import regression_problem  # noqa: E402

BATCH = 4
LR = 0.05


class PushBatch(dj.workers.Worker):
  """Pushes its minibatch; the learner takes its gradient at the current parameters."""

  def contribute(self, ctx, read, state):
    batch, idx = ctx.minibatch(0)
    loss, _ = ctx.value_and_grad(read, batch)
    return loss, {"batch": batch, "read_loss": loss}, ()

  def at_update(self, ctx, params, payload):
    loss, grad = ctx.value_and_grad(params, payload["batch"])
    return loss, {"grad": grad}


class NoisyGradient(dj.workers.Worker):
  """The minibatch gradient plus N(0, 0.1^2) noise from the contribution's own key."""

  def contribute(self, ctx, read, state):
    loss, payload = ctx.gradient(read, 0)
    leaves, treedef = jax.tree.flatten(payload["grad"])
    keys = jax.random.split(ctx.key, len(leaves))
    noisy = [g + 0.1 * jax.random.normal(k, g.shape, g.dtype) for g, k in zip(leaves, keys)]
    return loss, {"grad": jax.tree.unflatten(treedef, noisy)}, ()


def _numpy_grad(params, x, y):
  """The mean squared error's gradient for the regression problem, in NumPy."""
  err = x @ params["w"] + params["b"] - y
  return {"w": 2 * x.T @ err / len(y), "b": np.float32(2 * err.mean())}


def _schedule():
  return dj.cluster.simulate(dj.cluster.asp(), dj.cluster.workers(4), num_updates=24, seed=5)


def test_a_worker_that_pushes_data_is_sgd_at_the_current_parameters():
  data, loss_fn, params = regression_problem()
  schedule = _schedule()
  assert schedule.max_staleness.max() > 0  # the delays are real: a gradient at the read would differ
  res = dj.simulate(loss_fn, optax.sgd(LR), params, data, schedule, seed=3, worker=PushBatch(),
                    sampling=dj.Sampling(batch_size=BATCH))
  contrib = schedule.contributions
  # The draws each worker made before each contribution (one minibatch each), in update order.
  draws, seen = [], {}
  for m in contrib.worker:
    draws.append(seen.get(int(m), 0))
    seen[int(m)] = draws[-1] + 1
  w = {k: np.asarray(v, np.float32) for k, v in params.items()}
  losses = []
  for u, (m, d) in enumerate(zip(contrib.worker, draws)):
    idx = np.asarray(minibatch_indices(3, u, int(m), d, num_examples=len(data["y"]), batch_size=BATCH))
    x, y = data["x"][idx], data["y"][idx]
    losses.append(np.mean((x @ w["w"] + w["b"] - y) ** 2))
    g = _numpy_grad(w, x, y)
    w = {k: (w[k] - LR * g[k]).astype(np.float32) for k in w}
  np.testing.assert_allclose(res.params["w"], w["w"], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(res.params["b"], w["b"], rtol=1e-5, atol=1e-6)
  # The history's loss is the learner's, at the parameters each update was applied to.
  np.testing.assert_allclose(res.history.loss, losses, rtol=1e-5, atol=1e-6)
  stale = dj.simulate(loss_fn, optax.sgd(LR), params, data, schedule, seed=3, sampling=dj.Sampling(batch_size=BATCH))
  assert not np.allclose(stale.params["w"], res.params["w"])


def test_a_workers_own_key_is_a_function_of_the_contribution():
  data, loss_fn, params = regression_problem()
  schedule = _schedule()
  runs = [dj.simulate(loss_fn, optax.sgd(LR), params, data, schedule, seed=3, worker=NoisyGradient(),
                      sampling=dj.Sampling(batch_size=BATCH), execution=dj.Execution(lanes=lanes))
          for lanes in (1, 4)]
  for a, b in zip(jax.tree.leaves(runs[0].params), jax.tree.leaves(runs[1].params), strict=True):
    np.testing.assert_array_equal(a, b)
  plain = dj.simulate(loss_fn, optax.sgd(LR), params, data, schedule, seed=3, sampling=dj.Sampling(batch_size=BATCH))
  assert not np.allclose(plain.params["w"], runs[0].params["w"])
  # The key is the contribution's: a NumPy-free check that it depends on the update, worker and draw alone.
  keys = [jax.random.key_data(contribution_key(3, u, m, d)) for u, m, d in ((0, 0, 0), (1, 0, 0), (0, 1, 0),
                                                                            (0, 0, 1), (0, 0, 0))]
  assert len({np.asarray(k).tobytes() for k in keys}) == 4
  np.testing.assert_array_equal(keys[0], keys[4])


def test_a_payload_without_a_gradient_needs_at_update():
  class NoGrad(dj.workers.Worker):
    def contribute(self, ctx, read, state):
      batch, _ = ctx.minibatch(0)
      return jnp.float32(0), {"batch": batch}, ()

  data, loss_fn, params = regression_problem()
  with pytest.raises(TypeError, match="NoGrad.contribute must return .* 'grad'"):
    dj.simulate(loss_fn, optax.sgd(LR), params, data, _schedule(), seed=3, worker=NoGrad(),
                sampling=dj.Sampling(batch_size=BATCH))
