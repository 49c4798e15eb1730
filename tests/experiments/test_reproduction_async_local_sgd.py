"""experiments.async_local_sgd: DyLU's local steps and the claims' seconds to the target."""

import numpy as np

from experiments import async_local_sgd

CONFIG = dict(async_local_sgd.SCALES["quick"])


def test_dylu_gives_slow_workers_fewer_local_steps():
  steps = async_local_sgd.local_steps(CONFIG, dylu=True)
  np.testing.assert_array_equal(steps, [8, 8, 8, 8, 4, 4, 2, 2])
  np.testing.assert_array_equal(async_local_sgd.local_steps(CONFIG, dylu=False), [8] * 8)


def _row(times):
  return {"test_error": 0.05, "per_seed": {"time_to_target_bound": dict(enumerate(times)),
                                           "test_error": {s: 0.05 for s in range(len(times))}}}


def _check(summary, name):
  return next(c for c in async_local_sgd.CLAIMS if c.name == name).check(summary)


def test_claims_compare_time_to_target_with_dylu_first():
  summary = {"async-delayed-nesterov-dylu": _row([20.0, 22.0, 19.0, 21.0]),
             "async-delayed-nesterov": _row([30.0, 33.0, 31.0, 29.0]),
             "sync-nesterov": _row([40.0, 45.0, 38.0, 41.0])}
  assert _check(summary, "async-beats-sync").verdict == "held"
  assert _check(summary, "dylu-helps").verdict == "held"
  summary["async-delayed-nesterov-dylu"] = _row([60.0] * 4)
  assert _check(summary, "async-beats-sync").verdict == "not held"
  assert _check(summary, "dylu-helps").verdict == "not held"
