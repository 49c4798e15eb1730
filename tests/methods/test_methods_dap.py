"""DAP-SGD (prox on the workers) and TAP-SGD (prox on the server) against a NumPy re-implementation."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj

sys.path.insert(0, os.path.dirname(__file__))
from methods_reference import composite_optimum, lasso_problem, soft  # noqa: E402

L1 = 0.2  # strong enough that the optimum has exact zeros
LR = 0.8
W0 = np.array([1.0, -1.0, 1.0, 1.0, -1.0, 1.0])  # every coordinate starts away from its optimum's
DELAYS = (0, 2, 1, 3, 3, 0, 2, 1, 3, 2, 0, 1)


def numpy_run(problem, rule: str, delays, num_updates: int, server_rate: float = 1.0) -> np.ndarray:
  """All versions ``[U + 1, d]`` of the two rules in float64 with full gradients; update t reads max(0, t - d_t)."""
  versions = [W0.copy()]
  for t in range(num_updates):
    w, read = versions[t], versions[max(0, t - delays[t % len(delays)])]
    g = problem.gradient(read)
    if rule == "dap":  # the worker takes the prox step at its read; the server adds the (scaled) delta
      versions.append(w + server_rate * (soft(read - LR * g, LR * L1) - read))
    else:  # the server takes the step and the prox at the current version
      versions.append(soft(w - LR * g, LR * L1))
  return np.stack(versions)


def simulate_run(problem, source, num_updates: int, eval_every: int, server_rate: float):
  """DAP-SGD's parameters at versions 0, eval_every, 2 eval_every, ... through dj.simulate (full gradients)."""
  dap = dj.dap_sgd(dj.prox_l1(L1), LR, server_rate=server_rate)
  # batch_size = N with epoch sampling: every gradient is the full gradient (summed in a shuffled order).
  result = dj.simulate(problem.loss_fn, dap.server, jnp.asarray(W0, jnp.float32), problem.data(), source,
                       num_updates=num_updates, sampling=dj.Sampling(batch_size=problem.num_samples, scheme="epoch"),
                       worker=dj.workers.LocalSteps(dap.local_steps, dap.worker),
                       record=dj.Record(eval_fn=lambda w: w, every=eval_every))
  return result.history.eval_update, np.asarray(result.history.eval_metrics)


def test_tap_matches_numpy_rule_on_stale_reads_and_converges():
  problem = lasso_problem()
  tx = dj.tap_sgd(dj.prox_l1(L1), LR)
  update, grad, data = jax.jit(tx.update), jax.jit(jax.grad(problem.loss_fn)), problem.data()
  versions, state = [jnp.asarray(W0, jnp.float32)], tx.init(jnp.asarray(W0, jnp.float32))
  for t in range(200):
    read = versions[max(0, t - DELAYS[t % len(DELAYS)])]
    g = grad(read, data)
    u, state = update(g, state, versions[t])
    versions.append(versions[t] + u)
  np.testing.assert_allclose(np.stack(versions), numpy_run(problem, "tap", DELAYS, 200), rtol=1e-4, atol=2e-5)
  np.testing.assert_allclose(np.asarray(versions[-1]), composite_optimum(problem, L1), atol=1e-4)


def test_dap_through_simulate_matches_numpy_rule_on_stale_reads_and_converges():
  problem = lasso_problem()
  steps, got = simulate_run(problem, dj.delays.trace(DELAYS), 200, 10, server_rate=0.5)
  want = numpy_run(problem, "dap", DELAYS, 200, server_rate=0.5)
  np.testing.assert_allclose(got, want[steps], rtol=1e-4, atol=2e-5)
  w_star = composite_optimum(problem, L1)
  assert np.sum(w_star == 0) >= 3
  np.testing.assert_allclose(got[-1], w_star, atol=1e-4)


def test_rules_agree_without_staleness_and_differ_with_it():
  problem = lasso_problem()
  fresh = [numpy_run(problem, r, (0,), 30) for r in ("dap", "tap")]
  np.testing.assert_allclose(fresh[0], fresh[1], rtol=1e-12, atol=1e-12)
  stale = [numpy_run(problem, r, DELAYS, 30) for r in ("dap", "tap")]
  assert np.max(np.abs(stale[0] - stale[1])) > 1e-2


def test_dap_with_a_plain_addition_cycles_at_exact_zeros_under_staleness():
  # The documented instability: killed coordinates follow x_{u+1} = x_u - x_{u - tau}.
  problem = lasso_problem()
  w_star = composite_optimum(problem, L1)
  plain = numpy_run(problem, "dap", DELAYS, 600, server_rate=1.0)[-len(DELAYS):]
  scaled = numpy_run(problem, "dap", DELAYS, 600, server_rate=0.5)[-1]
  assert np.max(np.abs(plain - w_star)) > 1e-2  # still cycling through a whole trace period
  np.testing.assert_allclose(scaled, w_star, atol=1e-10)
  np.testing.assert_allclose(numpy_run(problem, "tap", DELAYS, 600)[-1], w_star, atol=1e-10)


def test_worker_step_is_one_prox_gradient_step_and_the_server_adds_it():
  dap = dj.dap_sgd(dj.prox_l1(0.5), 0.25, server_rate=0.5)
  w = jnp.array([1.0, -0.05, 0.3])
  g = jnp.array([2.0, 0.0, -1.0])
  delta, _ = dap.worker.update(g, dap.worker.init(w), w)
  want = soft(np.asarray(w, np.float64) - 0.25 * np.asarray(g, np.float64), 0.125) - np.asarray(w, np.float64)
  np.testing.assert_allclose(np.asarray(delta), want, rtol=1e-6, atol=1e-7)
  server, _ = dap.server.update(-delta, dap.server.init(w), w)  # the runtime pushes w_read - w_after
  np.testing.assert_allclose(np.asarray(server), 0.5 * np.asarray(delta), rtol=1e-7)


def test_bad_inputs():
  with pytest.raises(TypeError, match="prox"):
    dj.dap_sgd("l1", 0.1)
  with pytest.raises(TypeError, match="prox"):
    dj.tap_sgd(None, 0.1)
  with pytest.raises(ValueError, match="learning_rate"):
    dj.dap_sgd(dj.prox_l1(0.1), 0.0)
  with pytest.raises(ValueError, match="server_rate"):
    dj.dap_sgd(dj.prox_l1(0.1), 0.1, server_rate=-1.0)
  with pytest.raises(TypeError, match="learning_rate must be a float"):
    dj.dap_sgd(dj.prox_l1(0.1), optax.constant_schedule(0.1))
