"""Inputs that used to run silently wrong: each is now a clear error before anything compiles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj
from tests.runtime.simulate_reference import regression_problem


@pytest.fixture(scope="module")
def problem():
  data, loss_fn, params = regression_problem()
  schedule = dj.cluster.simulate(dj.cluster.asp(), dj.cluster.workers(16), num_updates=20, seed=0)
  return loss_fn, params, data, schedule


@pytest.mark.parametrize("tx", [
    dj.dana(0.05, momentum=0.5, num_workers=4),
    optax.chain(dj.delay_compensation(0.5, adaptive=True, num_workers=4), optax.sgd(0.05)),
], ids=["dana", "dc_asgd_a"])
def test_per_worker_table_smaller_than_the_schedule_is_refused(problem, tx):
  # Inside jit a worker past the table cannot raise: the runtime knows the 16 workers up front.
  loss_fn, params, data, schedule = problem
  with pytest.raises(ValueError, match=r"4 rows .* has 16 workers; pass num_workers=16"):
    dj.simulate(loss_fn, tx, params, data, schedule)


def test_delay_model_workers_count_too(problem):
  loss_fn, params, data, _ = problem
  with pytest.raises(ValueError, match="has 6 workers"):
    dj.simulate(loss_fn, dj.dana(0.05, num_workers=4), params, data, dj.delays.uniform(5), num_updates=10)


def test_delayed_replaying_a_schedule_refuses_a_small_table(problem):
  _, params, _, schedule = problem
  tx = dj.delayed(optax.chain(dj.delay_compensation(0.5, adaptive=True, num_workers=8), optax.sgd(0.1)), schedule)
  with pytest.raises(ValueError, match=r"8 rows .* has 16 workers"):
    tx.init(params)


@pytest.mark.parametrize("make, error, match", [
    (lambda d: dict(checkpoint=dj.Checkpoint(d, resume="False")), TypeError,
     r"Checkpoint.resume must be a bool, got str 'False'"),
    (lambda d: dict(worker=dj.workers.LocalSteps(2, optax.sgd(0.1), keep_state="False")), TypeError,
     r"LocalSteps.keep_state must be a bool, got str 'False'"),
    # skip_nonfinite=True is now Record(nonfinite="skip"): a choice, so neither "False" nor a bool is taken.
    (lambda d: dict(record=dj.Record(nonfinite="False")), ValueError,
     r"Record.nonfinite must be one of 'report', 'skip'; got 'False'"),
    (lambda d: dict(record=dj.Record(nonfinite=True)), ValueError,
     r"Record.nonfinite must be one of 'report', 'skip'; got True"),
], ids=["Checkpoint.resume", "LocalSteps.keep_state", "Record.nonfinite", "Record.nonfinite_bool"])
def test_booleans_must_be_bools(problem, tmp_path, make, error, match):
  # "False" is truthy: taking it would do the opposite of what it says.
  loss_fn, params, data, schedule = problem
  with pytest.raises(error, match=match):
    dj.simulate(loss_fn, optax.sgd(0.1), params, data, schedule, **make(tmp_path))


def test_a_loss_with_aux_trains_exactly_as_without(problem):
  """has_aux is read from the loss's output: (loss, aux) gives the run of the loss alone, bit for bit."""
  loss_fn, params, data, schedule = problem

  def with_aux(w, batch):
    return loss_fn(w, batch), {"pred": batch["x"] @ w["w"], "n": batch["x"].shape[0]}

  kw = dict(sampling=dj.Sampling(batch_size=4), seed=3)
  plain = dj.simulate(loss_fn, optax.sgd(0.05, momentum=0.9), params, data, schedule, **kw)
  aux = dj.simulate(with_aux, optax.sgd(0.05, momentum=0.9), params, data, schedule, **kw)
  assert np.abs(np.asarray(plain.params["w"])).max() > 1e-3  # it trained
  for a, b in zip(jax.tree.leaves((plain.params, plain.opt_state, plain.history)),
                  jax.tree.leaves((aux.params, aux.opt_state, aux.history)), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("make_loss", [
    lambda loss_fn: lambda w, batch: (batch["x"] @ w["w"] - batch["y"]) ** 2,
    lambda loss_fn: lambda w, batch: (jnp.stack([loss_fn(w, batch)] * 2), {}),
    lambda loss_fn: lambda w, batch: (loss_fn(w, batch), {}, 0),
], ids=["vector", "vector_with_aux", "triple"])
def test_a_loss_that_is_neither_a_scalar_nor_a_scalar_and_aux_is_refused(problem, make_loss):
  loss_fn, params, data, schedule = problem
  with pytest.raises(ValueError, match=r"loss_fn\(params, batch\) must return a real scalar loss, or \(loss, aux\)"):
    dj.simulate(make_loss(loss_fn), optax.sgd(0.1), params, data, schedule)


@pytest.mark.parametrize("seed, error", [(-1, ValueError), (2**32, ValueError), (1.5, TypeError), (True, TypeError)])
def test_seeds_are_non_negative_ints_below_2_32(problem, seed, error):
  loss_fn, params, data, schedule = problem
  with pytest.raises(error, match="seed"):
    dj.simulate(loss_fn, optax.sgd(0.1), params, data, schedule, seed=seed)
  with pytest.raises(error, match="seed"):
    dj.delayed(optax.sgd(0.1), dj.delays.constant(1), seed=seed)


def test_unwritable_checkpoint_dir_fails_before_any_compute(problem, tmp_path):
  loss_fn, params, data, schedule = problem
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  calls = []

  def counting_loss(w, batch):
    calls.append(1)  # traced only if the run got as far as compiling
    return loss_fn(w, batch)

  with pytest.raises(ValueError, match="Checkpoint.directory=.*a_file/run.* cannot be written"):
    dj.simulate(counting_loss, optax.sgd(0.1), params, data, schedule, checkpoint=dj.Checkpoint(blocker / "run"))
  assert not calls
  with pytest.raises(TypeError, match="Checkpoint.directory must be a path"):
    dj.simulate(loss_fn, optax.sgd(0.1), params, data, schedule, checkpoint=dj.Checkpoint(3))


def test_memory_is_sized_before_the_run_and_refused_past_max_memory(problem):
  loss_fn, params, data, schedule = problem
  result = dj.simulate(loss_fn, optax.sgd(0.1), params, data, schedule, sampling=dj.Sampling(batch_size=4))
  memory, stats = result.stats["memory"], result.stats
  # Closed forms: every worker keeps num_slots float32 copies of the 4 parameters; the data is kept whole.
  assert memory["read parameter copies"] == stats["num_workers"] * stats["num_slots"] * 4 * 4
  assert memory["data"] == data["x"].nbytes + data["y"].nbytes
  assert memory["total"] == sum(v for k, v in memory.items() if k != "total")
  calls = []

  def counting_loss(w, batch):
    calls.append(1)
    return loss_fn(w, batch)

  with pytest.raises(ValueError, match=r"more than 1.0 KiB \(Execution.max_memory\); the largest term is the data"):
    dj.simulate(counting_loss, optax.sgd(0.1), params, data, schedule, sampling=dj.Sampling(batch_size=4),
                execution=dj.Execution(max_memory=1024))
  assert not calls


def test_simulate_reads_the_sparse_schedule_only():
  """No dense [updates, workers] view is built: they grow with workers x updates and are refused past a limit."""
  data, loss_fn, params = regression_problem()
  schedule = dj.cluster.simulate(dj.cluster.k_async(2), dj.cluster.workers(4), num_updates=12, seed=0)
  result = dj.simulate(loss_fn, optax.sgd(0.05), params, data, schedule, sampling=dj.Sampling(batch_size=4), seed=0)
  assert not schedule._dense, sorted(schedule._dense)
  np.testing.assert_array_equal(result.history.staleness, schedule.staleness.max(axis=1))
