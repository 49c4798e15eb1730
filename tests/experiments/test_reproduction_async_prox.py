"""experiments/async_prox.py: its NumPy gradient against JAX's, and its claims decided on made-up seeds."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import _framework
from experiments import async_prox as ap

CONFIG = dict(ap.SCALES["quick"])


def test_numpy_gradient_and_objective_match_the_simulated_loss_in_float64():
  x, y = ap.digits()
  w = np.random.default_rng(0).normal(0.0, 1.0, x.shape[1])  # many |w_j| > 1/sqrt(3): the nonconvex region
  with jax.enable_x64(True):
    batch = {"x": jnp.asarray(x), "y": jnp.asarray(y)}
    loss = ap.smooth_loss(CONFIG["alpha"])
    want = np.asarray(jax.grad(loss)(jnp.asarray(w), batch))
    value = float(loss(jnp.asarray(w), batch))
  np.testing.assert_allclose(ap.smooth_grad(w, CONFIG["alpha"]), want, rtol=1e-10, atol=1e-15)
  assert ap.objective(w, CONFIG) == pytest.approx(value + CONFIG["l1"] * np.sum(np.abs(w)), rel=1e-12)


def summary(times: dict[int, float], ergodic: dict[int, float], seeds: int = 5) -> _framework.Summary:
  """Rows as the framework makes them, from records whose per-seed values wobble by a few percent."""
  rng = np.random.default_rng(1)
  records = [{"key": f"M{m}", "spec": {"key": f"M{m}", "workers": m}, "seed": s,
              "metrics": {"time_to_target": times[m] * (1 + 0.05 * rng.standard_normal()),
                          "ergodic_sq": ergodic[m] * (1 + 0.05 * rng.standard_normal()), "grad_mapping_0": 0.07}}
             for m in times for s in range(seeds)]
  return {r["key"]: r for r in ap.summarize(CONFIG, records)}


def verdicts(s: _framework.Summary) -> dict[str, str]:
  return {c.name: c.evaluate(s).verdict for c in ap.CLAIMS}


def test_claims_hold_on_linear_speedup_and_fail_without_it():
  linear = summary({1: 80.0, 2: 40.0, 4: 20.0, 8: 10.0}, {m: 1e-4 for m in (1, 2, 4, 8)})
  assert verdicts(linear) == {"converges": "held", "asynchrony-costs-little": "held", "near-linear-speedup": "held"}
  assert linear["M8"]["speedup"] == pytest.approx(8.0, rel=0.1)
  flat = summary({1: 80.0, 2: 80.0, 4: 60.0, 8: 50.0}, {1: 1e-4, 2: 1e-4, 4: 2e-4, 8: 4e-3})
  assert verdicts(flat) == {"converges": "not held", "asynchrony-costs-little": "not held",
                            "near-linear-speedup": "not held"}


def test_a_target_never_reached_counts_as_no_speedup():
  s = summary({1: 80.0, 2: 40.0, 4: math.inf, 8: 10.0}, {m: 1e-4 for m in (1, 2, 4, 8)}, seeds=6)
  assert ap.CLAIMS[2].evaluate(s).verdict == "not held"
