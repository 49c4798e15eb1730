"""``dj.Runs(sources=..., params=...)``: runs of schedules and initial parameters of their own, computed by one
``dj.simulate`` call, equal the separate calls bit for bit."""

import os
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj
from delayjax.runtime import _engine as engine

BATCH = 4


def execution(sources):
  """Fixed lanes (a separate run would choose its own plan's, and the plans' steps, the rounding, would differ),
  and the separate runs sized like the call's (one compiled program; results do not depend on it)."""
  return dj.Execution(chunk_size=8, lanes=2, like=sources)


@pytest.fixture(scope="module")
def problem():
  rng = np.random.default_rng(7)
  x = rng.normal(size=(64, 3)).astype(np.float32)
  data = {"x": x, "y": np.tanh(x @ np.array([1.0, -2.0, 0.5], np.float32))}
  # Schedules of one set of workers, of different seeds and lengths: the shorter ones' plans end first.
  sources = [dj.cluster.simulate(dj.cluster.asp(), dj.cluster.workers(4),
                                 num_updates=n, seed=s) for n, s in ((40, 1), (28, 2), (40, 3))]
  params = [{"w": jnp.asarray(rng.normal(size=(3, 5)), jnp.float32), "v": jnp.asarray(rng.normal(size=5), jnp.float32)}
            for _ in sources]
  return data, sources, params


def loss_fn(params, batch):
  return jnp.mean((jnp.tanh(batch["x"] @ params["w"]) @ params["v"] - batch["y"]) ** 2)


def _record():
  return dj.Record(eval_fn=lambda p: {"norm": jnp.sum(p["v"] ** 2)}, every=6)


def _separate(data, tx, params, source, seed, like):
  return dj.simulate(loss_fn, tx, params, data, source, seed=seed, sampling=dj.Sampling(batch_size=BATCH),
                     record=_record(), execution=execution(like))


def _together(data, tx, params, sources, seeds, **runs):
  return dj.simulate(loss_fn, tx, params[0], data, None,
                     seed=dj.Runs(seeds=seeds, sources=sources, params=params, **runs),
                     sampling=dj.Sampling(batch_size=BATCH), record=_record(), execution=execution(sources))


def _assert_identical(together, separate):
  """Bit for bit: each run of the call runs the separate run's program."""
  for x, y in zip(jax.tree.leaves((together.params, together.opt_state, together.history)),
                  jax.tree.leaves((separate.params, separate.opt_state, separate.history)), strict=True):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(x, y)
  for name in ("num_steps", "num_waves", "lanes", "num_slots"):
    assert together.stats[name] == separate.stats[name], name


@pytest.mark.parametrize("tx", [optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)),
                                optax.sgd(0.1, momentum=0.9)], ids=["clipped", "momentum"])
def test_runs_of_their_own_schedules_and_parameters_equal_the_separate_calls(problem, tx):
  data, sources, params = problem
  seeds = [0, 5, 9]
  together = _together(data, tx, params, sources, seeds)
  assert len(together) == 3
  for r, result in enumerate(together):
    _assert_identical(result, _separate(data, tx, params[r], sources[r], seeds[r], sources))
  # The shorter schedule's run has its own length of history; the runs differ.
  assert together[1].history.loss.shape == (28,) and together[0].history.loss.shape == (40,)
  assert not np.array_equal(together[0].history.loss, together[2].history.loss)


@pytest.mark.parametrize("cpus", [1, 4])
def test_runs_computed_side_by_side_in_float64_equal_the_separate_calls(problem, monkeypatch, cpus):
  # On CPU devices the runs are computed by a pool of threads, one per CPU (one CPU: in the caller's thread). The
  # caller's jax.config context (here float64) holds for its own thread only, and must hold for every run.
  data, sources, params = problem
  monkeypatch.setattr(engine, "_host_cpus", lambda: cpus)
  monkeypatch.setattr(engine, "_pool", None)
  threads = set()
  computed = engine._concurrent_runs

  def spied(fn, runs):
    return computed(lambda r: (threads.add(threading.current_thread().name), fn(r))[1], runs)

  monkeypatch.setattr(engine, "_concurrent_runs", spied)
  with jax.enable_x64(True):
    data64, params64 = jax.tree.map(lambda x: np.asarray(x, np.float64), (data, params))
    tx = optax.sgd(0.1, momentum=0.9)
    seeds = [0, 5, 9]
    together = _together(data64, tx, params64, sources, seeds)
    separate = [_separate(data64, tx, params64[r], sources[r], seeds[r], sources) for r in range(3)]
  for result, alone in zip(together, separate, strict=True):
    assert all(x.dtype == np.float64 for x in jax.tree.leaves(result.params))
    _assert_identical(result, alone)
  assert bool(threads) and all(name.startswith("delayjax-runs") for name in threads) == (cpus > 1)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_computes_its_runs_with_threads_of_its_own(monkeypatch):
  # A child forked after the runs' pool started inherits the pool without its threads: work submitted to it
  # would wait forever, so the child must start a pool of its own.
  monkeypatch.setattr(engine, "_host_cpus", lambda: 2)
  parent = engine._runs_pool()
  assert list(parent.map(lambda r: r * 2, range(4))) == [0, 2, 4, 6]
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)  # JAX's warning that a fork may deadlock its own threads
    pid = os.fork()
  if pid == 0:
    try:
      ok = engine._runs_pool() is not parent and engine._runs_pool().submit(lambda: 5).result(timeout=30) == 5
    except BaseException:
      ok = False
    os._exit(0 if ok else 1)
  _, status = os.waitpid(pid, 0)
  assert os.waitstatus_to_exitcode(status) == 0
  assert engine._runs_pool() is parent


def test_runs_that_share_a_seed_equal_the_separate_calls(problem):
  # The minibatches of the runs of one seed are drawn together, their steps one after the other: each run must
  # still get its own plan's draws.
  data, sources, params = problem
  tx = optax.sgd(0.1)
  seeds = [4, 7, 4]
  together = _together(data, tx, params, sources, seeds)
  for r, result in enumerate(together):
    _assert_identical(result, _separate(data, tx, params[r], sources[r], seeds[r], sources))
  assert not np.array_equal(together[0].history.loss, together[2].history.loss)


def test_a_run_is_the_same_whatever_runs_it_shares_the_call_with(problem):
  data, sources, params = problem
  tx = optax.sgd(0.05, momentum=0.9)
  pair = _together(data, tx, params[:2], sources[:2], [4, 4])
  triple = _together(data, tx, [params[2], params[1], params[0]], [sources[2], sources[1], sources[0]], [1, 4, 2])
  _assert_identical(pair[1], triple[1])


def test_hyper_parameters_and_own_schedules_together(problem):
  data, sources, params = problem
  tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
  rates = [0.1, 0.03, 0.2]
  together = _together(data, tx, params, sources, [0, 1, 2], hyperparams={"learning_rate": rates})
  for r, rate in enumerate(rates):
    _assert_identical(together[r], _separate(data, optax.inject_hyperparams(optax.sgd)(learning_rate=rate),
                                             params[r], sources[r], r, sources))


def test_svrg_epochs_of_runs_of_their_own_schedules():
  """Full gradients at each run's own epoch starts, snapshots at its own versions."""
  rng = np.random.default_rng(3)
  x = rng.normal(size=(48, 3)).astype(np.float32)
  data = {"x": x, "y": x @ np.array([0.5, 1.0, -1.0], np.float32)}
  linear = lambda p, b: jnp.mean((b["x"] @ p - b["y"]) ** 2)
  sources = [dj.runtime.schedule_from_delays(dj.delays.uniform(s), 30, seed, num_workers=5)
             for s, seed in ((2, 0), (4, 1))]
  tx = optax.chain(dj.svrg(), optax.sgd(0.05))
  kwargs = dict(sampling=dj.Sampling(batch_size=BATCH), worker=dj.workers.Gradient(snapshot_every=7),
                execution=execution(sources))
  together = dj.simulate(linear, tx, jnp.zeros(3), data, None, seed=dj.Runs(seeds=[3, 8], sources=sources), **kwargs)
  for r, seed in enumerate((3, 8)):
    _assert_identical(together[r], dj.simulate(linear, tx, jnp.zeros(3), data, sources[r], seed=seed, **kwargs))


def test_a_run_that_diverges_is_reported_as_its_own(problem):
  data, sources, params = problem
  blown = dict(params[1], v=params[1]["v"] * 1e30)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    together = _together(data, optax.sgd(0.1), [params[0], blown], sources[:2], [0, 0])
  assert together[0].history.nonfinite.shape[0] == 0
  assert together[1].history.nonfinite.shape[0] > 0
  assert any("run 1" in str(w.message) for w in caught)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)
    _assert_identical(together[1], _separate(data, optax.sgd(0.1), blown, sources[1], 0, sources[:2]))


def test_bad_runs_of_their_own_schedules_are_refused(problem):
  data, sources, params = problem
  tx = optax.sgd(0.1)

  def call(source=None, **runs):
    # Fixed lanes: plans of their own lanes would get programs of their own, which need not agree.
    return dj.simulate(loss_fn, tx, params[0], data, source, seed=dj.Runs(**runs),
                       sampling=dj.Sampling(batch_size=BATCH), execution=dj.Execution(lanes=2))

  with pytest.raises(ValueError, match="pass source=None, got Schedule"):
    call(sources[0], seeds=[0, 1], sources=sources[:2])
  with pytest.raises(TypeError, match=r"Runs.sources\[1\] must be a dj.cluster.Schedule, got Uniform"):
    call(seeds=[0, 1], sources=[sources[0], dj.delays.uniform(2)])
  other = dj.cluster.simulate(dj.cluster.asp(), dj.cluster.workers(3), num_updates=20, seed=0)
  with pytest.raises(ValueError, match=r"Runs.sources\[1\] has 3 workers, but Runs.sources\[0\] has 4"):
    call(seeds=[0, 1], sources=[sources[0], other])
  grouped = dj.cluster.simulate(dj.cluster.bsp(), dj.cluster.workers(4), num_updates=10, seed=0)
  with pytest.raises(ValueError, match=r"Runs.sources\[1\] has up to 4 contributions per update, but "
                                       r"Runs.sources\[0\] up to 1"):
    call(seeds=[0, 1], sources=[sources[0], grouped])
  with pytest.raises(ValueError, match=r"Runs.params\[1\] must have params' structure, shapes and dtypes"):
    call(seeds=[0, 1], sources=sources[:2], params=[params[0], {"w": params[0]["w"]}])
  with pytest.raises(ValueError, match=r"Runs.params\[0\] must have params' structure"):
    call(seeds=[0, 1], sources=sources[:2], params=[jax.tree.map(lambda x: x.astype(jnp.float16), params[0]),
                                                    params[1]])
  with pytest.raises(ValueError, match=r"all of one non-zero length; got lengths .*'sources': 3.*'seeds': 2"):
    dj.Runs(seeds=[0, 1], sources=sources)
  with pytest.raises(TypeError, match="Runs.sources must be a list or tuple with one entry per run, or None; got "
                                      "Schedule"):
    dj.Runs(seeds=[0], sources=sources[0])


def test_runs_whose_plans_choose_different_lanes_equal_the_separate_calls(problem):
  """Without Execution.lanes each plan chooses its own; one program per lane count keeps every run as its separate
  call plans it."""
  data, sources, params = problem
  serial = dj.runtime.schedule_from_delays(dj.delays.constant(0), 30, 0, num_workers=4)
  mixed = [sources[0], serial, sources[2]]
  kwargs = dict(sampling=dj.Sampling(batch_size=BATCH), record=_record())
  separate = [dj.simulate(loss_fn, optax.sgd(0.1), params[r], data, mixed[r], seed=r, **kwargs) for r in range(3)]
  assert len({result.stats["lanes"] for result in separate}) == 2
  together = dj.simulate(loss_fn, optax.sgd(0.1), params[0], data, None,
                         seed=dj.Runs(seeds=[0, 1, 2], sources=mixed, params=params), **kwargs)
  for result, alone in zip(together, separate, strict=True):
    _assert_identical(result, alone)


class _Stop(Exception):
  pass


def test_runs_of_their_own_schedules_checkpointed_resume_bit_for_bit(problem, tmp_path):
  """Interrupted after its second chunk, a call of runs of their own schedules resumes from its checkpoint (the
  runs' carries saved as one, with a leading run axis) and ends as the uninterrupted call, bit for bit; the same
  call with one run's schedule changed is refused, naming the schedule."""
  data, sources, params = problem
  tx = optax.sgd(0.1, momentum=0.9)
  seeds = [0, 5, 9]
  whole = _together(data, tx, params, sources, seeds)
  told = []

  def stop(info):
    told.append(info["chunk"])
    if info["chunk"] == 1:
      raise _Stop

  def call(record, runs_sources=sources):
    return dj.simulate(loss_fn, tx, params[0], data, None,
                       seed=dj.Runs(seeds=seeds, sources=runs_sources, params=params),
                       sampling=dj.Sampling(batch_size=BATCH), record=record, execution=execution(sources),
                       checkpoint=dj.Checkpoint(tmp_path))

  with pytest.raises(_Stop):
    call(dj.Record(eval_fn=_record().eval_fn, every=6, callback=stop))
  assert told == [0, 1] and whole[0].stats["num_chunks"] == 3
  resumed_chunks = []
  resumed = call(dj.Record(eval_fn=_record().eval_fn, every=6, callback=lambda info: resumed_chunks.append(
      info["chunk"])))
  # Only the chunks after the last one saved were computed again.
  assert resumed_chunks == [2]
  for together, alone in zip(resumed, whole, strict=True):
    _assert_identical(together, alone)
  with pytest.raises(ValueError, match="different run: .*schedule"):
    call(_record(), runs_sources=[sources[0], sources[2], sources[1]])


def test_runs_whose_plans_choose_different_lanes_are_checkpointed_apart(problem, tmp_path):
  """Runs whose plans choose different lanes are computed by a program per lane count: each program's runs are
  checkpointed in a folder of their own, and a second call resumes them all, to the same results."""
  data, sources, params = problem
  serial = dj.runtime.schedule_from_delays(dj.delays.constant(0), 30, 0, num_workers=4)
  mixed = [sources[0], serial, sources[2]]
  kwargs = dict(sampling=dj.Sampling(batch_size=BATCH), record=_record(), checkpoint=dj.Checkpoint(tmp_path))
  first = dj.simulate(loss_fn, optax.sgd(0.1), params[0], data, None,
                      seed=dj.Runs(seeds=[0, 1, 2], sources=mixed, params=params), **kwargs)
  lanes = sorted({result.stats["lanes"] for result in first})
  assert len(lanes) == 2 and sorted(os.listdir(tmp_path)) == [f"lanes-{k}" for k in lanes]
  again = dj.simulate(loss_fn, optax.sgd(0.1), params[0], data, None,
                      seed=dj.Runs(seeds=[0, 1, 2], sources=mixed, params=params), **kwargs)
  for a, b in zip(again, first, strict=True):
    _assert_identical(a, b)
