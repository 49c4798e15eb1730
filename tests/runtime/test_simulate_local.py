"""Local-SGD workers: dj.simulate's pseudo-gradients against the sequential reference, DyLU, bad input."""

import os
import sys

import jax
import numpy as np
import optax
import pytest

import delayjax as dj

sys.path.insert(0, os.path.dirname(__file__))
from simulate_reference import (  # noqa: E402
    assert_trees_close, hand_schedule, probe, reference, regression_problem, round_robin)

BATCH = 4


def test_one_worker_one_local_step_is_plain_sgd_bit_for_bit():
  data, loss_fn, params = regression_problem()
  schedule = round_robin(1, 20)
  local = dj.simulate(loss_fn, optax.sgd(1.0), params, data, schedule, sampling=dj.Sampling(batch_size=BATCH), seed=2,
                      worker=dj.workers.LocalSteps(1, optax.sgd(0.05)))
  plain = dj.simulate(loss_fn, optax.sgd(0.05), params, data, schedule, sampling=dj.Sampling(batch_size=BATCH), seed=2)
  for x, y in zip(jax.tree.leaves(local.params), jax.tree.leaves(plain.params), strict=True):
    np.testing.assert_array_equal(x, y)
  np.testing.assert_array_equal(local.history.loss, plain.history.loss)


CASES = {
    # name: (schedule, local_steps, outer tx, local optimizer)
    "asp_constant": (lambda: dj.cluster.simulate(dj.cluster.asp(), dj.cluster.workers(4), num_updates=20, seed=1),
                     3, lambda m: probe(0.5, m), lambda: optax.sgd(0.05)),
    "ssp_per_worker": (lambda: dj.cluster.simulate(dj.cluster.ssp(1), dj.cluster.workers(4), num_updates=20, seed=2),
                       [1, 4, 2, 3], lambda m: dj.delayed_nesterov(0.7, 0.5, buffer_size=2),
                       lambda: optax.sgd(0.05, momentum=0.5)),
    # Several minibatches per local step, and pushes that arrive after the next read (several slots).
    "grouped_multibatch_latency": (lambda: hand_schedule(3, 20, group=2, max_batches=2, latency=1.5, seed=3),
                                   [2, 1, 3], lambda m: probe(0.5, m), lambda: optax.sgd(0.05)),
}


@pytest.mark.fast_compile
@pytest.mark.parametrize("name", list(CASES))
def test_local_steps_match_reference(name):
  make_schedule, steps, make_tx, make_local = CASES[name]
  data, loss_fn, params = regression_problem()
  schedule = make_schedule()
  tx = make_tx(schedule.num_workers)
  result = dj.simulate(loss_fn, tx, params, data, schedule, sampling=dj.Sampling(batch_size=BATCH), seed=4,
                       worker=dj.workers.LocalSteps(steps, make_local()))
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(result.params))
  per_worker = np.broadcast_to(steps, (schedule.num_workers,))
  ref_params, ref_state, ref_loss, _, _ = reference(loss_fn, tx, params, data, schedule, batch_size=BATCH, seed=4,
                                                    local_steps=per_worker, local_optimizer=make_local())
  assert_trees_close(result.params, ref_params, rtol=1e-5, atol=1e-6)
  assert_trees_close(result.opt_state, ref_state, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(result.history.loss, ref_loss, rtol=1e-5, atol=1e-6)
  if name == "grouped_multibatch_latency":
    assert result.stats["num_slots"] > 1 and schedule.num_batches.max() > 1


@pytest.mark.slow
def test_per_worker_local_steps_on_eight_devices():
  data, loss_fn, params = regression_problem()
  schedule = dj.cluster.simulate(dj.cluster.asp(), dj.cluster.workers(6), num_updates=24, seed=5)
  steps = [1, 2, 3, 1, 2, 3]
  kwargs = dict(sampling=dj.Sampling(batch_size=BATCH), worker=dj.workers.LocalSteps(steps, optax.sgd(0.05)))
  single = dj.simulate(loss_fn, probe(0.5, 8), params, data, schedule, **kwargs)
  multi = dj.simulate(loss_fn, probe(0.5, 8), params, data, schedule,
                      execution=dj.Execution(mesh=jax.make_mesh((8,), ("workers",))), **kwargs)
  assert multi.stats["num_devices"] == 8
  assert_trees_close(multi.params, single.params, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(multi.history.loss, single.history.loss, rtol=1e-5, atol=1e-6)


@pytest.mark.standard_promotion  # optax.adam is not strict-promotion clean
@pytest.mark.parametrize("name, make_local", [
    # The kept state is any pytree the local optimizer holds: momentum's trace, and Adam's moments and int32
    # count, each once; with reads before the previous push has landed (several slots per worker) for Adam.
    ("ssp_per_worker", lambda: optax.sgd(0.05, momentum=0.9)),
    ("grouped_multibatch_latency", lambda: optax.adam(0.02)),
], ids=["ssp_per_worker-momentum", "grouped_multibatch_latency-adam"])
@pytest.mark.fast_compile
def test_kept_local_state_matches_reference(name, make_local):
  """Each worker's momentum (and Adam moments) carry over between its contributions, even when it reads
  again before its previous push has landed; a fresh state gives a different run."""
  make_schedule, steps, make_tx, _ = CASES[name]
  data, loss_fn, params = regression_problem()
  schedule = make_schedule()
  tx = make_tx(schedule.num_workers)
  per_worker = np.broadcast_to(steps, (schedule.num_workers,))
  kw = dict(sampling=dj.Sampling(batch_size=BATCH), seed=4)
  kept = dj.simulate(loss_fn, tx, params, data, schedule, worker=dj.workers.LocalSteps(steps, make_local(),
                                                                                       keep_state=True), **kw)
  fresh = dj.simulate(loss_fn, tx, params, data, schedule, worker=dj.workers.LocalSteps(steps, make_local()), **kw)
  ref_params, ref_state, ref_loss, _, _ = reference(
      loss_fn, tx, params, data, schedule, batch_size=BATCH, seed=4, local_steps=per_worker,
      local_optimizer=make_local(), keep_local_state=True)
  assert_trees_close(kept.params, ref_params, rtol=1e-5, atol=1e-6)
  assert_trees_close(kept.opt_state, ref_state, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(kept.history.loss, ref_loss, rtol=1e-5, atol=1e-6)
  if name == "grouped_multibatch_latency":
    assert kept.stats["num_slots"] > 1
  assert not np.allclose(np.asarray(kept.params["w"]), np.asarray(fresh.params["w"]), rtol=1e-4)


@pytest.mark.slow
def test_kept_local_state_on_eight_devices_and_across_resume(tmp_path):
  data, loss_fn, params = regression_problem()
  schedule = dj.cluster.simulate(dj.cluster.asp(), dj.cluster.workers(6), num_updates=24, seed=5)
  kw = dict(sampling=dj.Sampling(batch_size=BATCH),
            worker=dj.workers.LocalSteps([1, 2, 3, 1, 2, 3], optax.sgd(0.05, momentum=0.9), keep_state=True))
  # The one-device run is in chunks of 3: one compiled program serves it, the interrupted and the resumed run.
  whole = dj.simulate(loss_fn, probe(0.5, 8), params, data, schedule, execution=dj.Execution(chunk_size=3), **kw)
  multi = dj.simulate(loss_fn, probe(0.5, 8), params, data, schedule,
                      execution=dj.Execution(mesh=jax.make_mesh((8,), ("workers",))), **kw)
  assert_trees_close(multi.params, whole.params, rtol=1e-5, atol=1e-6)

  def stop(info):
    if info["chunk"] == 2:
      raise KeyboardInterrupt

  with pytest.raises(KeyboardInterrupt):
    dj.simulate(loss_fn, probe(0.5, 8), params, data, schedule, execution=dj.Execution(chunk_size=3),
                checkpoint=dj.Checkpoint(tmp_path), record=dj.Record(callback=stop), **kw)
  resumed = dj.simulate(loss_fn, probe(0.5, 8), params, data, schedule, execution=dj.Execution(chunk_size=3),
                        checkpoint=dj.Checkpoint(tmp_path), **kw)
  for x, y in zip(jax.tree.leaves((whole.params, whole.opt_state)), jax.tree.leaves((resumed.params,
                                                                                     resumed.opt_state)), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_dylu_local_steps_formula():
  speeds = np.array([2.0, 1.0, 0.7, 0.05, 1.9])
  steps = dj.dylu_local_steps(speeds, 10)
  np.testing.assert_array_equal(steps, [10, 5, 3, 1, 9])  # floor(v / 2 * 10), at least 1
  np.testing.assert_array_equal(steps, np.maximum(1, np.floor(speeds / speeds.max() * 10)))
  assert steps.dtype == np.int64
  np.testing.assert_array_equal(dj.dylu_local_steps([3, 3], 4), [4, 4])
  with pytest.raises(ValueError, match="max_steps must be an integer >= 1, got 0"):
    dj.dylu_local_steps(speeds, 0)
  with pytest.raises(ValueError, match="speeds must be a non-empty 1-D array of finite numbers > 0"):
    dj.dylu_local_steps([1.0, 0.0], 4)


# The plug-in is checked when it is made, and against the schedule (4 workers here) when the run binds it.
@pytest.mark.parametrize("make, error, match", [
    (lambda: dj.workers.LocalSteps(0, optax.sgd(0.1)), ValueError, r"LocalSteps.steps must be an integer >= 1, got 0"),
    (lambda: dj.workers.LocalSteps([1, 2, 0, 1], optax.sgd(0.1)), ValueError,
     r"LocalSteps.steps\[2\] must be an integer >= 1, got 0"),
    (lambda: dj.workers.LocalSteps([1, 2], optax.sgd(0.1)), ValueError,
     r"LocalSteps.steps must be an int or hold one entry per worker \(4\), got 2 entries"),
    (lambda: dj.workers.LocalSteps(2.5, optax.sgd(0.1)), TypeError, r"LocalSteps.steps must be an integer"),
    # local_steps without a local_optimizer: the optimizer is a required argument of the plug-in.
    (lambda: dj.workers.LocalSteps(2), TypeError, r"missing 1 required positional argument: 'optimizer'"),
    # local_optimizer without local_steps: the steps are required too.
    (lambda: dj.workers.LocalSteps(optimizer=optax.sgd(0.1)), TypeError,
     r"missing 1 required positional argument: 'steps'"),
    (lambda: dj.workers.LocalSteps(2, "sgd"), TypeError,
     r"LocalSteps.optimizer must be an optax.GradientTransformation"),
    # keep_local_state=True without local_steps: keep_state exists only on LocalSteps; the default worker has none.
    (lambda: dj.workers.Gradient(keep_state=True), TypeError, r"unexpected keyword argument 'keep_state'"),
    (lambda: dj.workers.LocalSteps(2, optax.sgd(0.1), keep_state=1), TypeError,
     r"LocalSteps.keep_state must be a bool, got int"),
    (lambda: "local_sgd", TypeError, r"worker must be a dj.workers plug-in"),
], ids=["zero", "zero_entry", "wrong_length", "float", "no_optimizer", "no_steps", "bad_optimizer",
        "keep_state_without_local_steps", "keep_state_int", "not_a_plugin"])
def test_bad_local_arguments(make, error, match):
  data, loss_fn, params = regression_problem()
  with pytest.raises(error, match=match):
    dj.simulate(loss_fn, optax.sgd(1.0), params, data, round_robin(4, 8), worker=make())
