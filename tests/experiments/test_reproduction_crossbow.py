"""experiments.crossbow: every spec processes the same examples per round, and epochs are counted from gradients."""

import numpy as np
import pytest

import delayjax as dj
from experiments import _gossip_train as gt
from experiments import crossbow

CONFIG = dict(crossbow.SCALES["quick"])


def test_every_spec_runs_the_same_synchronous_rounds():
  """S-SGD all-reduces gradients, the other two mix models, all in rounds of one gradient per learner: the same
  gradients (and so examples) per round and the same simulated time."""
  config = dict(CONFIG, steps=5)
  schedules = {s["key"]: gt.schedule_for(config, s, 0) for s in crossbow.specs(config)}
  m = len(config["speeds"])
  for key, schedule in schedules.items():
    assert schedule.num_gradients == 5 * m, key
    assert int((schedule.kind == dj.cluster.MIX).sum()) == 5, key
    assert schedule.total_time == pytest.approx(schedules["ssgd"].total_time), key
  assert set(schedules["ssgd"].mixes.tolist()) == {dj.cluster.GRADS}
  assert set(schedules["sma"].mixes.tolist()) == {dj.cluster.PARAMS}
  # SMA's mixes are all-reduces: every replica a member, every weight 1/M (what makes its sum of corrections exact).
  np.testing.assert_allclose(schedules["sma"].weights, 1.0 / m)
  dj.gossip.check_method_schedule(dj.gossip.sma(), schedules["sma"])


def test_epochs_count_examples_over_the_training_set():
  n = gt.digits_task(len(CONFIG["speeds"]), "iid").y.shape[0]
  assert crossbow.epochs(n, dict(batch=8), n) == 8.0
  assert crossbow.epochs(None, CONFIG, n) is None
  # 100 rounds of 8 learners x 8 examples.
  assert crossbow.epochs(800, CONFIG, n) == pytest.approx(6400 / n)


def test_claims_compare_sma_seed_by_seed():
  def row(values):
    return {"epochs_to_target_bound": float(np.mean(values)), "test_error": 0.05,
            "per_seed": {"epochs_to_target_bound": dict(enumerate(values))}}

  summary = {"sma": row([1.0, 1.1, 0.9, 1.0]), "ssgd": row([1.5, 1.7, 1.4, 1.6]),
             "averaging": row([0.5, 0.6, 0.4, 0.5])}
  assert crossbow.CLAIMS[0].check(summary).verdict == "held"
  assert crossbow.CLAIMS[1].check(summary).verdict == "not held"
