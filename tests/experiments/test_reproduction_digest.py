"""experiments.digest against an independent float64 NumPy GCN: full-graph training, the stale halo cache, traffic."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from experiments import digest

STEPS, LR = 7, 0.5


def _tiny(seed: int = 3) -> tuple[digest.Graph, np.ndarray]:
  graph = digest.sbm_graph(12, 3, 4.0, 0.6, 5, 1.0, 0.5, seed)
  return graph, digest.random_partition(12, 3, seed)


def _params(seed: int = 0):
  return digest.init_gcn(jax.random.key(seed), (5, 4, 3))


def _a_hat(adjacency: np.ndarray) -> np.ndarray:
  a = adjacency.astype(np.float64) + np.eye(len(adjacency))
  d = a.sum(1) ** -0.5
  return d[:, None] * a * d[None, :]


def _reference(graph, owner, params, *, period, mode, steps=STEPS, lr=LR):
  """Plain SGD on a 2-layer GCN, written from the rule: each partition's loss on its own labelled nodes, its
  layer-2 input fresh on its nodes and the cache (refreshed to the exact hidden layer when t % period == 0)
  elsewhere, with no gradient through the cache; the partitions' gradients summed."""
  x = graph.features.astype(np.float64)
  adjacency = graph.adjacency & (owner[:, None] == owner[None, :]) if mode == "partition" else graph.adjacency
  a = _a_hat(adjacency)
  parts = owner.max() + 1
  owns = [np.ones(len(owner), bool)] if mode == "full" else [owner == p for p in range(parts)]
  y = np.eye(graph.labels.max() + 1)[graph.labels]
  train_w = graph.train / graph.train.sum()
  (w0, b0), (w1, b1) = [(np.asarray(w, np.float64), np.asarray(b, np.float64)) for w, b in params]
  cache, losses = None, []
  for t in range(steps):
    z1 = a @ x @ w0 + b0
    h1 = np.maximum(z1, 0.0)
    if t % period == 0:
      cache = h1.copy()
    grads = [np.zeros_like(v) for v in (w0, b0, w1, b1)]
    loss = 0.0
    for own in owns:
      h_in = np.where(own[:, None], h1, cache)
      z2 = a @ h_in @ w1 + b1
      logp = z2 - z2.max(1, keepdims=True)
      logp -= np.log(np.exp(logp).sum(1, keepdims=True))
      w = train_w * own
      loss -= np.sum(w * np.sum(y * logp, 1))
      dz2 = (np.exp(logp) - y) * w[:, None]
      dh_in = a.T @ dz2 @ w1.T
      dz1 = dh_in * own[:, None] * (z1 > 0)
      for g, d in zip(grads, ((a @ x).T @ dz1, dz1.sum(0), (a @ h_in).T @ dz2, dz2.sum(0))):
        g += d
    losses.append(loss)
    w0, b0, w1, b1 = (v - lr * g for v, g in zip((w0, b0, w1, b1), grads))
  return [(w0, b0), (w1, b1)], cache, np.array(losses)


def _check(out, ref):
  (p_ref, cache_ref, losses_ref) = ref
  for (w, b), (w_ref, b_ref) in zip(out["params"], p_ref):
    np.testing.assert_allclose(np.asarray(w), w_ref, rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(np.asarray(b), b_ref, rtol=2e-4, atol=2e-5)
  np.testing.assert_allclose(out["curves"]["loss"], losses_ref, rtol=2e-4, atol=1e-6)
  np.testing.assert_allclose(np.asarray(out["cache"][0]), cache_ref, rtol=2e-4, atol=2e-5)


def test_numpy_reference_gradient_is_the_full_graph_gradient():
  """The reference's backward pass (one partition owning everything) against central finite differences."""
  graph, owner = _tiny()
  params = [(np.asarray(w, np.float64), np.asarray(b, np.float64)) for w, b in _params()]
  _, _, loss0 = _reference(graph, owner, params, period=1, mode="full", steps=1, lr=0.0)
  (w0, _), _ = _reference(graph, owner, params, period=1, mode="full", steps=1, lr=1.0)[0]
  grad = params[0][0] - w0
  eps = 1e-6
  for i, j in ((0, 0), (2, 3), (4, 1)):
    bumped = []
    for sign in (1, -1):
      p = [(w.copy(), b.copy()) for w, b in params]
      p[0][0][i, j] += sign * eps
      bumped.append(_reference(graph, owner, p, period=1, mode="full", steps=1, lr=0.0)[2][0])
    assert (bumped[0] - bumped[1]) / (2 * eps) == pytest.approx(grad[i, j], rel=1e-5, abs=1e-9)
  assert loss0[0] > 0


@pytest.mark.parametrize("seed", [3, 4])
def test_full_mode_is_full_graph_gradient_descent(seed):
  graph, owner = _tiny(seed)
  out = digest.train_gcn(graph, owner, _params(seed), period=1, steps=STEPS, lr=LR, mode="full", optimizer="sgd")
  _check(out, _reference(graph, owner, _params(seed), period=1, mode="full"))
  # Full-graph training reports the full-graph loss as its own.
  np.testing.assert_allclose(out["curves"]["loss"], out["curves"]["train_loss"], rtol=1e-5)


def test_period_one_forward_is_the_full_graph_forward():
  """k = 1: at every step the partitions' summed loss is the full-graph loss at the same parameters."""
  graph, owner = _tiny()
  out = digest.train_gcn(graph, owner, _params(), period=1, steps=STEPS, lr=LR, optimizer="sgd")
  np.testing.assert_allclose(out["curves"]["loss"], out["curves"]["train_loss"], rtol=1e-5)
  assert np.all(out["curves"]["cache_error"] == 0)
  # ... but its gradient lacks the paths through other partitions: the runs part after the first step.
  full = digest.train_gcn(graph, owner, _params(), period=1, steps=STEPS, lr=LR, mode="full", optimizer="sgd")
  assert out["curves"]["loss"][0] == pytest.approx(full["curves"]["loss"][0], rel=1e-6)
  assert not np.allclose(out["curves"]["loss"][-1], full["curves"]["loss"][-1], rtol=1e-4)


@pytest.mark.parametrize("period", [1, 3, 5])
def test_stale_cache_matches_numpy(period):
  graph, owner = _tiny()
  out = digest.train_gcn(graph, owner, _params(1), period=period, steps=STEPS, lr=LR, optimizer="sgd")
  _check(out, _reference(graph, owner, _params(1), period=period, mode="digest"))
  np.testing.assert_array_equal(out["curves"]["refresh"], np.arange(STEPS) % period == 0)
  assert (out["curves"]["cache_error"][np.arange(STEPS) % period != 0] > 0).all()


def test_partition_mode_drops_the_cut_edges():
  graph, owner = _tiny()
  out = digest.train_gcn(graph, owner, _params(), period=1, steps=STEPS, lr=LR, mode="partition",
                         optimizer="sgd")
  _check(out, _reference(graph, owner, _params(), period=1, mode="partition"))
  assert out["traffic"] == 0


def test_halo_and_traffic_counts_on_a_path():
  # Path 0-1-2-3-4-5, owners 0 0 1 1 2 2: halos {2}, {1, 4}, {3}.
  adjacency = np.zeros((6, 6), bool)
  adjacency[np.arange(5), np.arange(1, 6)] = True
  adjacency |= adjacency.T
  owner = np.array([0, 0, 1, 1, 2, 2], np.int32)
  halo = digest.halo_masks(adjacency, owner, 3)
  np.testing.assert_array_equal(halo, [[0, 0, 1, 0, 0, 0], [0, 1, 0, 0, 1, 0], [0, 0, 0, 1, 0, 0]])
  graph = digest.Graph(adjacency, np.ones((6, 5), np.float32), np.array([0, 1, 2, 0, 1, 2], np.int32),
                       np.array([1, 0, 1, 0, 1, 0], bool))
  params = digest.init_gcn(jax.random.key(0), (5, 4, 3))
  for period in (1, 2, 3, 7, 50):
    out = digest.train_gcn(graph, owner, params, period=period, steps=STEPS, lr=LR, optimizer="sgd")
    assert out["refreshes"] == math.ceil(STEPS / period)
    assert out["traffic"] == math.ceil(STEPS / period) * 4 * 4  # refreshes x halo nodes x hidden width


def test_graph_and_partition_are_seeded_and_as_asked():
  a, b = digest.sbm_graph(400, 4, 8.0, 0.7, 16, 2.5, 0.2, 5), digest.sbm_graph(400, 4, 8.0, 0.7, 16, 2.5, 0.2, 5)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)
  adj = a.adjacency
  assert (adj == adj.T).all() and not adj.diagonal().any()
  assert adj.sum(1).mean() == pytest.approx(8.0, abs=0.6)
  rows, cols = np.nonzero(adj)
  assert np.mean(a.labels[rows] == a.labels[cols]) == pytest.approx(0.7, abs=0.05)
  assert a.train.sum() == 80 and np.bincount(a.labels).tolist() == [100] * 4
  owner = digest.random_partition(10, 3, 0)
  assert sorted(np.bincount(owner).tolist()) == [3, 3, 4]


def test_traffic_claim_is_decided_on_the_runs_counts():
  def row(period, traffic, refreshes):
    return {"mode": "digest", "period": period,
            "per_seed": {"traffic": dict(enumerate(traffic)), "refreshes": dict(enumerate(refreshes))}}

  summary = {"digest-k1": row(1, [200.0, 210.0], [200, 200]), "digest-k3": row(3, [67.0, 70.35], [67, 67])}
  assert digest._traffic(summary).verdict == "held"
  summary["digest-k3"] = row(3, [80.0, 84.0], [80, 80])
  assert digest._traffic(summary).verdict == "not held"


@pytest.mark.parametrize("kwargs, match", [
    (dict(period=0), "period must be an integer >= 1, got 0"),
    (dict(period=2.0), "period must be an integer"),
    (dict(steps=0), "steps must be an integer >= 1"),
    (dict(lr=-1.0), "lr must be a positive finite number, got -1.0"),
    (dict(mode="halo"), "mode must be 'digest', 'full' or 'partition', got 'halo'"),
    (dict(optimizer="rmsprop"), "optimizer must be 'adam' or 'sgd', got 'rmsprop'"),
])
def test_bad_training_arguments(kwargs, match):
  graph, owner = _tiny()
  args = dict(period=1, steps=STEPS, lr=LR) | kwargs
  with pytest.raises((ValueError, TypeError), match=match):
    digest.train_gcn(graph, owner, _params(), **args)


def test_bad_graph_and_partition_arguments():
  graph, _ = _tiny()
  with pytest.raises(ValueError, match=r"owner must have one partition per node, shape \(12,\)"):
    digest.train_gcn(graph, np.zeros(5, np.int32), _params(), period=1, steps=STEPS, lr=LR)
  with pytest.raises(ValueError, match="owner must be a 1-d array of partitions"):
    digest.train_gcn(graph, np.full(12, -1, np.int32), _params(), period=1, steps=STEPS, lr=LR)
  with pytest.raises(ValueError, match="parts must be at most nodes"):
    digest.random_partition(3, 4, 0)
  with pytest.raises(ValueError, match="homophily must be a number in"):
    digest.sbm_graph(12, 3, 4.0, 0.0, 5, 1.0, 0.5, 0)
  with pytest.raises(ValueError, match="degree must be positive"):
    digest.sbm_graph(12, 3, 40.0, 0.6, 5, 1.0, 0.5, 0)
  with pytest.raises(ValueError, match="sizes must be at least two positive integers"):
    digest.init_gcn(jax.random.key(0), (5,))
