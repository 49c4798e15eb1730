"""experiments.hpsgd: the all-reduce's price, the loss at a fixed time, and every spec's gradients."""

import numpy as np
import pytest

from experiments import hpsgd

CONFIG = dict(hpsgd.SCALES["quick"])


def test_allreduce_costs_log2_messages():
  assert hpsgd.allreduce_seconds(CONFIG) == pytest.approx(3 * CONFIG["message_seconds"])  # 8 replicas
  assert hpsgd.allreduce_seconds(dict(CONFIG, speeds=[1.0] * 9)) == pytest.approx(4 * CONFIG["message_seconds"])


def test_loss_at_takes_the_last_evaluation_at_or_before_the_time():
  record = {"curves": {"time": [0.0, 10.0, 20.0], "loss": [2.0, 1.0, 0.5]}}
  assert hpsgd.loss_at(record, 0.0) == 2.0
  assert hpsgd.loss_at(record, 10.0) == 1.0
  assert hpsgd.loss_at(record, 19.9) == 1.0
  assert hpsgd.loss_at(record, 99.0) == 0.5


def test_every_spec_applies_the_same_gradients():
  config = dict(CONFIG, steps=6)
  for spec in hpsgd.specs(config):
    schedule = hpsgd.schedule_for(config, spec, 0)
    assert schedule.num_gradients == 6 * len(config["speeds"]), spec["key"]
    if spec["paradigm"] == "lasgd":
      assert float(schedule.wait.sum()) == 0.0  # nobody waits: the all-reduce runs behind the local steps


def test_hpsgd_and_lasgd_share_each_seeds_schedule():
  # hpsgd-merge-vs-lasgd pairs their final losses seed by seed: only the merge rule may differ between them.
  config = dict(CONFIG, steps=6)
  by_key = {spec["key"]: spec for spec in hpsgd.specs(config)}
  for seed in (0, 1):
    a, b = (hpsgd.schedule_for(config, by_key[key], seed) for key in ("hpsgd", "lasgd"))
    for field in ("time", "kind", "worker", "mix", "members", "weights", "lag"):
      np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
