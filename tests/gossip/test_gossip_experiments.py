"""The reproductions' NumPy executor runs a gossip schedule exactly as the sequential reference does."""

import numpy as np
import pytest

import delayjax as dj
import gossip_reference as ref
from experiments import _gossip_train as gt

C = dj.cluster


@pytest.mark.parametrize("paradigm, push_sum", [
    (C.allreduce(), False), (C.d_psgd(dj.topology.ring(6)), False), (C.ad_psgd(), False),
    (C.ad_psgd(dj.topology.ring(6)), False), (C.sgp(2), True), (C.gossipgrad(), False),
], ids=str)
def test_executor_matches_the_reference(paradigm, push_sum):
  task = gt.digits_task(6, shards="label")
  w = C.workers(6, compute="exponential", comm=C.exponential(0.7), speed=[1, 1, 1, 1, 1, 0.3])
  fail = C.failures(drop=0.2) if isinstance(paradigm, (C._gossip.ADPSGD, C._gossip.DPSGD)) else None
  s = C.simulate_gossip(paradigm, w, 12, seed=3, failures=fail)
  x0 = np.random.default_rng(0).normal(size=(6, 650)) * 0.01
  got = gt.run_schedule(task, s, lr=0.3, momentum=0.5, batch=8, seed=1, eval_every=10, push_sum=push_sum, x0=x0)
  idx = gt.batches(task, s, 8, 1)
  want = ref.run(s, lambda z, i, j: gt.gradient(task, z, idx[i][j]), x0, lr=0.3, momentum=0.5, push_sum=push_sum)
  np.testing.assert_allclose(got["x"], want["x"] / want["w"][:, None], rtol=1e-10, atol=1e-12)
  # The recorded consensus distance is the definition's, on the final models.
  z = want["x"] / want["w"][:, None]
  assert got["metrics"]["consensus"] == pytest.approx(np.mean(np.sum((z - z.mean(0)) ** 2, axis=1)), rel=1e-9)
  assert got["metrics"]["loss"] == pytest.approx(float(gt.loss(task, z.mean(0))), rel=1e-9)


def test_loss_and_gradient_agree_with_finite_differences():
  task = gt.digits_task(1)
  rng = np.random.default_rng(0)
  p = rng.normal(size=650) * 0.1
  full = np.arange(task.y.shape[0])
  g = gt.gradient(task, p, full)
  for k in rng.integers(650, size=5):
    e = np.zeros(650)
    e[k] = 1e-6
    assert g[k] == pytest.approx((gt.loss(task, p + e) - gt.loss(task, p - e)) / 2e-6, rel=1e-4, abs=1e-8)
