"""The local-optimizers recipe (Bogoychev et al. 2018) under dj.simulate against a NumPy loop where each worker
keeps its own Adam and the server adds the Adam steps it receives."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj
from experiments.local_optimizers import local_optimizers


def _numpy_adam_step(state, g, lr, b1=0.9, b2=0.999, eps=1e-8):
  m, v, t = state
  m, v, t = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g, t + 1
  return lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps), (m, v, t)


@pytest.mark.slow  # compiles a dj.simulate run (about 10 s on 2 cores)
@pytest.mark.standard_promotion  # optax.adam mixes int32 and floats
def test_local_optimizers_match_per_worker_numpy_adam_on_an_asp_schedule():
  rng = np.random.default_rng(1)
  xs = rng.standard_normal((32, 3)).astype(np.float32)
  ys = (xs @ np.array([0.5, -1.0, 2.0], np.float32)).astype(np.float32)
  data = {"x": jnp.asarray(xs), "y": jnp.asarray(ys)}
  params = {"w": jnp.zeros(3)}

  def loss_fn(p, batch):
    return 0.5 * jnp.mean((batch["x"] @ p["w"] - batch["y"]) ** 2)

  workers, lr, steps = 3, 0.05, 18
  sched = dj.cluster.simulate(dj.cluster.asp(), dj.cluster.workers(workers, compute="gamma"), steps, seed=2)
  tx, worker = local_optimizers(optax.adam(lr))
  result = dj.simulate(loss_fn, tx, params, data, sched, num_updates=steps, worker=worker,
                       sampling=dj.Sampling(batch_size=32, scheme="epoch"), seed=0)
  c = sched.contributions
  x64, y64 = xs.astype(np.float64), ys.astype(np.float64)
  history = [np.zeros(3)]
  adam = [(np.zeros(3), np.zeros(3), 0) for _ in range(workers)]
  for u in range(steps):
    m, w = int(c.worker[u]), history[int(c.read_version[u])]
    g = x64.T @ (x64 @ w - y64) / len(y64)
    step, adam[m] = _numpy_adam_step(adam[m], g, lr)
    history.append(history[-1] - step)
  np.testing.assert_allclose(result.params["w"], history[-1], rtol=1e-4, atol=1e-5)
  # One shared Adam on the same stale gradients is another run: the per-worker state is what the test pins.
  shared = [np.zeros(3)]
  state = (np.zeros(3), np.zeros(3), 0)
  for u in range(steps):
    w = shared[int(c.read_version[u])]
    step, state = _numpy_adam_step(state, x64.T @ (x64 @ w - y64) / len(y64), lr)
    shared.append(shared[-1] - step)
  assert np.max(np.abs(shared[-1] - history[-1])) > 1e-3
