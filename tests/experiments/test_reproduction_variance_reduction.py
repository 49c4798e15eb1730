"""experiments.variance_reduction: every run is dj.simulate, and it is the stale-read SGD / AsySVRG / ASAGA of the
module docstring, checked against a float64 NumPy re-implementation of those rules."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj
from experiments import variance_reduction as vr

CONFIG = dict(vr.SCALES["quick"], lsq_n=40, lsq_d=5, epochs=3, taus=[0, 3, 7])
# Runs at tau = 3 among taus up to 7: eight round-robin workers, more than tau needs.
TAU, WORKERS, SEED = 3, 8, 5


def _delays(num_updates, tau, seed):
  """d_t of dj.delays.uniform(tau) as dj.simulate draws it for a delay model (key fold_in(key(seed), 0), then t)."""
  key = jax.random.fold_in(jax.random.key(seed), 0)
  draw = jax.vmap(lambda t: jax.random.randint(jax.random.fold_in(key, t), (), 0, tau + 1, dtype=jnp.int32))
  return np.asarray(draw(jnp.arange(num_updates)))


def _picks(num_updates, workers, n, seed):
  """The example of each update: worker t mod W, its (t div W)-th draw (dj.runtime.minibatch_indices); the same
  at every tau."""
  t = jnp.arange(num_updates)
  draw = jax.vmap(lambda u, m, k: dj.runtime.minibatch_indices(seed, u, m, k, num_examples=n, batch_size=1)[0])
  return np.asarray(draw(t, t % workers, t // workers))


def reference(finite_sum, method, tau, epochs, eta, seed, barrier=True):
  """The iterates at every epoch end of the module docstring's rules, sequentially in float64 NumPy.

  Update t reads version t - min(d_t, cap) (cap t; for SVRG with ``barrier`` the position in the epoch) and
  takes the gradient of example i_t there, grad f_i(w) = s_i(w) x_i + lam w. SVRG: epochs of n updates, the
  snapshot the last iterate with its full gradient. SAGA: a table of the data-fit scalars s_i (float32, as
  dj.saga(table="scalars") keeps them) starting at zero, the L2 term untabled.
  """
  x, y, lam = np.asarray(finite_sum.features), np.asarray(finite_sum.targets), finite_sum.lam
  n, d = x.shape
  logistic = finite_sum.kind == "logistic"

  def scalar(w, i):
    z = x[i] @ w
    return -y[i] / (1.0 + np.exp(y[i] * z)) if logistic else z - y[i]

  def full_grad(w):
    z = x @ w
    s = -y / (1.0 + np.exp(y * z)) if logistic else z - y
    return x.T @ s / n + lam * w

  num_updates = epochs * n
  delays, picks = _delays(num_updates, tau, seed), _picks(num_updates, WORKERS, n, seed)
  versions = [np.zeros(d)]
  table = np.zeros(n, np.float32)
  snap = mu = None
  for t in range(num_updates):
    w = versions[-1]
    cap = t % n if (method == "svrg" and barrier) else t
    read = versions[t - min(delays[t], cap)]
    i = picks[t]
    g = scalar(read, i) * x[i] + lam * read
    if method == "svrg":
      if t % n == 0:
        snap, mu = w, full_grad(w)
      g = g - (scalar(snap, i) * x[i] + lam * snap) + mu
    elif method == "saga":
      s_old = table[i].astype(np.float64)
      g = g - s_old * x[i] + x.T @ table.astype(np.float64) / n
      table[i] = np.float32(scalar(read, i))
    versions.append(w - eta * g)
  return np.stack(versions[::n])


def _run(name, method, epochs=3):
  finite_sum = vr.problem(CONFIG, name)
  config = dict(CONFIG, epochs=epochs)
  spec = {"key": f"{name}/{method}/tau={TAU}", "problem": name, "method": method, "tau": TAU}
  record = vr.run(config, spec, SEED, lambda done, total: None)
  return finite_sum, record, config["step_scale"] / finite_sum.smoothness().l_max


def _curve(finite_sum, iterates):
  solution = dj.problems.optimum(finite_sum)
  return np.array([dj.problems.suboptimality(finite_sum, w, solution=solution) for w in iterates])


@pytest.mark.parametrize("method", vr.METHODS)
def test_a_least_squares_run_is_the_numpy_reference(method):
  finite_sum, record, eta = _run("least_squares", method)
  expected = _curve(finite_sum, reference(finite_sum, method, TAU, 3, eta, SEED))
  got = np.asarray(record["curves"]["suboptimality"])
  # SAGA's table sum adds float32 differences of its scalars: agreement to float32 rounding, not bit for bit.
  np.testing.assert_allclose(got, expected, rtol=1e-8 if method == "saga" else 1e-12)
  assert expected[-1] < 0.5 * expected[1]  # the runs went somewhere


@pytest.mark.slow
@pytest.mark.parametrize("method", ["svrg", "saga"])
def test_a_digits_logistic_epoch_is_the_numpy_reference(method):
  finite_sum, record, eta = _run("digits_logreg", method, epochs=1)
  expected = _curve(finite_sum, reference(finite_sum, method, TAU, 1, eta, SEED))
  np.testing.assert_allclose(np.asarray(record["curves"]["suboptimality"]), expected,
                             rtol=1e-8 if method == "saga" else 1e-12)


def test_svrg_reads_never_precede_their_epoch_and_the_barrier_changes_the_run():
  """The barrier is seen: without it a read at the start of an epoch would go back into the previous one."""
  finite_sum = vr.problem(CONFIG, "least_squares")
  n, updates = finite_sum.num_samples, 3 * finite_sum.num_samples
  with jax.enable_x64(True):
    schedule = vr.stale_reads(dj.delays.uniform(TAU), updates, SEED, WORKERS, epoch=n)
  c = schedule.contributions
  t = np.repeat(np.arange(updates), np.diff(schedule.offsets))
  assert np.all(c.read_version >= t - t % n)
  np.testing.assert_array_equal(t - c.read_version, np.minimum(_delays(updates, TAU, SEED), t % n))
  eta = CONFIG["step_scale"] / finite_sum.smoothness().l_max
  with_barrier = reference(finite_sum, "svrg", TAU, 3, eta, SEED)
  without = reference(finite_sum, "svrg", TAU, 3, eta, SEED, barrier=False)
  assert np.max(np.abs(with_barrier[-1] - without[-1])) > 1e-6


def test_without_a_barrier_the_schedule_is_the_one_dj_simulate_makes_of_the_delay_model():
  finite_sum = vr.problem(CONFIG, "least_squares")
  updates, model = 2 * finite_sum.num_samples, dj.delays.uniform(TAU)
  with jax.enable_x64(True):
    args = (finite_sum.loss_fn, optax.sgd(0.01), jnp.zeros(finite_sum.num_features, jnp.float64),
            finite_sum.data(jnp.float64))
    kw = dict(num_updates=updates, seed=SEED, sampling=dj.Sampling(batch_size=1))
    by_model = dj.simulate(*args, model, **kw)
    by_schedule = dj.simulate(*args, vr.stale_reads(model, updates, SEED, TAU + 1), **kw)
  np.testing.assert_array_equal(np.asarray(by_schedule.params), np.asarray(by_model.params))
  np.testing.assert_array_equal(by_schedule.history.staleness, by_model.history.staleness)
  assert by_model.history.staleness.max() == TAU


def test_fewer_workers_than_a_delay_needs_are_refused():
  with pytest.raises(ValueError, match="workers must be at least max_delay \\+ 1 = 8"):
    vr.stale_reads(dj.delays.uniform(7), 20, 0, 4)


@pytest.mark.parametrize("method", ["svrg", "saga"])
def test_a_batch_of_seeds_gives_each_run_s_own_record_bit_for_bit(method):
  """One dj.simulate call of several seeds (each under its own schedule): every record equals the single run's
  exactly (NaN included, as JSON writes it), whatever its place in the batch."""
  spec = {"key": f"least_squares/{method}/tau={TAU}", "problem": "least_squares", "method": method, "tau": TAU}
  config = dict(CONFIG, epochs=2)
  seeds = [SEED, 2, 11]
  batched = vr.run_batch(config, [(spec, s) for s in seeds], lambda done, total: None)
  for seed, record in zip(seeds, batched, strict=True):
    alone = vr.run(config, spec, seed, lambda done, total: None)
    assert json.dumps(record, sort_keys=True) == json.dumps(alone, sort_keys=True)
  assert batched[0]["curves"]["suboptimality"] != batched[1]["curves"]["suboptimality"]
