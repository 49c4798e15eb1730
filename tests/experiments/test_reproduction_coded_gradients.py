"""experiments.coded_gradients: coded workers pay for their extra parts, the GD reference is GD, the claims decide."""

import numpy as np
import pytest

from experiments import coded_gradients as cg

CONFIG = dict(cg.SCALES["quick"])


def test_coded_workers_take_their_parts_times_as_long():
  """Constant 1 s per part, no stragglers: GD and ignoring rounds take 1 s, the coded round n - k + 1 s."""
  config = dict(CONFIG, compute="constant", straggle_probability=0.0)
  n, k = config["workers"], config["k"]
  for spec in cg.specs(config):
    sched = cg.schedule(config, spec, 0)
    parts = n - k + 1 if spec["scheme"] == "coded" else 1
    assert sched.time[-1] / sched.num_updates == pytest.approx(parts), spec["key"]
    assert np.all(sched.contributes.sum(axis=1) == spec["k"]), spec["key"]
    assert sched.num_updates == config["ignore_steps" if spec["scheme"] == "ignore" else "steps"]


def test_gd_path_is_gradient_descent_on_the_problem():
  fs = cg.problem(dict(CONFIG, n_examples=16, d=3))
  lr = cg.step_size(fs)
  assert lr == pytest.approx(1.0 / np.linalg.eigvalsh(fs.hessian(np.ones(3)))[-1])
  path = cg.gd_path(fs, lr, 3)
  w = np.zeros(3)
  for u in range(1, 4):
    w = w - lr * fs.gradient(w)
    np.testing.assert_allclose(path[u], w, rtol=1e-13, atol=1e-15)


def _summary(gap, final):
  return {"coded-k6": {"scheme": "coded", "target": 1e-8, "per_seed": {"gap_to_gd": dict(enumerate(gap))}},
          "ignore-k6": {"scheme": "ignore", "target": 1e-8, "per_seed": {"final_subopt": dict(enumerate(final))}}}


def test_exactness_and_inexactness_claims_decide_on_their_margins():
  good = _summary([1e-15, 2e-15, 3e-15, 1e-15], [1e-2, 2e-2, 1.5e-2, 1e-2])
  assert cg._exact(good).verdict == "held" and cg._inexact(good).verdict == "held"
  bad = _summary([1e-3, 2e-3, 1.5e-3, 1e-3], [1e-12, 2e-12, 1e-12, 3e-12])
  assert cg._exact(bad).verdict == "not held" and cg._inexact(bad).verdict == "not held"
