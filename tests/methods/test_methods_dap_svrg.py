"""DAP-SVRG (DAP-SGD's proximal step at the stale read on SVRG's estimate): the server-side step is the DAP-SGD
worker's, the rule under stale reads is a float64 NumPy re-implementation, and its rate is linear on a strongly
convex composite problem where DAP-SGD stalls."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj
from tests.runtime.simulate_reference import round_robin_stale_reads
from delayjax.transforms._dap import _step_at_read

sys.path.insert(0, os.path.dirname(__file__))
from methods_reference import composite_optimum, lasso_problem, soft  # noqa: E402

L1 = 0.1
S = 0.4  # below 2 sin(pi / 14) ~ 0.445, the stable server rate of a coordinate the prox zeroes at tau = 3


def test_the_server_side_step_is_dap_sgds_worker():
  """The same arithmetic in two programs (XLA may contract it differently): equal to float64 rounding."""
  problem = lasso_problem()
  dap = dj.dap_sgd(dj.prox_l1(L1), 0.3, server_rate=S)
  kw = dict(num_updates=60, seed=2, sampling=dj.Sampling(batch_size=4))
  with jax.enable_x64(True):
    args = (problem.loss_fn, jnp.ones(problem.num_features, jnp.float64), problem.data(jnp.float64))
    on_workers = dj.simulate(args[0], dap.server, *args[1:], dj.delays.uniform(3),
                             worker=dj.workers.LocalSteps(dap.local_steps, dap.worker), **kw)
    on_server = dj.simulate(args[0], optax.chain(_step_at_read(dap.worker), dap.server), *args[1:],
                            dj.delays.uniform(3), **kw)
  np.testing.assert_allclose(np.asarray(on_server.params), np.asarray(on_workers.params), rtol=1e-12, atol=1e-15)
  assert on_workers.history.staleness.max() == 3


def test_the_rule_under_stale_reads_is_the_numpy_reference():
  problem = lasso_problem(n=16, d=4)
  n, tau, seed, gamma = problem.num_samples, 3, 7, 0.1
  x, y, lam = np.asarray(problem.features), np.asarray(problem.targets), problem.lam
  updates = 3 * n
  schedule, delays = round_robin_stale_reads(updates, tau, seed=3)
  t = jnp.arange(updates)
  picks = np.asarray(jax.vmap(lambda u, m, k: dj.runtime.minibatch_indices(
      seed, u, m, k, num_examples=n, batch_size=1)[0])(t, t % (tau + 1), t // (tau + 1)))
  with jax.enable_x64(True):
    got = dj.simulate(problem.loss_fn, dj.dap_svrg(dj.prox_l1(L1), gamma, server_rate=S),
                      jnp.zeros(problem.num_features, jnp.float64), problem.data(jnp.float64), schedule, seed=seed,
                      sampling=dj.Sampling(batch_size=1), worker=dj.workers.Gradient(snapshot_every=n))

  def grad(w, i):
    return x[i] * (x[i] @ w - y[i]) + lam * w

  versions = [np.zeros(problem.num_features)]
  for u in range(updates):
    w = versions[-1]
    if u % n == 0:
      snap, mu = w, np.mean([grad(w, i) for i in range(n)], axis=0)
    read, i = versions[u - delays[u]], picks[u]
    g = grad(read, i) - grad(snap, i) + mu
    versions.append(w + S * (soft(read - gamma * g, gamma * L1) - read))
  np.testing.assert_allclose(np.asarray(got.params), versions[-1], rtol=1e-10, atol=1e-13)
  assert np.max(np.abs(versions[-1] - versions[n])) > 1e-3  # it moved after the first epoch


@pytest.mark.parametrize("tau", [0, 3])
def test_linear_rate_on_a_strongly_convex_problem_where_dap_sgd_stalls(tau):
  problem = lasso_problem()
  n = problem.num_samples
  w_star = composite_optimum(problem, L1)
  assert 0 < np.sum(w_star == 0) < len(w_star)  # the prox zeroes some coordinates at the optimum, not all
  assert problem.strong_convexity() > 0
  gamma, epochs = 0.5 / problem.smoothness().l_max, 60

  def distances(tx, worker):
    with jax.enable_x64(True):
      result = dj.simulate(problem.loss_fn, tx, jnp.zeros(problem.num_features, jnp.float64),
                           problem.data(jnp.float64), dj.delays.uniform(tau), num_updates=epochs * n, seed=0,
                           sampling=dj.Sampling(batch_size=1), worker=worker,
                           record=dj.Record(eval_fn=lambda w: w, every=n, history="evaluations"))
    return np.array([np.max(np.abs(w - w_star)) for w in np.asarray(result.history.eval_metrics)])

  svrg = distances(dj.dap_svrg(dj.prox_l1(L1), gamma, server_rate=S), dj.workers.Gradient(snapshot_every=n))
  # Linear: every ten epochs divide the distance by more than 10, down to the optimum's own precision.
  above = svrg[svrg > 1e-11]
  assert svrg[-1] < 1e-8 and np.all(svrg[:len(above)] == above)
  np.testing.assert_array_less(above[10::10] / above[:-10:10], 0.1)
  dap = dj.dap_sgd(dj.prox_l1(L1), gamma, server_rate=S)
  sgd = distances(dap.server, dj.workers.LocalSteps(dap.local_steps, dap.worker))
  assert np.min(sgd[epochs // 2:]) > 1e-3  # the stochastic gradient's noise floor


def test_bad_input():
  with pytest.raises(TypeError, match="learning_rate must be a float for dap_sgd"):
    dj.dap_svrg(dj.prox_l1(L1), optax.constant_schedule(0.1))
  with pytest.raises(TypeError, match="prox must be a callable"):
    dj.dap_svrg("l1", 0.1)
  with pytest.raises(ValueError, match="server_rate"):
    dj.dap_svrg(dj.prox_l1(L1), 0.1, server_rate=-1.0)
  tx = dj.dap_svrg(dj.prox_l1(L1), 0.1)
  w = jnp.zeros(2)
  with pytest.raises(ValueError, match="svrg needs the extra argument snapshot_grad="):
    tx.update(w, tx.init(w), w, full_grad=w)
