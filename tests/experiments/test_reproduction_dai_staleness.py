"""experiments.dai_staleness: a batch of every s and seed of an optimizer and depth is one dj.simulate call whose
records are the separate runs' bit for bit; at quick scale every program's runs are one batch, their calls side by
side."""

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
  # Two optimizers: two programs, whose dj.simulate calls run side by side in the batch.
  config = dict(CONFIG, optimizers={"adam": 0.001, "sgd": 0.1})
  specs = dai.specs(config)
  members = [(spec, seed) for spec in specs for seed in (0, 1)]
  # One batch: at quick scale every run has the same key; two programs within it.
  assert len({dai.batch(config, spec, seed) for spec, seed in members}) == 1
  assert {dai.program(config, spec) for spec in specs} == {"adam-d1", "sgd-d1"}
  told = []
  batched = dai.run_batch(config, members, lambda done, total: told.append((done, total)))
  for (spec, seed), record in zip(members, batched, strict=True):
    alone = dai.run(config, spec, seed, _quiet)
    assert _text(record) == _text(alone)
  # Each run is its own: the bounds give other staleness, the seeds other curves.
  assert batched[0]["metrics"]["max_staleness"] == 0 and batched[2]["metrics"]["max_staleness"] > 0
  assert not np.array_equal(batched[0]["curves"]["train_loss"], batched[1]["curves"]["train_loss"])
  # The progress counts both programs' updates: two programs of 4 runs of 40 updates.
  assert told[-1] == (320, 320) and all(done <= total for done, total in told)


def _text(record):
  """The record as JSON, arrays as lists of their exact values."""
  return json.dumps(record, sort_keys=True, default=lambda x: np.asarray(x).tolist())


def test_wider_steps_batch_the_seeds_of_one_s():
  config = dict(CONFIG, lanes=4)
  programs = {dai.program(config, spec) for spec in dai.specs(config) for seed in (0, 1)}
  assert programs == {spec["key"] for spec in dai.specs(config)}


def test_long_runs_batch_by_program():
  # Paper scale's 20,000 steps: each program's runs are a batch of their own, saved before the next one starts.
  config = dict(dai.SCALES["paper"])
  keys = {dai.batch(config, spec, 0) for spec in dai.specs(config)}
  assert keys == {f"{opt}-d{depth}" for opt in config["optimizers"] for depth in config["depths"]}
