"""Asyn-ProxSGD (Zhu, Niu & Li): dj.tap_sgd under dj.simulate on a nonconvex loss plus L1, against float64 NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import delayjax as dj

N, D = 40, 6
ALPHA = 0.5  # weight of the nonconvex penalty sum_j w_j^2 / (1 + w_j^2)
L1 = 0.15  # strong enough that the stationary point has exact zeros
LR = 0.5
W0 = np.array([1.5, -2.0, 0.5, 3.0, -0.3, 0.8])


def data() -> dict[str, np.ndarray]:
  rng = np.random.default_rng(1802)
  x = rng.standard_normal((N, D))
  y = np.where(x @ rng.standard_normal(D) + 0.5 * rng.standard_normal(N) > 0, 1.0, -1.0)
  return {"x": x, "y": y}


def loss_fn(w, batch):
  """The smooth part F: logistic loss plus the nonconvex penalty (the L1 term is the prox's)."""
  margins = batch["y"] * (batch["x"] @ w)
  return jnp.mean(jnp.logaddexp(0.0, -margins)) + ALPHA * jnp.sum(w ** 2 / (1.0 + w ** 2))


def numpy_grad(w: np.ndarray, d: dict[str, np.ndarray]) -> np.ndarray:
  """The full gradient of F in float64, written out by hand."""
  margins = d["y"] * (d["x"] @ w)
  s = -d["y"] / (1.0 + np.exp(margins))  # d/dz log(1 + exp(-y z)) at z = x.w
  return d["x"].T @ s / len(s) + ALPHA * 2.0 * w / (1.0 + w ** 2) ** 2


def soft(x: np.ndarray, t: float) -> np.ndarray:
  return np.sign(x) * np.maximum(np.abs(x) - t, 0.0)


def numpy_asyn_prox_sgd(schedule: dj.cluster.Schedule, d: dict[str, np.ndarray], num_updates: int) -> np.ndarray:
  """Every version ``[U + 1, D]``: x_{k+1} = prox(x_k - eta/N sum_i grad F(x_{k - tau(k, i)})), read by read.

  Each contribution is a full gradient at the version its worker read; an update's contributions are
  averaged with their minibatch counts as weights (a sample's own delay per term of the paper's sum).
  """
  c = schedule.contributions
  versions = [W0.copy()]
  for k in range(num_updates):
    rows = np.flatnonzero(c.update == k)
    x = versions[k]
    if rows.size == 0:
      versions.append(x.copy())
      continue
    weights = c.num_batches[rows].astype(np.float64)
    g = sum(w * numpy_grad(versions[v], d) for w, v in zip(weights, c.read_version[rows])) / weights.sum()
    versions.append(soft(x - LR * g, LR * L1))
  return np.stack(versions)


def simulate_versions(schedule: dj.cluster.Schedule, d: dict[str, np.ndarray], num_updates: int) -> np.ndarray:
  """Versions 0 .. U of dj.tap_sgd through dj.simulate in float64, every gradient over the whole data set."""
  with jax.enable_x64(True):
    result = dj.simulate(loss_fn, dj.tap_sgd(dj.prox_l1(L1), LR), jnp.asarray(W0), d, schedule,
                         num_updates=num_updates, sampling=dj.Sampling(batch_size=N, scheme="epoch"),
                         record=dj.Record(eval_fn=lambda w: w, every=1))
    steps, got = np.asarray(result.history.eval_update), np.asarray(result.history.eval_metrics)
    assert got.dtype == np.float64
  assert steps.tolist() == list(range(num_updates + 1))  # version 0 (the initial parameters) to U
  return got


def schedules(num_updates: int) -> dict[str, dj.cluster.Schedule]:
  workers = dj.cluster.workers(4, compute="exponential")
  return {"asp": dj.cluster.simulate(dj.cluster.asp(), workers, num_updates, seed=3),
          "k_async": dj.cluster.simulate(dj.cluster.k_async(2), workers, num_updates, seed=3)}


@pytest.mark.parametrize("paradigm", ["asp", "k_async"])
def test_tap_sgd_through_simulate_is_asyn_prox_sgd_on_a_nonconvex_loss(paradigm):
  num_updates = 60
  schedule = schedules(num_updates)[paradigm]
  c = schedule.contributions
  assert c.staleness.max() >= 2  # the reads are stale
  if paradigm == "k_async":  # some updates average two gradients read at different versions
    assert any(len(set(c.read_version[c.update == k])) > 1 for k in range(num_updates))
  d = data()
  want = numpy_asyn_prox_sgd(schedule, d, num_updates)
  np.testing.assert_allclose(simulate_versions(schedule, d, num_updates), want, rtol=1e-11, atol=1e-13)
  assert np.max(np.abs(want[-1] - W0)) > 0.5  # the run moved


def test_smooth_part_is_nonconvex_and_asyn_prox_sgd_reaches_a_sparse_stationary_point():
  d = data()
  # The penalty's curvature 2(1 - 3w^2) / (1 + w^2)^3 is -0.5 at w = 1: F's Hessian there has a negative eigenvalue.
  with jax.enable_x64(True):
    hessian = np.asarray(jax.hessian(loss_fn)(jnp.ones(D), {k: jnp.asarray(v) for k, v in d.items()}))
  assert np.linalg.eigvalsh(hessian).min() < 0
  num_updates = 600
  schedule = schedules(num_updates)["asp"]
  versions = numpy_asyn_prox_sgd(schedule, d, num_updates)
  prox = dj.prox_l1(L1)
  norms = [dj.analysis.gradient_mapping_norm(w, numpy_grad(w, d), prox, LR) for w in versions[[0, 100, -1]]]
  assert norms[0] > 0.1 and norms[1] < norms[0] and norms[2] < 1e-8
  assert 1 <= np.sum(versions[-1] == 0.0) < D  # the L1 term's exact zeros, not all of them
  assert np.max(schedule.contributions.staleness) >= 4
