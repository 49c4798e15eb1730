"""experiments.dai_staleness: a batch of every s and seed of an optimizer and depth is one dj.simulate call whose
records are the separate runs' bit for bit."""

import json

import numpy as np
import pytest

from experiments import dai_staleness as dai

# The reproduction's model code mixes Python floats with int32 arrays, as the CLI runs it.
pytestmark = pytest.mark.standard_promotion

# Small enough for seconds: 2 evaluations, one hidden layer, two bounds.
CONFIG = dict(dai.SCALES["quick"], steps=40, eval_every=20, depths=[1], staleness=[0, 4], seeds=2,
              optimizers={"adam": 0.001})


def _quiet(done, total):
  del done, total


def test_a_batch_of_every_s_and_seed_gives_each_run_its_own_record_bit_for_bit():
  specs = dai.specs(CONFIG)
  members = [(spec, seed) for spec in specs for seed in (0, 1)]
  # One batch: the key of every run of the optimizer and depth is the same.
  assert len({dai.batch(CONFIG, spec, seed) for spec, seed in members}) == 1
  batched = dai.run_batch(CONFIG, members, _quiet)
  for (spec, seed), record in zip(members, batched, strict=True):
    alone = dai.run(CONFIG, spec, seed, _quiet)
    assert _text(record) == _text(alone)
  # Each run is its own: the bounds give other staleness, the seeds other curves.
  assert batched[0]["metrics"]["max_staleness"] == 0 and batched[2]["metrics"]["max_staleness"] > 0
  assert not np.array_equal(batched[0]["curves"]["train_loss"], batched[1]["curves"]["train_loss"])


def _text(record):
  """The record as JSON, arrays as lists of their exact values."""
  return json.dumps(record, sort_keys=True, default=lambda x: np.asarray(x).tolist())


def test_wider_steps_batch_the_seeds_of_one_s():
  config = dict(CONFIG, lanes=4)
  keys = {dai.batch(config, spec, seed) for spec in dai.specs(config) for seed in (0, 1)}
  assert keys == {spec["key"] for spec in dai.specs(config)}
