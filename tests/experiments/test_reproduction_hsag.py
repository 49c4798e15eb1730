"""experiments.hsag: every run is dj.simulate of dj.hsag, the HSAG rule of the module docstring under stale reads
with the epoch barrier, checked against a float64 NumPy re-implementation; and its cost accounting."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import delayjax as dj
from experiments import hsag
from experiments import variance_reduction as vr

CONFIG = dict(hsag.SCALES["quick"], lsq_n=40, lsq_d=5, epochs=3, taus=[0, 3])
TAU, SEED = 3, 5
WORKERS = max(CONFIG["taus"]) + 1


def _delays(num_updates, tau, seed):
  """d_t of dj.delays.uniform(tau) as dj.simulate draws it for a delay model (key fold_in(key(seed), 0), then t)."""
  key = jax.random.fold_in(jax.random.key(seed), 0)
  draw = jax.vmap(lambda t: jax.random.randint(jax.random.fold_in(key, t), (), 0, tau + 1, dtype=jnp.int32))
  return np.asarray(draw(jnp.arange(num_updates)))


def reference(finite_sum, members, epochs, eta, barrier):
  """The iterates at every epoch end, sequentially in float64 NumPy: update t reads version t - min(d_t, cap)
  (cap t, or with the barrier the position in the epoch), draws example i_t (worker t mod W's (t div W)-th draw);
  anchors: the table row of i in S (zero, then the gradient at the read where it was last drawn), else the
  snapshot, the iterate at the epoch's start."""
  x, y, lam = np.asarray(finite_sum.features), np.asarray(finite_sum.targets), finite_sum.lam
  n, d = x.shape
  in_s = np.zeros(n, bool)
  in_s[members] = True

  def grad(w, i):
    return x[i] * (x[i] @ w - y[i]) + lam * w

  updates = epochs * n
  delays = _delays(updates, TAU, SEED)
  t = jnp.arange(updates)
  picks = np.asarray(jax.vmap(lambda u, m, k: dj.runtime.minibatch_indices(
      SEED, u, m, k, num_examples=n, batch_size=1)[0])(t, t % WORKERS, t // WORKERS))
  table, versions, snap = np.zeros((n, d)), [np.zeros(d)], None
  for u in range(updates):
    w = versions[-1]
    if u % n == 0:
      snap = w
    read = versions[u - min(delays[u], u % n if barrier else u)]
    i = picks[u]
    anchor = np.array([table[j] if in_s[j] else grad(snap, j) for j in range(n)])
    v = grad(read, i) - anchor[i] + anchor.mean(axis=0)
    if in_s[i]:
      table[i] = grad(read, i)
    versions.append(w - eta * v)
  return np.stack(versions[::n])


@pytest.mark.parametrize("method", ["hsag", "saga"])
def test_a_run_is_the_numpy_reference(method):
  finite_sum, solution, l_max, _ = vr.problem_facts(CONFIG, hsag.PROBLEM)
  n = finite_sum.num_samples
  eta = CONFIG["step_scale"] / l_max
  record = hsag.run(CONFIG, {"key": f"{method}/tau={TAU}", "method": method, "tau": TAU}, SEED, lambda *a: None)
  members = hsag.saga_set(method, n, CONFIG["hsag_fraction"])
  iterates = reference(finite_sum, members, CONFIG["epochs"], eta, barrier=method == "hsag")
  expected = np.array([dj.problems.suboptimality(finite_sum, w, solution=solution) for w in iterates])
  np.testing.assert_allclose(np.asarray(record["curves"]["suboptimality"]), expected, rtol=1e-9)
  assert expected[-1] < 0.5 * expected[1]  # the run went somewhere
  assert record["metrics"]["stored_gradients"] == len(members)


def test_the_sets_and_their_costs_interpolate_svrg_and_saga():
  n = 10
  assert hsag.saga_set("svrg", n, 0.5).size == 0
  np.testing.assert_array_equal(hsag.saga_set("saga", n, 0.5), np.arange(n))
  np.testing.assert_array_equal(hsag.saga_set("hsag", n, 0.5), [0, 2, 4, 6, 8])
  np.testing.assert_array_equal(hsag.saga_set("hsag", n, 0.3), [0, 3, 6])
  assert [hsag.grad_evals_per_epoch(m, 0.5) for m in ("sgd", "saga", "hsag", "svrg")] == [1.0, 1.0, 2.0, 3.0]
  # The ends of HSAG's cost line are SAGA's (f = 1) and SVRG's (f = 0).
  assert hsag.grad_evals_per_epoch("hsag", 1.0) == 1.0 and hsag.grad_evals_per_epoch("hsag", 0.0) == 3.0
