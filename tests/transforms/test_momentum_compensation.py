"""Momentum compensation (after Fang, Huang & Lin 2018): Nesterov whose look-ahead spans the delay.

The reference is written in the rule's own terms, not the library's update
formula: an iterate ``x``, a momentum ``m`` and published parameters
``y = x - eta * c(tau) * m`` with ``c(tau) = beta + beta^2 + ... + beta^(tau+1)``
summed term by term, in float64 NumPy.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj
from remedy_checks import (assert_chain_and_unknown_extra_args, assert_jit_traces_once, params_tree,
                           random_like)


def lookahead(beta, tau):
  return sum(beta ** i for i in range(1, tau + 1 + 1))


class Reference:
  """x_{t+1} = x_t - eta m_{t+1}, m_{t+1} = g_t + beta m_t, published y_{t+1} = x_{t+1} - eta c(tau_t) m_{t+1}."""

  def __init__(self, y0, eta, beta):
    self.x, self.m, self.eta, self.beta = np.array(y0, np.float64), np.zeros_like(y0, np.float64), eta, beta
    self.y = self.x.copy()

  def step(self, g, tau):
    self.m = np.asarray(g, np.float64) + self.beta * self.m
    self.x = self.x - self.eta * self.m
    self.y = self.x - self.eta * lookahead(self.beta, tau) * self.m
    return self.y


def quadratic(d=4, seed=0):
  rng = np.random.default_rng(seed)
  q, _ = np.linalg.qr(rng.normal(size=(d, d)))
  a = (q * np.geomspace(0.05, 1.0, d)) @ q.T
  return (a + a.T) / 2, rng.normal(size=d)


def loss_fn(w, batch):
  e = w - batch["w"][0]
  return 0.5 * e @ (batch["a"][0] @ e)


def reference_run(a, w_star, eta, beta, delays, steps):
  """The stale-read process of dj.simulate: update t reads the parameters of version max(0, t - d_t)."""
  ref = Reference(np.zeros(len(w_star)), eta, beta)
  history = [ref.y.copy()]
  for t in range(steps):
    read = max(0, t - delays[t % len(delays)])
    history.append(ref.step(a @ (history[read] - w_star), t - read).copy())
  return np.array(history)


def _iterate(w):
  return w


# Injected hyper-parameters, set per run by dj.Runs: one compiled program serves every (eta, beta) of a delay sequence.
TX = optax.inject_hyperparams(dj.momentum_compensation)(learning_rate=0.1, momentum=0.5)
SETTINGS = [(0.05, 0.9), (0.02, 0.95), (0.1, 0.5), (0.3, 0.0)]  # the last: no momentum, delayed gradient descent


@pytest.mark.parametrize("delays", [
    [3],  # constant delay: the look-ahead is c(3) once the delay is reached
    [0, 2, 5, 1, 3, 0, 4],  # varying delays: the look-ahead changes from update to update
])
def test_simulate_matches_numpy_reference_under_fixed_delays(delays):
  a, w_star = quadratic()
  steps = 40
  with jax.enable_x64(True):
    data = {"a": jnp.asarray(a)[None], "w": jnp.asarray(w_star)[None]}
    runs = dj.Runs(seeds=[0] * len(SETTINGS), hyperparams={"learning_rate": [eta for eta, _ in SETTINGS],
                                                           "momentum": [beta for _, beta in SETTINGS]})
    results = dj.simulate(loss_fn, TX, jnp.zeros(4, jnp.float64), data, dj.delays.trace(delays), num_updates=steps,
                          seed=runs, sampling=dj.Sampling(batch_size=1),
                          record=dj.Record(eval_fn=_iterate, every=1, history="evaluations"))
    for (eta, beta), result in zip(SETTINGS, results):
      got = np.asarray(result.history.eval_metrics, np.float64)
      expected = reference_run(a, w_star, eta, beta, delays, steps)
      np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12, err_msg=f"eta={eta}, beta={beta}")


def test_update_matches_reference_step_by_step_with_per_leaf_staleness():
  params, eta, beta = params_tree(), 0.1, 0.8
  tx = dj.momentum_compensation(eta, beta)
  state = tx.init(params)
  refs = {k: Reference(np.asarray(v), eta, beta) for k, v in params.items()}
  ys = {k: np.asarray(v, np.float64) for k, v in params.items()}
  delays = [{"w": 0, "b": 2}, {"w": 3, "b": 2}, {"w": 1, "b": 0}, {"w": 5, "b": 5}, {"w": 0, "b": 1}]
  for i, tau in enumerate(delays):
    g = random_like(params, i)
    u, state = tx.update(g, state, params, staleness={k: jnp.int32(v) for k, v in tau.items()})
    for k in params:
      y_new = refs[k].step(np.asarray(g[k]), tau[k])
      np.testing.assert_allclose(np.asarray(u[k], np.float64), y_new - ys[k], rtol=2e-5, atol=2e-6)
      ys[k] = y_new


@pytest.mark.parametrize("lr", [0.3, optax.linear_schedule(0.5, 0.1, 4)])
def test_zero_staleness_is_optax_nesterov_bit_for_bit(lr):
  params = params_tree()
  tx, ref = dj.momentum_compensation(lr, 0.9), optax.sgd(lr, momentum=0.9, nesterov=True)
  s, r = tx.init(params), ref.init(params)
  for i in range(5):
    g = random_like(params, i)
    u, s = tx.update(g, s, params, staleness=0, stale_params=params, worker=0)
    v, r = ref.update(g, r, params)
    chex.assert_trees_all_equal(u, v)


def test_zero_momentum_is_sgd_at_any_staleness():
  params = params_tree()
  tx, ref = dj.momentum_compensation(0.2, 0.0), optax.sgd(0.2)
  s, r = tx.init(params), ref.init(params)
  for i, tau in enumerate([0, 3, 7, 1]):
    g = random_like(params, i)
    u, s = tx.update(g, s, params, staleness=tau)
    v, r = ref.update(g, r, params)
    chex.assert_trees_all_equal(u, v)


def test_constant_delay_sums_to_the_compensated_lookahead():
  """From y_0 = x_0 with m = 0: after one gradient of staleness tau the move is -eta (1 + c(tau)) g: the point
  x_{1+tau} + beta v_{1+tau} where synchronous Nesterov would evaluate tau updates later if no gradient came."""
  beta, eta, g = 0.7, 0.5, jnp.array([1.0, -2.0])
  for tau in range(5):
    tx = dj.momentum_compensation(eta, beta)
    u, _ = tx.update(g, tx.init(jnp.zeros(2)), staleness=tau)
    np.testing.assert_allclose(u, -eta * (1 + lookahead(beta, tau)) * np.asarray(g), rtol=1e-6)


def test_jit_chain_and_unknown_extra_args():
  params = params_tree()
  tx = dj.momentum_compensation(0.1, 0.9)
  assert_jit_traces_once(tx, params, lambda i: {"staleness": jnp.int32(i + 1)})
  assert_chain_and_unknown_extra_args(tx, params, {"staleness": 2, "worker": 0})


@pytest.mark.parametrize("make,error,words", [
    (lambda: dj.momentum_compensation(0.0), ValueError, "learning_rate"),
    (lambda: dj.momentum_compensation(-1.0), ValueError, "learning_rate"),
    (lambda: dj.momentum_compensation(0.1, momentum=1.0), ValueError, "momentum"),
    (lambda: dj.momentum_compensation(0.1, momentum=-0.1), ValueError, "momentum"),
    (lambda: dj.momentum_compensation(0.1, momentum="high"), TypeError, "momentum"),
    (lambda: dj.momentum_compensation("fast"), TypeError, "learning_rate"),
])
def test_bad_hyperparameters_name_the_argument(make, error, words):
  with pytest.raises(error, match=words):
    make()


def test_bad_update_inputs_are_refused():
  tx = dj.momentum_compensation(0.1)
  state = tx.init(jnp.zeros(3))
  with pytest.raises(ValueError, match="staleness"):
    tx.update(jnp.ones(3), state)
  with pytest.raises(ValueError, match="staleness"):
    tx.update(jnp.ones(3), state, staleness=-1)
  with pytest.raises(ValueError, match="shape"):
    tx.update(jnp.ones(2), state, staleness=1)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_dtypes_are_preserved(dtype):
  params = {"w": jnp.ones(3, dtype)}
  tx = dj.momentum_compensation(0.1, 0.9)
  state = tx.init(params)
  for tau in (0, 3):
    u, state = tx.update({"w": jnp.full(3, 0.5, dtype)}, state, params, staleness=tau)
    assert u["w"].dtype == dtype and state.momentum["w"].dtype == dtype
