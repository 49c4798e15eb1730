"""experiments.apam: every spec computes the same gradients, and the speed-up is the ratio of times to the target."""

import math

import numpy as np
import pytest

from experiments import apam

CONFIG = dict(apam.SCALES["quick"])


def test_every_spec_computes_the_same_number_of_gradients():
  """BSP averages M gradients per update, so it gets M times fewer updates; every gradient counted once."""
  for spec in apam.specs(CONFIG):
    sched = apam.schedule(CONFIG, spec, 0)
    assert int(np.count_nonzero(sched.contributes)) == CONFIG["steps"], spec["key"]
    expected = CONFIG["steps"] // spec["workers"] if spec["paradigm"] == "bsp" else CONFIG["steps"]
    assert sched.num_updates == expected, spec["key"]
    if spec["paradigm"] == "bsp" or spec["workers"] == 1:
      assert int(sched.staleness.max()) == 0


def test_speedup_claim_is_the_per_seed_log_ratio_against_half_of_m():
  def row(workers, times):
    return {"workers": workers, "speedup": 1.0, "per_seed": {"time_to_target_bound": dict(enumerate(times))}}

  m = CONFIG["workers"]
  summary = {"amsgrad-M1": row(1, [100.0, 120.0, 90.0, 110.0]), f"apam-M{m}": row(m, [15.0, 16.0, 14.0, 15.0])}
  speedups = apam._speedups(summary, f"apam-M{m}")
  assert speedups == pytest.approx({0: math.log(100 / 15), 1: math.log(120 / 16), 2: math.log(90 / 14),
                                    3: math.log(110 / 15)})
  assert apam._speedup(summary).verdict == "held"
  summary[f"apam-M{m}"] = row(m, [40.0, 45.0, 35.0, 42.0])  # about 2.6x: below M / 2 = 4
  assert apam._speedup(summary).verdict == "not held"


def test_optimizers_are_the_rules_named():
  """At staleness 3 the masters still equal Optax's AMSGrad, Adam and SGD (no staleness rule: s = 1)."""
  import jax
  import jax.numpy as jnp
  import optax

  g, p = jnp.array([0.5, -2.0]), jnp.zeros(2)
  for method, ref in (("apam", optax.amsgrad(CONFIG["lr"])), ("async_adam", optax.adam(CONFIG["lr"])),
                      ("sgd", optax.sgd(CONFIG["sgd_lr"]))):
    tx = apam.optimizer(CONFIG, method)
    u, _ = tx.update(g, tx.init(p), p, staleness=3, stale_params=p, worker=0)
    with jax.numpy_dtype_promotion("standard"):  # optax's bias correction, as dj.apam runs it
      v, _ = ref.update(g, ref.init(p), p)
    np.testing.assert_array_equal(u, v)
