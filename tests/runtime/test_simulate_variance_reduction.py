"""dj.simulate with variance-reduced estimators: AsySVRG (epochs, snapshot gradients) and ASAGA (per-example inputs)."""

import os
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj
from delayjax.runtime._simulate import schedule_from_delays

sys.path.insert(0, os.path.dirname(__file__))
from simulate_reference import (  # noqa: E402
    assert_trees_close, hand_schedule, probe, reference, regression_problem, round_robin)

BATCH = 4


class _Unmasked(NamedTuple):
  def runtime_inputs(self):
    return ("sample_grads", "sample_indices")


def _svrg(inner=None):
  return optax.chain(dj.svrg(), inner or optax.sgd(0.02))


def _saga(num_examples, inner=None):
  return optax.chain(dj.saga(num_examples), inner or optax.sgd(0.02))


SCHEDULES = {
    # One contribution per update, random speeds: AsySVRG / ASAGA.
    "async": lambda: hand_schedule(4, 40, spread=1.0, seed=31),
    # Two contributions per update and up to three minibatches each: mixed and padded inputs.
    "grouped": lambda: hand_schedule(4, 40, group=2, max_batches=3, seed=32),
    # Reads before the previous push lands (more than one slot per worker).
    "latency": lambda: hand_schedule(3, 36, latency=1.5, seed=33),
    "stale read": lambda: dj.delays.uniform(5),
}


def _schedule(name, num_updates=40):
  source = SCHEDULES[name]()
  if isinstance(source, dj.cluster.Schedule):
    return source
  return schedule_from_delays(source, num_updates, 0)


@pytest.mark.fast_compile
@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_svrg_matches_the_sequential_reference(name):
  """Snapshot gradients on each contribution's own minibatches at its epoch's snapshot, full
  gradients at the epoch starts (several epochs, waves cut at them)."""
  data, loss_fn, params = regression_problem()
  schedule = _schedule(name)
  tx = _svrg()
  result = dj.simulate(loss_fn, tx, params, data, schedule, sampling=dj.Sampling(batch_size=BATCH), seed=2,
                       worker=dj.workers.Gradient(snapshot_every=7))
  ref_params, ref_state, ref_loss, _, _ = reference(loss_fn, tx, params, data, schedule, batch_size=BATCH,
                                                    seed=2, snapshot_every=7)
  assert result.stats["snapshot_every"] == 7
  assert int(ref_state[0].num_snapshots) == len(range(0, schedule.num_updates, 7))
  np.testing.assert_array_equal(result.opt_state[0].num_snapshots, ref_state[0].num_snapshots)
  assert_trees_close(result.params, ref_params, rtol=2e-5, atol=2e-6)
  assert_trees_close(result.opt_state, ref_state, rtol=2e-5, atol=2e-6)
  np.testing.assert_allclose(result.history.loss, ref_loss, rtol=1e-5, atol=1e-6)


@pytest.mark.fast_compile
@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_saga_matches_the_sequential_reference(name):
  """The table is written with per-example gradients at the read parameters, for exactly the kept
  contributions' examples (the runtime's padding is masked)."""
  data, loss_fn, params = regression_problem()
  schedule = _schedule(name)
  tx = _saga(48)
  result = dj.simulate(loss_fn, tx, params, data, schedule, sampling=dj.Sampling(batch_size=BATCH), seed=4)
  ref_params, ref_state, ref_loss, _, _ = reference(loss_fn, tx, params, data, schedule, batch_size=BATCH, seed=4)
  # Many table rows were written, so the test sees the table.
  assert np.count_nonzero(np.asarray(ref_state[0].table["w"]).any(axis=1)) > 30
  assert_trees_close(result.params, ref_params, rtol=2e-5, atol=2e-6)
  assert_trees_close(result.opt_state, ref_state, rtol=2e-5, atol=2e-6)
  np.testing.assert_allclose(result.history.loss, ref_loss, rtol=1e-5, atol=1e-6)


@pytest.mark.fast_compile
def test_variance_reduction_passes_the_other_extra_arguments_through():
  """With a probe after the estimator, staleness, stale_params and worker still arrive intact."""
  data, loss_fn, params = regression_problem()
  schedule = hand_schedule(4, 30, group=2, seed=34)
  for tx in (optax.chain(dj.svrg(), probe(0.02, 4)), optax.chain(dj.saga(48), probe(0.02, 4))):
    result = dj.simulate(loss_fn, tx, params, data, schedule, sampling=dj.Sampling(batch_size=BATCH),
                         worker=dj.workers.Gradient(snapshot_every=None))
    ref_params, ref_state, _, _, _ = reference(loss_fn, tx, params, data, schedule, batch_size=BATCH)
    assert int(ref_state[1].staleness_sum) > 0
    np.testing.assert_array_equal(result.opt_state[1].per_worker, ref_state[1].per_worker)
    assert_trees_close(result.params, ref_params, rtol=2e-5, atol=2e-6)


@pytest.mark.fast_compile
@pytest.mark.parametrize("full_batch_size", [7, 16, 48])
def test_full_gradient_by_chunks_is_the_full_gradient(full_batch_size):
  """Chunks of 7 (6 of them and a rest of 6), 16 (3, no rest) or all 48 examples give the same run."""
  data, loss_fn, params = regression_problem()
  schedule = hand_schedule(4, 30, spread=1.0, seed=37)
  kw = dict(sampling=dj.Sampling(batch_size=BATCH), seed=2)
  whole = dj.simulate(loss_fn, _svrg(), params, data, schedule, worker=dj.workers.Gradient(snapshot_every=6), **kw)
  chunked = dj.simulate(loss_fn, _svrg(), params, data, schedule,
                        worker=dj.workers.Gradient(snapshot_every=6, full_batch_size=full_batch_size), **kw)
  assert_trees_close(chunked.opt_state[0].full_grad, whole.opt_state[0].full_grad, rtol=1e-5, atol=1e-6)
  assert_trees_close(chunked.params, whole.params, rtol=1e-5, atol=1e-6)
  assert np.abs(np.asarray(whole.opt_state[0].full_grad["w"])).max() > 1e-3


@pytest.mark.fast_compile
def test_a_snapshot_left_out_with_its_update_is_taken_by_the_next_applied_one():
  """Updates without contributions change nothing, so an epoch start among them cannot take its
  snapshot; the next applied update takes it, at the same parameters, and the lanes in between
  compute their snapshot gradients there."""
  data, loss_fn, params = regression_problem()
  base = round_robin(3, 40)
  contributes, read_version = base.contributes.copy(), base.read_version.copy()
  empty = [6, 7, 12, 13, 14, 15, 16]  # epoch starts 6 and 12 (snapshot_every=6), one update and a whole wave
  contributes[empty], read_version[empty] = False, -1
  schedule = dj.cluster.Schedule(time=base.time, contributes=contributes, read_version=read_version,
                                 wait=base.wait)
  kw = dict(batch_size=BATCH, seed=7, snapshot_every=6)
  result = dj.simulate(loss_fn, _svrg(), params, data, schedule, sampling=dj.Sampling(batch_size=BATCH), seed=7,
                       worker=dj.workers.Gradient(snapshot_every=6))
  ref_params, ref_state, _, _, _ = reference(loss_fn, _svrg(), params, data, schedule, **kw)
  assert int(ref_state[0].num_snapshots) == len(range(0, 40, 6))
  np.testing.assert_array_equal(result.opt_state[0].num_snapshots, ref_state[0].num_snapshots)
  assert_trees_close(result.params, ref_params, rtol=2e-5, atol=2e-6)
  assert_trees_close(result.opt_state, ref_state, rtol=2e-5, atol=2e-6)


@pytest.mark.slow
def test_one_and_eight_devices_agree_and_resume_is_bit_identical(tmp_path):
  data, loss_fn, params = regression_problem()
  schedule = hand_schedule(6, 36, group=2, max_batches=2, seed=35)
  mesh = jax.make_mesh((8,), ("workers",))
  for tx, worker in ((_svrg(), dj.workers.Gradient(snapshot_every=5)), (_saga(48), None)):
    kw = dict(sampling=dj.Sampling(batch_size=BATCH), worker=worker)
    # The one-device run is in chunks of 4: one compiled program serves it, the interrupted and the resumed run.
    whole = dj.simulate(loss_fn, tx, params, data, schedule, execution=dj.Execution(chunk_size=4), **kw)
    multi = dj.simulate(loss_fn, tx, params, data, schedule, execution=dj.Execution(mesh=mesh), **kw)
    assert_trees_close(multi.params, whole.params, rtol=1e-5, atol=1e-6)
    assert_trees_close(multi.opt_state, whole.opt_state, rtol=1e-5, atol=1e-6)
    directory = tmp_path / type(tx.init(params)[0]).__name__
    stops = []

    def stop_after_three(info):
      stops.append(info["chunk"])
      if info["chunk"] == 2:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
      dj.simulate(loss_fn, tx, params, data, schedule, execution=dj.Execution(chunk_size=4),
                  checkpoint=dj.Checkpoint(directory), record=dj.Record(callback=stop_after_three), **kw)
    resumed = dj.simulate(loss_fn, tx, params, data, schedule, execution=dj.Execution(chunk_size=4),
                          checkpoint=dj.Checkpoint(directory), **kw)
    for a, b in zip(jax.tree.leaves((whole.params, whole.opt_state)),
                    jax.tree.leaves((resumed.params, resumed.opt_state)), strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(whole.history.loss, resumed.history.loss)


def _finite_sum(n=64, d=5, seed=0):
  """Ridge regression with a closed-form optimum."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n, d)).astype(np.float32)
  y = (x @ rng.standard_normal(d) + 0.3 * rng.standard_normal(n)).astype(np.float32)
  lam = 0.1

  def loss_fn(w, batch):
    return 0.5 * jnp.mean((batch["x"] @ w - batch["y"]) ** 2) + 0.5 * lam * jnp.sum(w ** 2)

  x64, y64 = x.astype(np.float64), y.astype(np.float64)
  w_star = np.linalg.solve(x64.T @ x64 / n + lam * np.eye(d), x64.T @ y64 / n)

  def objective(w):
    w = np.asarray(w, np.float64)
    return 0.5 * np.mean((x64 @ w - y64) ** 2) + 0.5 * lam * w @ w

  return {"x": x, "y": y}, loss_fn, objective, objective(w_star)


@pytest.mark.fast_compile
@pytest.mark.slow
@pytest.mark.parametrize("tau", [0, 4, 16])
def test_asynchronous_variance_reduction_converges_where_sgd_stalls(tau):
  """AsySVRG and ASAGA under dj.simulate's stale reads reach a suboptimality far below plain
  asynchronous SGD's noise floor with the same step."""
  data, loss_fn, objective, f_star = _finite_sum()
  n, step, updates = 64, 0.02 if tau < 16 else 0.01, 3000
  source = dj.delays.constant(tau)
  w0 = jnp.zeros(5)
  one = dj.Sampling(batch_size=1)
  runs = {
      "sgd": dj.simulate(loss_fn, optax.sgd(step), w0, data, source, num_updates=updates, sampling=one),
      "svrg": dj.simulate(loss_fn, _svrg(optax.sgd(step)), w0, data, source, num_updates=updates, sampling=one,
                          worker=dj.workers.Gradient(snapshot_every=2 * n)),
      "saga": dj.simulate(loss_fn, _saga(n, optax.sgd(step)), w0, data, source, num_updates=updates, sampling=one),
  }
  gap = {k: objective(r.params) - f_star for k, r in runs.items()}
  assert gap["sgd"] > 1e-4, gap
  assert gap["svrg"] < 1e-8 and gap["saga"] < 1e-8, gap


@pytest.mark.fast_compile
def test_bad_variance_reduction_arguments():
  data, loss_fn, params = regression_problem()
  source = dj.delays.constant(1)
  with pytest.raises(ValueError, match=r"snapshot_every=4 is only used when tx requests full_grad"):
    dj.simulate(loss_fn, optax.sgd(0.1), params, data, source, num_updates=4,
                worker=dj.workers.Gradient(snapshot_every=4))
  with pytest.raises(ValueError, match=r"full_batch_size=8 is only used when tx requests full_grad"):
    dj.simulate(loss_fn, optax.sgd(0.1), params, data, source, num_updates=4,
                worker=dj.workers.Gradient(full_batch_size=8))
  with pytest.raises(ValueError, match=r"Gradient.full_batch_size must be"):
    dj.simulate(loss_fn, _svrg(), params, data, source, num_updates=4, worker=dj.workers.Gradient(full_batch_size=0))
  with pytest.raises(ValueError, match=r"Gradient.snapshot_every must be"):
    dj.simulate(loss_fn, _svrg(), params, data, source, num_updates=4, worker=dj.workers.Gradient(snapshot_every=0))
  with pytest.raises(ValueError, match=r"local_steps: tx requests per-contribution inputs \['snapshot_grad'\]"):
    dj.simulate(loss_fn, _svrg(), params, data, source, num_updates=4,
                worker=dj.workers.LocalSteps(2, optax.sgd(0.1)))
  with pytest.raises(ValueError, match=r"sample_terms is required when tx requests sample_scalars"):
    dj.simulate(loss_fn, optax.chain(dj.saga(48, table="scalars"), optax.sgd(0.1)), params, data, source,
                num_updates=4)
  with pytest.raises(ValueError, match=r"and only then; tx requests no runtime inputs and sample_terms is given"):
    dj.simulate(loss_fn, optax.sgd(0.1), params, data, source, num_updates=4,
                worker=dj.workers.Gradient(sample_terms=lambda w, b: None))
  unmasked = optax.GradientTransformationExtraArgs(lambda p: _Unmasked(), lambda u, s, p=None, **e: (u, s))
  with pytest.raises(ValueError, match=r"\['_Unmasked'\] request per-example inputs without sample_mask"):
    dj.simulate(loss_fn, unmasked, params, data, source, num_updates=4)
  problem = dj.problems.make_dense("logistic", 16, 3, lam=0.1, seed=0)
  scalar_saga = optax.chain(dj.saga(16, table="scalars"), optax.sgd(0.1))
  for terms, match in ((lambda w, b: problem.per_sample(w, b).scalars, "must return a pair"),
                       (lambda w, b: (jnp.zeros(3), problem.per_sample(w, b).features), r"scalars must have shape"),
                       (lambda w, b: (problem.per_sample(w, b).scalars, {"a": b["x"][:, 0]}),
                        "sample_features must have the structure of the updates"),
                       (lambda w, b: (problem.per_sample(w, b).scalars, {"a": jnp.zeros((3, 3))}),
                        r"features must be a pytree of arrays with a leading \[batch\] = 4 axis")):
    with pytest.raises((TypeError, ValueError), match=match):
      dj.simulate(problem.loss_fn, scalar_saga, jnp.zeros(3), problem.data(), source, num_updates=4,
                  sampling=dj.Sampling(batch_size=BATCH), worker=dj.workers.Gradient(sample_terms=terms))
  with pytest.raises(ValueError, match=r"at most one transformation in a chain may request snapshot_grad"):
    dj.simulate(loss_fn, optax.chain(dj.svrg(), dj.svrg(), optax.sgd(0.1)), params, data, source, num_updates=4)


@pytest.mark.fast_compile
@pytest.mark.slow
def test_sparse_and_dense_finite_sums_give_the_same_asynchronous_runs():
  """dj.problems' padded-CSR data runs through dj.simulate's per-example inputs like its dense twin."""
  sparse = dj.problems.make_sparse("logistic", 40, 12, 3, lam=0.01, seed=3)
  dense = dj.problems.FiniteSum("logistic", sparse.targets, sparse.lam,
                                features=dj.problems.to_dense(sparse.indices, sparse.values, 12))
  schedule = hand_schedule(3, 30, group=2, seed=36)
  w0 = jnp.zeros(12)
  svrg_worker = dj.workers.Gradient(snapshot_every=10)
  for tx, worker in ((_svrg(optax.sgd(0.5)), svrg_worker), (_saga(40, optax.sgd(0.5)), None)):
    runs = [dj.simulate(p.loss_fn, tx, w0, p.data(), schedule, sampling=dj.Sampling(batch_size=2), seed=1,
                        worker=worker) for p in (sparse, dense)]
    assert_trees_close(runs[0].params, runs[1].params, rtol=1e-5, atol=1e-6)
    assert_trees_close(runs[0].opt_state, runs[1].opt_state, rtol=1e-5, atol=1e-6)
    assert np.abs(np.asarray(runs[0].params)).max() > 1e-2  # it moved


@pytest.mark.fast_compile
@pytest.mark.slow
@pytest.mark.parametrize("name", ["async", "grouped"])
def test_saga_scalar_table_matches_the_reference_and_the_gradient_table(name):
  """With sample_terms (dj.problems' per_sample), the n-scalar table follows the reference, and
  without a regularizer (lam = 0: both tables then hold the same gradients s_i x_i) it gives the
  run of the full gradient table."""
  problem = dj.problems.make_dense("least_squares", 40, 4, lam=0.0, seed=2)
  schedule = _schedule(name)
  w0 = jnp.zeros(4)
  kw = dict(batch_size=BATCH, seed=3)
  sim_kw = dict(sampling=dj.Sampling(batch_size=BATCH), seed=3)
  scalar = optax.chain(dj.saga(40, table="scalars"), optax.sgd(0.05))
  table = optax.chain(dj.saga(40), optax.sgd(0.05))
  result = dj.simulate(problem.loss_fn, scalar, w0, problem.data(), schedule,
                       worker=dj.workers.Gradient(sample_terms=problem.per_sample), **sim_kw)
  ref_params, ref_state, _, _, _ = reference(problem.loss_fn, scalar, w0, problem.data(), schedule,
                                             sample_terms=problem.per_sample, **kw)
  assert_trees_close(result.params, ref_params, rtol=2e-5, atol=2e-6)
  assert_trees_close(result.opt_state, ref_state, rtol=2e-5, atol=2e-6)
  full = dj.simulate(problem.loss_fn, table, w0, problem.data(), schedule, **sim_kw)
  assert_trees_close(result.params, full.params, rtol=2e-5, atol=2e-6)
  assert np.abs(np.asarray(full.params)).max() > 0.1


@pytest.mark.fast_compile
@pytest.mark.parametrize("source", ["async", "stale read"])
def test_sparse_prox_asaga_matches_the_reference(source):
  """ProxASAGA's sparse update, one example per update, at the parameters each worker read."""
  problem = dj.problems.make_sparse("logistic", 40, 12, 3, lam=0.0, seed=4)
  tx = dj.prox_asaga(40, 0.5, dj.prox_elastic_net(0.01, 0.05), support_counts=problem.support_counts())

  def terms(w, batch):
    return problem.per_sample(w, batch).scalars, {"indices": batch["indices"], "values": batch["values"]}

  schedule = _schedule(source)
  w0 = jnp.zeros(12)
  kw = dict(batch_size=1, seed=5, sample_terms=terms)
  result = dj.simulate(problem.loss_fn, tx, w0, problem.data(), schedule, sampling=dj.Sampling(batch_size=1), seed=5,
                       worker=dj.workers.Gradient(sample_terms=terms))
  ref_params, ref_state, _, _, _ = reference(problem.loss_fn, tx, w0, problem.data(), schedule, **kw)
  assert int(np.max(schedule.staleness)) > 0 and np.count_nonzero(np.asarray(ref_params)) > 3
  assert_trees_close(result.params, ref_params, rtol=2e-5, atol=2e-6)
  assert_trees_close(result.opt_state, ref_state, rtol=2e-5, atol=2e-6)
