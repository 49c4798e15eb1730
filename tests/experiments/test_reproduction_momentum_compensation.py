"""experiments.momentum_compensation: the methods are the rules named, the steps the formulas, the claims the
comparisons stated."""

import math

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj
from experiments import momentum_compensation as mc

CONFIG = dict(mc.SCALES["quick"])


def test_quadratic_has_the_stated_spectrum_and_changes_with_the_seed():
  a, w = mc.quadratic(6, 1e-2, seed=3)
  np.testing.assert_allclose(np.linalg.eigvalsh(a), np.geomspace(1e-2, 1.0, 6), rtol=1e-10)
  b, v = mc.quadratic(6, 1e-2, seed=4)
  assert not np.allclose(a, b) and not np.allclose(w, v)


def test_steps_follow_the_stated_formulas():
  eta, beta = mc.steps(CONFIG, "compensated", 4)
  assert eta == pytest.approx(CONFIG["comp_scale"] / 25)
  root = math.sqrt(CONFIG["mu"] * eta)
  assert beta == pytest.approx((1 - root) / (1 + root))
  assert mc.steps(CONFIG, "async-nesterov", 4) == (eta, beta)
  assert mc.steps(CONFIG, "async-gd", 8) == (pytest.approx(CONFIG["gd_scale"] / 9), 0.0)
  assert mc.steps(CONFIG, "sync-gd", 0) == (CONFIG["gd_scale"], 0.0)


def _with(tx, eta, beta):
  """``tx`` (injected hyper-parameters) with its learning rate and momentum set as dj.Runs sets them."""
  def init(params):
    state = tx.init(params)
    state.hyperparams["learning_rate"] = jnp.asarray(eta, jnp.float32)
    state.hyperparams["momentum"] = jnp.asarray(beta, jnp.float32)
    return state
  return init


@pytest.mark.parametrize("method,reference", [
    ("async-gd", lambda eta, beta: optax.sgd(eta)),
    ("async-nesterov", lambda eta, beta: optax.sgd(eta, momentum=beta, nesterov=True)),
])
def test_baselines_are_the_optax_rules_at_any_staleness(method, reference):
  """Gradient descent runs as momentum compensation with momentum 0: exactly SGD, whatever the staleness."""
  eta, beta = mc.steps(CONFIG, method, 4)
  tx, ref = mc.optimizer(method), reference(eta, beta)
  params = jnp.zeros(3)
  s, r = _with(tx, eta, beta)(params), ref.init(params)
  for i, tau in enumerate([0, 4, 4, 2]):
    g = jnp.asarray(np.random.default_rng(i).normal(size=3), jnp.float32)
    u, s = tx.update(g, s, params, staleness=tau)
    v, r = ref.update(g, r, params)
    np.testing.assert_allclose(u, v, rtol=1e-6, atol=1e-7)


def test_compensated_is_dj_momentum_compensation():
  eta, beta = mc.steps(CONFIG, "compensated", 4)
  tx, ref = mc.optimizer("compensated"), dj.momentum_compensation(eta, beta)
  params = jnp.zeros(3)
  s, r = _with(tx, eta, beta)(params), ref.init(params)
  for i in range(4):
    g = jnp.asarray(np.random.default_rng(i).normal(size=3), jnp.float32)
    u, s = tx.update(g, s, params, staleness=4)
    v, r = ref.update(g, r, params, staleness=4)
    np.testing.assert_allclose(u, v, rtol=1e-6)


def test_updates_to_target_is_the_first_evaluation_below_it():
  curve = np.array([1.0, 0.1, np.nan, 1e-7, 1e-9])
  assert mc.updates_to(curve, 50, 1e-6) == 150
  assert mc.updates_to(curve, 50, 1e-12) == math.inf


def _summary(values):
  """Rows ``{key: {method, tau, per_seed}}`` from ``{key: [log10 final suboptimality per seed]}``."""
  rows = {}
  for key, logs in values.items():
    method, _, tau = key.partition("/tau=")
    cluster = "/asp-M" in key
    rows[key] = {"method": key.split("/")[0] if cluster else method, "tau": 8 if cluster else int(tau or 0),
                 "source": "asp" if cluster else "constant",
                 "per_seed": {"log10_final_subopt": dict(enumerate(logs))}}
  return rows


def test_claims_compare_the_stated_rows():
  good = _summary({"sync-gd": [-9.0, -9.5, -9.2, -9.1], "compensated/tau=4": [-14.0, -14.1, -13.9, -14.2],
                   "async-gd/tau=4": [-4.5, -4.6, -4.4, -4.5], "async-nesterov/tau=4": [56.0, 58.0, 57.0, 55.0]})
  assert mc._beats_gd(good).verdict == "held"
  assert mc._plain_fails(good).verdict == "held"
  assert mc._survives(good).verdict == "held"
  bad = _summary({"sync-gd": [-9.0, -9.5, -9.2, -9.1], "compensated/tau=4": [-3.0, -3.1, -2.9, -3.2],
                  "async-gd/tau=4": [-4.5, -4.6, -4.4, -4.5], "async-nesterov/tau=4": [-1.0, -1.2, -1.1, -0.9]})
  assert mc._beats_gd(bad).verdict == "not held"
  assert mc._plain_fails(bad).verdict == "not held"
  assert mc._survives(bad).verdict == "not held"


def test_cluster_claim_pairs_each_cluster_row_with_async_gd_on_the_same_cluster():
  rows = {"compensated/asp-M9": [-8.0, -7.5, -7.9], "async-gd/asp-M9": [-3.1, -3.0, -3.2],
          "compensated/tau=4": [0.0, 0.0, 0.0], "async-gd/tau=4": [-9.0, -9.0, -9.1]}
  summary = _summary(rows)
  assert mc._beats_gd_cluster(summary).verdict == "held"  # the constant-delay rows (worse here) are not read
  assert mc._taus(summary) == [4]  # and the cluster rows are not constant-delay rows
  del rows["compensated/asp-M9"], rows["async-gd/asp-M9"]
  assert mc._beats_gd_cluster(_summary(rows)).verdict == "not evaluated"


def test_the_cluster_is_one_asp_schedule_for_every_seed():
  spec = next(s for s in mc.specs(CONFIG) if s["source"] == "asp")
  config = dict(CONFIG, updates=300)
  a, b = mc.source(config, spec), mc.source(config, spec)
  assert a.num_updates == 300 and a.num_workers == CONFIG["cluster_workers"]
  np.testing.assert_array_equal(a.read_version, b.read_version)
  assert a.staleness[a.contributes].max() > a.staleness[a.contributes].min()  # it varies from push to push
  assert isinstance(mc.source(CONFIG, mc.specs(CONFIG)[1]), dj.delays.Constant)


def test_an_overflowed_run_counts_as_infinitely_bad():
  """A run whose suboptimality overflowed has no value: the claims read it as +inf (censored at 10^400)."""
  summary = _summary({"async-nesterov/tau=4": [56.0, None]})
  assert mc._logs(summary, "async-nesterov/tau=4") == {0: 56.0, 1: math.inf}
