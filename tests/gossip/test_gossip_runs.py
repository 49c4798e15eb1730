"""Several gossip runs in one call (``dj.simulate_gossip(..., seed=dj.Runs(...))``), against their single calls."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj
from delayjax.runtime import _engine, _replicas

X = np.random.default_rng(0).normal(size=(128, 4)).astype(np.float32)
DATA = {"x": X, "y": X @ np.arange(1, 5, dtype=np.float32)}


def _loss(w, batch):
  return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)


def _eval(w):
  return {"loss": _loss(w, DATA)}


def _schedules():
  """Three schedules of 4 replicas: synchronous D-PSGD, AD-PSGD, and a longer AD-PSGD run (more chunks)."""
  workers = dj.cluster.workers(4, seed=0)
  return [dj.cluster.simulate_gossip(dj.cluster.d_psgd(dj.topology.ring(4)), workers, num_steps=10, seed=0),
          dj.cluster.simulate_gossip(dj.cluster.ad_psgd(dj.topology.ring(4)), workers, num_steps=10, seed=1),
          dj.cluster.simulate_gossip(dj.cluster.ad_psgd(dj.topology.ring(4)), workers, num_steps=25, seed=2)]


TX = optax.inject_hyperparams(optax.sgd)(learning_rate=0.05, momentum=0.5)
OPTIONS = dict(sampling=dj.Sampling(batch_size=8), record=dj.Record(eval_fn=_eval, every=6),
               execution=dj.Execution(chunk_size=8))


def _assert_same_run(together, alone):
  for a, b in zip(jax.tree.leaves((together.params, together.opt_state, together.extra, together.average)),
                  jax.tree.leaves((alone.params, alone.opt_state, alone.extra, alone.average)), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for a, b in zip(jax.tree.leaves(together.history), jax.tree.leaves(alone.history), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert together.stats == alone.stats


def test_runs_of_their_own_schedules_equal_their_single_calls_bit_for_bit():
  sources = _schedules()
  seeds, rates = [3, 4, 5], [0.05, 0.02, 0.08]
  starts = [np.full(4, v, np.float32) for v in (0.0, 1.0, -1.0)]
  together = dj.simulate_gossip(_loss, TX, dj.gossip.d_psgd(), np.zeros(4, np.float32), DATA, None,
                                seed=dj.Runs(seeds=seeds, sources=sources, params=starts,
                                             hyperparams={"learning_rate": rates}), **OPTIONS)
  assert len(together) == 3
  # The longer schedule is computed in more chunks than the others: the shorter runs finish first.
  assert together[2].stats["num_chunks"] > together[0].stats["num_chunks"]
  for r in range(3):
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=rates[r], momentum=0.5)
    alone = dj.simulate_gossip(
        _loss, tx, dj.gossip.d_psgd(), starts[r], DATA, sources[r], seed=seeds[r], sampling=OPTIONS["sampling"],
        record=OPTIONS["record"], execution=dj.Execution(chunk_size=8, like=sources[:r] + sources[r + 1:]))
    _assert_same_run(together[r], alone)
  assert not np.array_equal(np.asarray(together[0].params), np.asarray(together[1].params))


def test_runs_of_one_schedule_differ_by_seed_and_equal_their_single_calls():
  schedule = _schedules()[1]
  together = dj.simulate_gossip(_loss, TX, dj.gossip.d_psgd(), np.zeros(4, np.float32), DATA, schedule,
                                seed=dj.Runs(seeds=[0, 1]), **OPTIONS)
  for seed, result in zip((0, 1), together, strict=True):
    _assert_same_run(result, dj.simulate_gossip(_loss, TX, dj.gossip.d_psgd(), np.zeros(4, np.float32), DATA,
                                                schedule, seed=seed, **OPTIONS))
  assert not np.array_equal(np.asarray(together[0].params), np.asarray(together[1].params))


@pytest.mark.parametrize("phases", [2, None])
def test_runs_of_their_own_schedules_compile_one_program_per_phase_count(phases):
  sources = _schedules()
  # Without Execution.phases each plan chooses its own (the synchronous schedule fewer than the others).
  chosen = {dj.simulate_gossip(_loss, TX, dj.gossip.d_psgd(), np.zeros(4, np.float32), DATA, s,
                               **OPTIONS).stats["phases"] for s in sources} if phases is None else {phases}
  _engine.clear_cache()
  before = _engine.cache_info()["misses"]
  dj.simulate_gossip(_loss, TX, dj.gossip.d_psgd(), np.zeros(4, np.float32), DATA, sources[0], seed=0,
                     sampling=OPTIONS["sampling"], record=OPTIONS["record"],
                     execution=dj.Execution(chunk_size=8, like=sources[1:], phases=phases or max(chosen)))
  one = _engine.cache_info()["misses"] - before
  _engine.clear_cache()
  before = _engine.cache_info()["misses"]
  dj.simulate_gossip(_loss, TX, dj.gossip.d_psgd(), np.zeros(4, np.float32), DATA, None,
                     seed=dj.Runs(seeds=[0, 1, 2], sources=sources), sampling=OPTIONS["sampling"],
                     record=OPTIONS["record"], execution=dj.Execution(chunk_size=8, phases=phases))
  # A chunk and an evaluation per program; the programs differ only in their phases.
  assert _engine.cache_info()["misses"] - before == one + (len(chosen) - 1)


def test_the_callback_is_told_each_runs_chunks_with_its_index():
  sources = _schedules()
  told = []
  record = dj.Record(eval_fn=_eval, every=6, callback=told.append)
  together = dj.simulate_gossip(_loss, TX, dj.gossip.d_psgd(), np.zeros(4, np.float32), DATA, None,
                                seed=dj.Runs(seeds=[0, 1, 2], sources=sources), sampling=OPTIONS["sampling"],
                                record=record, execution=OPTIONS["execution"])
  for r, result in enumerate(together):
    mine = [info for info in told if info["run"] == r]
    assert [info["chunk"] for info in mine] == list(range(result.stats["num_chunks"]))
    assert mine[-1]["steps_done"] == result.stats["num_steps"]
    # The chunks' losses are the run's history, in order.
    np.testing.assert_array_equal(np.concatenate([info["rows"]["loss"] for info in mine]), result.history.loss)


@pytest.mark.parametrize("change,error,match", [
    (dict(schedule="given"), ValueError, "pass schedule=None"),
    (dict(sources="bad"), TypeError, r"Runs.sources\[1\] must be a dj.cluster.GossipSchedule, got str"),
    (dict(sources="replicas"), ValueError, r"Runs.sources\[1\] has 3 replicas, but Runs.sources\[0\] has 4"),
    (dict(params="shape"), ValueError, r"Runs.params\[1\] must have params' structure"),
    (dict(hyperparams="unknown"), ValueError, r"hyperparams names \['lr'\]"),
    (dict(mesh=True), ValueError, "on one device; got Execution.mesh"),
])
def test_bad_runs_are_refused_naming_what_is_wrong(change, error, match, tmp_path):
  sources = _schedules()[:2]
  params = [np.zeros(4, np.float32), np.zeros(4, np.float32)]
  hyperparams = None
  options = dict(OPTIONS)
  schedule = None
  checkpoint = None
  if "schedule" in change:
    schedule = sources[0]
  if change.get("sources") == "bad":
    sources = [sources[0], "ring"]
  if change.get("sources") == "replicas":
    sources = [sources[0], dj.cluster.simulate_gossip(dj.cluster.d_psgd(dj.topology.ring(3)),
                                                      dj.cluster.workers(3, seed=0), num_steps=5, seed=0)]
  if "params" in change:
    params[1] = np.zeros(5, np.float32)
  if "hyperparams" in change:
    hyperparams = {"lr": [0.1, 0.2]}
  if "mesh" in change:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("workers",))
    options["execution"] = dj.Execution(chunk_size=8, mesh=mesh)
  with pytest.raises(error, match=match):
    dj.simulate_gossip(_loss, TX, dj.gossip.d_psgd(), np.zeros(4, np.float32), DATA, schedule,
                       seed=dj.Runs(seeds=[0, 1], sources=sources, params=params, hyperparams=hyperparams),
                       checkpoint=checkpoint, **options)


class _Stop(Exception):
  pass


def test_runs_checkpointed_each_on_its_own_resume_bit_for_bit(tmp_path):
  """Interrupted in its third round of chunks (the shorter runs done and saved, the longer one not), a call of three
  runs resumes each from its own checkpoint and ends as the uninterrupted call, bit for bit; a run whose arguments
  changed is refused naming what."""
  sources = _schedules()
  runs = dj.Runs(seeds=[0, 1, 2], sources=sources)
  whole = dj.simulate_gossip(_loss, TX, dj.gossip.d_psgd(), np.zeros(4, np.float32), DATA, None, seed=runs,
                             **OPTIONS)
  told = []

  def stop(info):
    told.append(info)
    if info["run"] == 2 and info["chunk"] == 2:
      raise _Stop

  options = dict(OPTIONS, record=dj.Record(eval_fn=_eval, every=6, callback=stop))
  with pytest.raises(_Stop):
    dj.simulate_gossip(_loss, TX, dj.gossip.d_psgd(), np.zeros(4, np.float32), DATA, None, seed=runs,
                       checkpoint=dj.Checkpoint(tmp_path), **options)
  assert whole[2].stats["num_chunks"] > 3 and whole[0].stats["num_chunks"] == 2
  resumed_chunks = []
  options = dict(OPTIONS, record=dj.Record(eval_fn=_eval, every=6, callback=resumed_chunks.append))
  resumed = dj.simulate_gossip(_loss, TX, dj.gossip.d_psgd(), np.zeros(4, np.float32), DATA, None, seed=runs,
                               checkpoint=dj.Checkpoint(tmp_path), **options)
  for together, alone in zip(resumed, whole, strict=True):
    _assert_same_run(together, alone)
  # Only the chunks from the interrupted round on were computed again: the shortest run had finished.
  assert sorted((info["run"], info["chunk"]) for info in resumed_chunks) == [
      (r, c) for r, result in enumerate(whole) for c in range(2, result.stats["num_chunks"])]
  with pytest.raises(ValueError, match="different run: .*schedule"):
    dj.simulate_gossip(_loss, TX, dj.gossip.d_psgd(), np.zeros(4, np.float32), DATA, None,
                       seed=dj.Runs(seeds=[0, 1, 2], sources=[sources[0], sources[2], sources[1]]),
                       checkpoint=dj.Checkpoint(tmp_path), **OPTIONS)


def _spied(monkeypatch):
  """Records, in order, each run prepared (``"prepare"``), program made (``"program"``) and compile started ahead
  (``"ahead"``), and each time a compile started ahead is waited for (``"waited"``)."""
  calls = []
  prepare, program, ahead = _replicas._prepare, _replicas._program, _engine.compile_ahead

  def spied_ahead(*args):
    started = ahead(*args)
    calls.append("ahead")

    def waited():
      calls.append("waited")
      return started.compiled()

    return started._replace(compiled=waited)

  monkeypatch.setattr(_replicas, "_prepare", lambda *a, **k: calls.append("prepare") or prepare(*a, **k))
  monkeypatch.setattr(_replicas, "_program", lambda *a: calls.append("program") or program(*a))
  monkeypatch.setattr(_engine, "compile_ahead", spied_ahead)
  return calls


def test_the_first_runs_program_compiles_while_the_others_are_prepared(monkeypatch):
  """Run 0 is prepared and its chunk's compile started before the other runs are prepared; the runs, which share
  its program, are computed by that executable, and equal their single calls bit for bit."""
  sources = _schedules()
  execution = dj.Execution(chunk_size=8, phases=2)
  calls = _spied(monkeypatch)
  together = dj.simulate_gossip(_loss, TX, dj.gossip.d_psgd(), np.zeros(4, np.float32), DATA, None,
                                seed=dj.Runs(seeds=[0, 1, 2], sources=sources), sampling=OPTIONS["sampling"],
                                record=OPTIONS["record"], execution=execution)
  # Every run takes the executable compiled ahead.
  assert calls == ["prepare", "program", "ahead", "prepare", "prepare", "program", "program"] + ["waited"] * 3
  monkeypatch.undo()
  for r in range(3):
    _assert_same_run(together[r], dj.simulate_gossip(
        _loss, TX, dj.gossip.d_psgd(), np.zeros(4, np.float32), DATA, sources[r], seed=r,
        sampling=OPTIONS["sampling"], record=OPTIONS["record"],
        execution=dj.Execution(chunk_size=8, phases=2, like=sources[:r] + sources[r + 1:])))


def test_a_chunk_compiled_ahead_from_shapes_computes_as_the_placed_call():
  """compile_ahead compiles from the shapes and dtypes the program's values take once placed: its signature is
  the one run_together finds for the placed values, and its executable computes a chunk as the jitted chunk
  function does, bit for bit. Constants whose placed dtype it cannot tell (a Python number) start nothing."""
  run = _replicas._prepare(_loss, TX, dj.gossip.d_psgd(), np.zeros(4, np.float32), DATA, _schedules()[1], seed=0,
                           sampling=OPTIONS["sampling"], record=OPTIONS["record"], checkpoint=None,
                           execution=OPTIONS["execution"])
  program = _replicas._program(run)
  assert _engine.compile_ahead(program._replace(constants={**DATA, "scale": 2.0})) is None
  # Nor for a program of several runs, which run_together refuses.
  assert _engine.compile_ahead(program._replace(runs=2)) is None
  started = _engine.compile_ahead(program)

  def placed():
    put = _engine.placer(None)
    return (_engine.place(put, program.carry_specs, program.carry),
            _engine.place(put, program.constant_specs, program.constants),
            _engine.place(_engine.table_placer(None), program.table_specs, started.tables))

  assert _engine._signature(started.chunk_fn, placed()) == started.signature
  ahead, jitted = started.compiled()(*placed()), started.chunk_fn(*placed())
  for a, b in zip(jax.tree.leaves(ahead), jax.tree.leaves(jitted), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_runs_that_do_not_fit_together_are_refused(monkeypatch):
  """Each run fits alone; three together (their replicas' states summed, the data once) do not: refused before
  anything compiles (no program is made, none compiled ahead)."""
  sources = _schedules()
  alone = dj.simulate_gossip(_loss, TX, dj.gossip.d_psgd(), np.zeros(4, np.float32), DATA, sources[0], **OPTIONS)
  # The data is held once whatever the runs; each run keeps its own replicas' state.
  state = sum(v for k, v in alone.stats["memory"].items() if k not in ("total", "data"))
  execution = dj.Execution(chunk_size=8, max_memory=alone.stats["memory"]["data"] + int(state * 1.5))
  dj.simulate_gossip(_loss, TX, dj.gossip.d_psgd(), np.zeros(4, np.float32), DATA, sources[0],
                     sampling=OPTIONS["sampling"], record=OPTIONS["record"], execution=execution)
  calls = _spied(monkeypatch)
  with pytest.raises(ValueError, match=r"dj.simulate_gossip would keep .* more than .* \(Execution.max_memory\)"):
    dj.simulate_gossip(_loss, TX, dj.gossip.d_psgd(), np.zeros(4, np.float32), DATA, None,
                       seed=dj.Runs(seeds=[0, 1, 2], sources=sources), sampling=OPTIONS["sampling"],
                       record=OPTIONS["record"], execution=execution)
  assert calls == ["prepare"] * 3
