"""``dj.simulate`` against a slow sequential reference, across schedules, devices, processes and restarts."""

import logging
import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj
from delayjax.runtime._simulate import schedule_from_delays

sys.path.insert(0, os.path.dirname(__file__))
from simulate_reference import (  # noqa: E402
    assert_trees_close, hand_schedule, multiprocess_case, probe, reference, regression_problem, round_robin)

BATCH = 4


def _cluster(paradigm, num_workers, num_updates, seed=0, **workers):
  return dj.cluster.simulate(paradigm, dj.cluster.workers(num_workers, **workers),
                             num_updates=num_updates, seed=seed)


def _without(schedule, update):
  """The schedule with every contribution to ``update`` removed (an update that changes nothing)."""
  contributes, read_version = schedule.contributes.copy(), schedule.read_version.copy()
  contributes[update], read_version[update] = False, -1
  return dj.cluster.Schedule(time=schedule.time, contributes=contributes, read_version=read_version,
                             wait=schedule.wait)


SCHEDULES = {
    "bsp": lambda: _cluster(dj.cluster.bsp(), 3, 8),
    "asp": lambda: _cluster(dj.cluster.asp(), 5, 30, seed=1),
    "ssp": lambda: _cluster(dj.cluster.ssp(2), 4, 30, seed=2),
    "k_async": lambda: _cluster(dj.cluster.k_async(2), 4, 20, seed=3),
    "softsync": lambda: _cluster(dj.cluster.softsync(2), 4, 20, seed=4),
    "k_batch_sync": lambda: _cluster(dj.cluster.k_batch_sync(5), 3, 8, seed=5),
    "round_robin": lambda: round_robin(4, 24),
    # Pushes that arrive long after the next read: workers need several slots.
    "latency": lambda: hand_schedule(4, 30, latency=2.5, seed=6),
    "grouped_multibatch": lambda: hand_schedule(5, 20, group=2, max_batches=3, seed=7),
    "empty_update": lambda: _without(round_robin(3, 15), update=6),
    "stale_read_constant": lambda: dj.delays.constant(3),
    "stale_read_uniform": lambda: dj.delays.uniform(4),
}


def _assert_trees_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _as_schedule(source, num_updates, seed):
  if isinstance(source, dj.cluster.Schedule):
    return source
  return schedule_from_delays(source, num_updates, seed)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_matches_sequential_reference(name):
  data, loss_fn, params = regression_problem()
  source = SCHEDULES[name]()
  schedule = _as_schedule(source, 24, seed=1)
  tx = probe(0.05, schedule.num_workers)
  result = dj.simulate(loss_fn, tx, params, data, source, num_updates=schedule.num_updates,
                       sampling=dj.Sampling(batch_size=BATCH), seed=1)
  ref_params, ref_state, ref_loss, _, _ = reference(loss_fn, tx, params, data, schedule,
                                                    batch_size=BATCH, seed=1)
  assert_trees_close(result.params, ref_params, rtol=1e-5, atol=1e-6)
  assert_trees_close(result.opt_state.last, ref_state.last, rtol=1e-5, atol=1e-6)
  # Which worker and staleness each update was credited with, exactly.
  np.testing.assert_array_equal(result.opt_state.per_worker, ref_state.per_worker)
  np.testing.assert_array_equal(result.opt_state.staleness_sum, ref_state.staleness_sum)
  np.testing.assert_array_equal(result.opt_state.count, schedule.contributes.any(axis=1).sum())
  np.testing.assert_allclose(result.history.loss, ref_loss, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(result.history.staleness, schedule.staleness.max(axis=1))
  np.testing.assert_array_equal(result.history.time, schedule.time)
  if name == "latency":
    assert result.stats["num_slots"] > 1  # the case the slots exist for is exercised


@pytest.mark.fast_compile
@pytest.mark.parametrize("name", ["dana", "dc_asgd_staleness"])
def test_package_transformations_match_reference(name):
  """DANA's look-ahead reads (read_params) and DC-ASGD's stale_params, as the package defines them."""
  data, loss_fn, params = regression_problem()
  schedule = _cluster(dj.cluster.asp(), 5, 24, seed=3)
  tx = (dj.dana(0.05, 0.9, num_workers=5) if name == "dana" else
        optax.chain(dj.delay_compensation(lam=1.0, adaptive=True), dj.scale_by_staleness("inverse"),
                    optax.sgd(0.05)))
  result = dj.simulate(loss_fn, tx, params, data, schedule, sampling=dj.Sampling(batch_size=BATCH))
  ref_params, ref_state, _, _, _ = reference(loss_fn, tx, params, data, schedule, batch_size=BATCH)
  assert_trees_close(result.params, ref_params, rtol=1e-5, atol=1e-6)
  assert_trees_close(result.opt_state, ref_state, rtol=1e-5, atol=1e-6)


def test_stale_read_schedule_follows_the_delay_model():
  key = jax.random.fold_in(jax.random.key(3), 0)
  t = np.arange(50)
  # Every bound's delays come from one compiled draw, the bound an argument: they are the draws with the bound
  # a constant, d_t = randint(fold_in(key, t), 0, s + 1).
  for s in (5, 0, 2, 16):
    schedule = schedule_from_delays(dj.delays.uniform(s), 50, seed=3)
    delays = np.array([int(jax.random.randint(jax.random.fold_in(key, u), (), 0, s + 1, dtype=jnp.int32))
                       for u in range(50)])
    np.testing.assert_array_equal(schedule.read_version[t, t % (s + 1)], np.maximum(0, t - delays))
    assert schedule.contributes.sum() == 50 and np.array_equal(schedule.time, t)
  assert len(np.unique(delays)) > 8
  # constant(tau) is the round-robin cluster of tau + 1 workers.
  constant, rr = schedule_from_delays(dj.delays.constant(3), 20, seed=0), round_robin(4, 20)
  np.testing.assert_array_equal(constant.contributes, rr.contributes)
  np.testing.assert_array_equal(constant.read_version, rr.read_version)


@pytest.mark.fast_compile
@pytest.mark.parametrize("sampling", ["epoch", "shard"])
def test_sampling_matches_reference(sampling):
  data, loss_fn, params = regression_problem(num_examples=20)
  schedule = hand_schedule(3, 24, max_batches=2, seed=8)
  shards = [np.arange(0, 5), np.arange(5, 20, 2), np.array([19, 1, 3])] if sampling == "shard" else None
  tx = optax.sgd(0.05)
  result = dj.simulate(loss_fn, tx, params, data, schedule,
                       sampling=dj.Sampling(batch_size=BATCH, scheme=sampling, shards=shards), seed=2)
  ref_params, _, ref_loss, _, _ = reference(loss_fn, tx, params, data, schedule, batch_size=BATCH,
                                            sampling=sampling, shards=shards, seed=2)
  assert_trees_close(result.params, ref_params, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(result.history.loss, ref_loss, rtol=1e-5, atol=1e-6)


def test_minibatch_indices_sampling_rules():
  n, b = 10, 4
  kw = dict(num_examples=n, batch_size=b)
  # epoch: each worker's stream is a sequence of permutations of the data.
  stream = np.concatenate([np.asarray(dj.runtime.minibatch_indices(0, 0, 1, j, sampling="epoch", **kw))
                           for j in range(5)])
  assert sorted(stream[:n]) == list(range(n)) and sorted(stream[n:2 * n]) == list(range(n))
  other = np.concatenate([np.asarray(dj.runtime.minibatch_indices(0, 0, 2, j, sampling="epoch", **kw))
                          for j in range(5)])
  assert not np.array_equal(stream, other)
  # shard: only the worker's own indices.
  shard = jnp.array([7, 3, 5, 0], jnp.int32)
  picks = np.concatenate([np.asarray(dj.runtime.minibatch_indices(0, u, 0, 0, sampling="shard", shard=shard,
                                                                  shard_size=3, **kw)) for u in range(20)])
  assert set(picks.tolist()) == {7, 3, 5}
  # iid: same arguments, same draw; another update, another draw.
  first = dj.runtime.minibatch_indices(4, 3, 1, 0, **kw)
  np.testing.assert_array_equal(first, dj.runtime.minibatch_indices(4, 3, 1, 0, **kw))
  assert not np.array_equal(first, dj.runtime.minibatch_indices(4, 4, 1, 0, **kw))


@pytest.mark.slow
def test_one_and_eight_devices_agree():
  num_workers = 12  # padded with four idle workers to two per device
  data, loss_fn, params = regression_problem()
  schedule = _cluster(dj.cluster.asp(), num_workers, 40, seed=9)
  tx = probe(0.05, num_workers)
  single = dj.simulate(loss_fn, tx, params, data, schedule, sampling=dj.Sampling(batch_size=BATCH))
  mesh = jax.make_mesh((8,), ("workers",))
  multi = dj.simulate(loss_fn, tx, params, data, schedule, sampling=dj.Sampling(batch_size=BATCH),
                      execution=dj.Execution(mesh=mesh))
  assert multi.stats["num_devices"] == 8 and multi.stats["num_workers"] == 16
  assert_trees_close(multi.params, single.params, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(multi.opt_state.per_worker, single.opt_state.per_worker)
  np.testing.assert_allclose(multi.history.loss, single.history.loss, rtol=1e-5, atol=1e-6)


def test_resume_is_bit_identical(tmp_path):
  data, loss_fn, params = regression_problem()
  schedule = hand_schedule(4, 40, latency=1.5, seed=10)
  tx = optax.sgd(0.05, momentum=0.9)
  eval_fn = lambda p: {"norm": jnp.sum(p["w"] ** 2)}
  kwargs = dict(sampling=dj.Sampling(batch_size=BATCH), execution=dj.Execution(chunk_size=3), seed=4)
  whole = dj.simulate(loss_fn, tx, params, data, schedule, record=dj.Record(eval_fn=eval_fn, every=7), **kwargs)
  assert whole.stats["num_chunks"] >= 4

  class Stop(Exception):
    pass

  def stop_after_two(info):
    if info["chunk"] == 1:
      raise Stop

  with pytest.raises(Stop):
    dj.simulate(loss_fn, tx, params, data, schedule, checkpoint=dj.Checkpoint(tmp_path),
                record=dj.Record(eval_fn=eval_fn, every=7, callback=stop_after_two), **kwargs)
  seen = []
  resumed = dj.simulate(loss_fn, tx, params, data, schedule, checkpoint=dj.Checkpoint(tmp_path),
                        record=dj.Record(eval_fn=eval_fn, every=7, callback=lambda info: seen.append(info["chunk"])),
                        **kwargs)
  assert seen[0] == 2  # it did continue rather than start over
  _assert_trees_equal(resumed.params, whole.params)
  _assert_trees_equal(resumed.opt_state, whole.opt_state)
  _assert_trees_equal(resumed.history, whole.history)
  # A checkpoint of another run is refused rather than silently mixed in.
  with pytest.raises(ValueError, match="checkpoint directory holds a checkpoint"):
    dj.simulate(loss_fn, tx, params, data, schedule, checkpoint=dj.Checkpoint(tmp_path),
                record=dj.Record(eval_fn=eval_fn, every=7), **{**kwargs, "seed": 5})


@pytest.mark.slow
def test_same_seed_is_bit_identical_and_chunking_and_lanes_do_not_matter():
  data, loss_fn, params = regression_problem()
  schedule = _cluster(dj.cluster.ssp(2), 4, 30, seed=11)
  tx = probe(0.05, 4)
  sampling = dj.Sampling(batch_size=BATCH)
  a = dj.simulate(loss_fn, tx, params, data, schedule, sampling=sampling, seed=7)
  b = dj.simulate(loss_fn, tx, params, data, schedule, sampling=sampling, seed=7,
                  execution=dj.Execution(chunk_size=2))
  c = dj.simulate(loss_fn, tx, params, data, schedule, sampling=sampling, seed=8)
  _assert_trees_equal(a.params, b.params)
  np.testing.assert_array_equal(a.history.loss, b.history.loss)
  # Nor does how many gradients a step computes (which changes which step computes each).
  for lanes in (1, 3):
    d = dj.simulate(loss_fn, tx, params, data, schedule, sampling=sampling, seed=7,
                    execution=dj.Execution(lanes=lanes))
    _assert_trees_equal(a.params, d.params)
    np.testing.assert_array_equal(a.history.loss, d.history.loss)
  assert not np.array_equal(a.history.loss, c.history.loss)


def test_chunks_compile_once(caplog):
  data, loss_fn, params = regression_problem()
  schedule = round_robin(4, 40)
  with jax.log_compiles(True), caplog.at_level(logging.WARNING):
    result = dj.simulate(loss_fn, optax.sgd(0.05), params, data, schedule, sampling=dj.Sampling(batch_size=BATCH),
                         execution=dj.Execution(chunk_size=2))
  assert result.stats["num_chunks"] >= 5
  compiles = [r for r in caplog.records if "Compiling" in r.getMessage() and "chunk" in r.getMessage()]
  assert len(compiles) == 1, [r.getMessage() for r in compiles]


@pytest.mark.parametrize("skip", [False, True])
def test_nonfinite_gradients_are_reported_and_skipped(skip):
  data, loss_fn, params = regression_problem(num_examples=24)
  data["x"][5] = np.nan  # every minibatch holding example 5 has a NaN gradient
  schedule = hand_schedule(3, 30, group=2, seed=12)
  tx = probe(0.05, 3)
  result = dj.simulate(loss_fn, tx, params, data, schedule, sampling=dj.Sampling(batch_size=BATCH),
                       record=dj.Record(nonfinite="skip" if skip else "report"))
  ref_params, ref_state, _, ref_bad, _ = reference(loss_fn, tx, params, data, schedule, batch_size=BATCH,
                                                   skip_nonfinite=skip)
  assert len(ref_bad) > 0
  np.testing.assert_array_equal(result.history.nonfinite, np.asarray(ref_bad).reshape(-1, 2))
  if skip:
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(result.params))
    assert_trees_close(result.params, ref_params, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(result.opt_state.count, ref_state.count)
    # Updates whose every contribution was bad were skipped whole.
    bad_updates = {u for u, _ in ref_bad}
    fully_bad = [u for u in bad_updates if {m for v, m in ref_bad if v == u}
                 == set(np.flatnonzero(schedule.contributes[u]).tolist())]
    assert fully_bad and int(result.opt_state.count) == 30 - len(fully_bad)
  else:
    assert not all(np.all(np.isfinite(x)) for x in jax.tree.leaves(result.params))


def test_eval_history_indices_times_and_values():
  data, loss_fn, params = regression_problem()
  schedule = _cluster(dj.cluster.asp(), 3, 23, seed=13)
  tx = optax.sgd(0.05)

  def eval_fn(p):
    return {"norm": jnp.sum(p["w"] ** 2), "b": p["b"]}

  result = dj.simulate(loss_fn, tx, params, data, schedule, sampling=dj.Sampling(batch_size=BATCH),
                       record=dj.Record(eval_fn=eval_fn, every=5), execution=dj.Execution(chunk_size=2))
  *_, versions = reference(loss_fn, tx, params, data, schedule, batch_size=BATCH)
  np.testing.assert_array_equal(result.history.eval_update, [0, 5, 10, 15, 20, 23])
  np.testing.assert_array_equal(result.history.eval_time, [0.0] + [schedule.time[v - 1] for v in (5, 10, 15, 20, 23)])
  expected = [eval_fn(versions[v][0]) for v in result.history.eval_update]
  np.testing.assert_allclose(result.history.eval_metrics["norm"], [e["norm"] for e in expected], rtol=1e-5)
  np.testing.assert_allclose(result.history.eval_metrics["b"], [e["b"] for e in expected], rtol=1e-5, atol=1e-7)


def test_matches_delayed_wrapper_with_constant_delay():
  """dj.simulate's stale reads and dj.delayed's late applies are one process for constant delays."""
  tau, num_updates = 3, 20
  data, loss_fn, params = regression_problem()
  tx = optax.sgd(0.05, momentum=0.9)

  def with_aux(p, batch):
    return loss_fn(p, batch), {"n": batch["x"].shape[0]}

  result = dj.simulate(with_aux, tx, params, data, dj.delays.constant(tau), num_updates=num_updates,
                       sampling=dj.Sampling(batch_size=BATCH), seed=6)
  np.testing.assert_array_equal(result.history.time, np.arange(num_updates))
  np.testing.assert_array_equal(result.history.staleness, np.minimum(np.arange(num_updates), tau))
  delayed = dj.delayed(tx, dj.delays.constant(tau))
  state = delayed.init(params)
  grad_fn = jax.jit(jax.grad(loss_fn))
  step = jax.jit(lambda g, s, p: delayed.update(g, s, p))
  w = params
  # The gradient computed at call s is applied at call s + tau, as update s.
  for s in range(num_updates + tau):
    idx = dj.runtime.minibatch_indices(6, s, s % (tau + 1), s // (tau + 1), num_examples=48, batch_size=BATCH)
    g = grad_fn(w, jax.tree.map(lambda x: jnp.asarray(x)[idx], data))
    updates, state = step(g, state, w)
    w = optax.apply_updates(w, updates)
  assert_trees_close(result.params, w, rtol=1e-5, atol=1e-6)


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_match_one_with_and_without_resume(tmp_path):
  out = tmp_path / "two.npz"
  port = _free_port()
  script = os.path.join(os.path.dirname(__file__), "simulate_multiprocess.py")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = os.pathsep.join([os.getcwd()] + sys.path)
  checkpoints = tmp_path / "checkpoints"
  procs = [subprocess.Popen([sys.executable, script, str(port), str(i), str(out), str(checkpoints)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
  logs = []
  for p in procs:
    try:
      logs.append(p.communicate(timeout=120)[0])
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      pytest.fail("the two-process run did not finish in 120 s")
  if any(p.returncode for p in procs):
    text = "\n".join(logs)
    if "gloo" in text.lower() and ("not" in text.lower() and "available" in text.lower()):
      pytest.skip(f"gloo CPU collectives are unavailable: {text[-500:]}")
    pytest.fail("two-process run failed:\n" + text[-3000:])
  mesh = jax.make_mesh((4,), ("workers",), devices=jax.devices()[:4])
  loss_fn, tx, params, data, schedule, kwargs = multiprocess_case(mesh)
  single = dj.simulate(loss_fn, tx, params, data, schedule, **kwargs)
  assert single.stats["num_chunks"] >= 3  # so the interrupted run really stopped midway
  with np.load(out) as two:
    # Straight through, and interrupted then resumed from a checkpoint written
    # across processes: both bit-identical to one process.
    for name in ("straight", "resumed"):
      np.testing.assert_array_equal(two[f"{name}_loss"], single.history.loss)
      for i, leaf in enumerate(jax.tree.leaves((single.params, single.opt_state))):
        np.testing.assert_array_equal(two[f"{name}_{i}"], np.asarray(leaf))


def _eval(params):
  return {"norm": jnp.sum(params["w"] ** 2)}


# Options are checked when they are made: each case builds its keywords inside pytest.raises.
@pytest.mark.parametrize("kwargs, error, match", [
    (lambda: dict(num_updates=50), ValueError, r"num_updates=50 .* has only 20 updates"),
    (lambda: dict(sampling=dj.Sampling(batch_size=0)), ValueError,
     r"Sampling.batch_size must be an integer >= 1, got 0"),
    (lambda: dict(sampling=dj.Sampling(scheme="stratified")), ValueError,
     r"Sampling.scheme must be one of 'iid', 'epoch', 'shard'; got 'stratified'"),
    (lambda: dict(execution=dj.Execution(mesh="devices")), TypeError, r"Execution.mesh must be a jax.sharding.Mesh"),
    (lambda: dict(sampling=dj.Sampling(shards=[np.arange(3)] * 4)), ValueError,
     r"Sampling.shards is only used with Sampling.scheme='shard'"),
    (lambda: dict(sampling=dj.Sampling(scheme="shard", shards=[np.arange(3)] * 3)), ValueError,
     r"shards must hold one index array per worker \(4\), got 3"),
    (lambda: dict(sampling=dj.Sampling(scheme="shard", shards=[np.arange(3)] * 3 + [np.array([99])])), ValueError,
     r"shards\[3\] holds indices outside 0..47"),
    (lambda: dict(record=dj.Record(eval_fn=_eval, every=0)), ValueError, r"Record.every must be an integer >= 1"),
    (lambda: dict(execution=dj.Execution(chunk_size=1.5)), TypeError, r"Execution.chunk_size must be an integer"),
])
def test_bad_arguments(kwargs, error, match):
  data, loss_fn, params = regression_problem()
  with pytest.raises(error, match=match):
    dj.simulate(loss_fn, optax.sgd(0.1), params, data, round_robin(4, 20), **kwargs())


def test_bad_sources_data_and_mesh():
  data, loss_fn, params = regression_problem()
  with pytest.raises(ValueError, match=r"data leaves must share their leading dimension.*\['x'\]: 48.*\['y'\]: 47"):
    dj.simulate(loss_fn, optax.sgd(0.1), params, {"x": data["x"], "y": data["y"][:47]}, round_robin(2, 5))
  with pytest.raises(ValueError, match=r"mesh must have an axis named 'workers'; got axes \('data',\)"):
    dj.simulate(loss_fn, optax.sgd(0.1), params, data, round_robin(2, 5),
                execution=dj.Execution(mesh=jax.make_mesh((2,), ("data",))))
  with pytest.raises(ValueError, match="num_updates is required when source is a delay model"):
    dj.simulate(loss_fn, optax.sgd(0.1), params, data, dj.delays.constant(2))
  with pytest.raises(TypeError, match="source must be a dj.cluster.Schedule or a delay model.*got list"):
    dj.simulate(loss_fn, optax.sgd(0.1), params, data, [1, 2, 3], num_updates=3)
  with pytest.raises(ValueError, match=r"the per-leaf delay tree .* is not a prefix of the parameter tree"):
    dj.simulate(loss_fn, optax.sgd(0.1), params, data,
                dj.delays.per_leaf({"w": dj.delays.constant(1), "c": dj.delays.constant(0)}), num_updates=3)
  with pytest.raises(ValueError, match="batch_size=64 is larger than the data set"):
    dj.simulate(loss_fn, optax.sgd(0.1), params, data, round_robin(2, 5),
                sampling=dj.Sampling(batch_size=64, scheme="epoch"))
