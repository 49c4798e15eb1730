"""The pipeline reproductions' batches (``pipeline_common.run_many``): every seed of a spec in one
``dj.simulate_pipeline`` call (``dj.Runs``), each record equal to the run's own (``run``) bit for bit."""

import json

import numpy as np
import pytest

from experiments import pipeline_2bw, pipeline_common, pipeline_decoupled, pipeline_stashing

# The reproductions' model code mixes Python floats with int32 arrays, as the CLI runs it.
pytestmark = pytest.mark.standard_promotion


def _quiet(done, total):
  del done, total


def _text(record):
  """The record as JSON, arrays as lists of their exact values."""
  return json.dumps(record, sort_keys=True, default=lambda x: np.asarray(x).tolist())


@pytest.mark.parametrize("module", [pipeline_stashing, pipeline_decoupled, pipeline_2bw])
def test_a_batch_of_a_specs_seeds_gives_each_run_its_own_record_bit_for_bit(module):
  """Three reproductions of three kinds: a backward form of its own (stashing's PipeDream without stashing), a
  schedule of each seed and a micro-batch of the spec (decoupled), specs trained and measured alone (2BW)."""
  config = dict(module.SCALES["quick"], **module.REPRODUCTION.smoke)
  specs = module.specs(config)
  for spec in specs:
    members = [(spec, seed) for seed in (0, 1, 2)]
    assert len({module.REPRODUCTION.batch(config, s, seed) for s, seed in members}) == 1
    told = []
    together = module.run_batch(config, members, lambda done, total: told.append((done, total)))
    alone = [module.run(config, s, seed, _quiet) for s, seed in members]
    assert [_text(r) for r in together] == [_text(r) for r in alone], spec["key"]
    assert told[-1][0] == told[-1][1]
  trained = [spec for spec in specs if "curves" in module.run(config, spec, 0, _quiet)]
  assert trained
  first, second = (module.run(config, trained[0], seed, _quiet) for seed in (0, 1))
  assert _text(first["curves"]) != _text(second["curves"])


def test_a_batch_holds_the_seeds_of_one_spec():
  config = dict(pipeline_stashing.SCALES["quick"], **pipeline_stashing.REPRODUCTION.smoke)
  first, second = pipeline_stashing.specs(config)[:2]
  with pytest.raises(ValueError, match="seeds of one spec"):
    pipeline_common.run_many(config, [(first, 0), (second, 0)], _quiet, pipeline_stashing._plan,
                             pipeline_common.as_trained)
