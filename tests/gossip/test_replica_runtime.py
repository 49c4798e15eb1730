"""``dj.simulate_gossip``: devices, restarts, history, non-finite reports and argument checks."""

from __future__ import annotations

import os
import sys

import jax
import numpy as np
import optax
import pytest

import delayjax as dj
from delayjax.cluster import GossipSchedule

sys.path.insert(0, os.path.dirname(__file__))
import gossip_reference  # noqa: E402
from method_reference import flat, grad, random_schedule, regression  # noqa: E402

LR, BETA, BATCH = 0.05, 0.5, 4


def _run(schedule, method=None, **kw):
  data, loss_fn, params = regression()
  return dj.simulate_gossip(loss_fn, optax.sgd(LR, momentum=BETA), method or dj.gossip.d_psgd(), params, data,
                            schedule, sampling=dj.Sampling(batch_size=BATCH), **kw)


def _equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


PARADIGMS = {
    "allreduce": (lambda m: dj.cluster.allreduce(), dj.gossip.d_psgd, None),
    # A ring: fixed offsets -1, 0, +1, moved by lax.ppermute on a mesh.
    "d_psgd_ring_failures": (lambda m: dj.cluster.d_psgd(dj.topology.ring(m)), dj.gossip.d_psgd,
                             lambda: dj.cluster.failures(drop=0.3)),
    "ad_psgd": (lambda m: dj.cluster.ad_psgd(), dj.gossip.ad_psgd, None),
    # Averaging while the gradient computes: other events fall between a mix and its initiator's apply.
    "ad_psgd_read": (lambda m: dj.cluster.ad_psgd(average="read"), dj.gossip.ad_psgd, None),
    # Arbitrary partners and late messages: the all-gather fallback.
    "sgp_overlap": (lambda m: dj.cluster.sgp(overlap=2), dj.gossip.sgp, None),
    "gossipgrad": (lambda m: dj.cluster.gossipgrad(seed=0), dj.gossip.gossip_grad, None),
}


@pytest.mark.fast_compile
@pytest.mark.parametrize("name", list(PARADIGMS))
def test_paradigm_matches_the_sequential_reference(name):
  paradigm, method, failures = PARADIGMS[name]
  m = 8
  workers = dj.cluster.workers(m, compute="exponential", speed=[1.0] * (m - 1) + [0.25], seed=0)
  schedule = dj.cluster.simulate_gossip(paradigm(m), workers, num_steps=4, seed=1,
                                        failures=None if failures is None else failures())
  data, loss_fn, params = regression()
  result = _run(schedule, method())

  def grad_fn(z, replica, batch_index):
    idx = np.asarray(dj.runtime.minibatch_indices(0, 0, replica, batch_index, num_examples=40, batch_size=BATCH))
    return grad(z, data, idx)

  push_sum = name.startswith("sgp")
  ref = gossip_reference.run(schedule, grad_fn, flat(params), lr=LR, momentum=BETA, push_sum=push_sum)
  np.testing.assert_allclose(_stacked(result.params), ref["x"], rtol=2e-5, atol=2e-6)
  if push_sum:
    np.testing.assert_allclose(np.asarray(result.extra.weight), ref["w"], rtol=1e-6)
  # History: the consensus distance after the last step, events and gradients done.
  z = ref["x"] / ref["w"][:, None] if push_sum else ref["x"]
  want = np.mean(np.sum((z - z.mean(axis=0)) ** 2, axis=1))
  np.testing.assert_allclose(result.history.consensus[-1], want, rtol=1e-3, atol=1e-9)
  assert result.history.events[-1] == schedule.num_events
  assert result.history.gradients[-1] == schedule.num_gradients



def test_runs_of_one_program_compile_once():
  """Another seed reuses the compiled chunk and gives the sequential reference's numbers and a fresh compile's
  bits; another learning rate is another program."""
  from delayjax.runtime import _engine as engine

  m = 8
  workers = dj.cluster.workers(m, compute="exponential", speed=[1.0] * (m - 1) + [0.25], seed=0)
  schedule = dj.cluster.simulate_gossip(dj.cluster.ad_psgd(), workers, num_steps=4, seed=1)
  data, loss_fn, params = regression()
  engine.clear_cache()
  _run(schedule, dj.gossip.ad_psgd(), seed=0)
  hits = engine.cache_info()["hits"]
  cached = _run(schedule, dj.gossip.ad_psgd(), seed=3)
  # The chunk (AD-PSGD's models are its parameters themselves: no program of their own).
  assert engine.cache_info()["hits"] == hits + 1

  def grad_fn(z, replica, batch_index):
    idx = np.asarray(dj.runtime.minibatch_indices(3, 0, replica, batch_index, num_examples=40, batch_size=BATCH))
    return grad(z, data, idx)

  ref = gossip_reference.run(schedule, grad_fn, flat(params), lr=LR, momentum=BETA, push_sum=False)
  np.testing.assert_allclose(_stacked(cached.params), ref["x"], rtol=2e-5, atol=2e-6)
  engine.clear_cache()
  fresh = _run(schedule, dj.gossip.ad_psgd(), seed=3)
  _equal((cached.params, cached.opt_state, cached.history.loss), (fresh.params, fresh.opt_state, fresh.history.loss))
  misses = engine.cache_info()["misses"]
  dj.simulate_gossip(loss_fn, optax.sgd(2 * LR, momentum=BETA), dj.gossip.ad_psgd(), params, data, schedule,
                     sampling=dj.Sampling(batch_size=BATCH), seed=3)
  assert engine.cache_info()["misses"] == misses + 1


def test_an_evaluation_that_calls_back_into_python_leaves_the_chunk_cached():
  """The chunk program only keeps the models the evaluations read: an eval_fn that calls back into Python (whose
  own program is compiled afresh every run) does not keep a second run from reusing the chunk, and its numbers
  are those of the same evaluation without the callback."""
  from delayjax.runtime import _engine as engine

  m = 8
  workers = dj.cluster.workers(m, compute="exponential", speed=[1.0] * (m - 1) + [0.25], seed=0)
  schedule = dj.cluster.simulate_gossip(dj.cluster.ad_psgd(), workers, num_steps=4, seed=1)
  data, loss_fn, params = regression()

  def total(p):
    return jax.tree.leaves(p)[0].sum()

  def called_back(p):
    value = total(p)
    return {"total": jax.pure_callback(np.asarray, jax.ShapeDtypeStruct(value.shape, value.dtype), value,
                                       vmap_method="sequential")}

  def run(evaluate):
    return dj.simulate_gossip(loss_fn, optax.sgd(LR, momentum=BETA), dj.gossip.ad_psgd(), params, data, schedule,
                              sampling=dj.Sampling(batch_size=BATCH), seed=0,
                              record=dj.Record(eval_fn=evaluate, every=2))

  engine.clear_cache()
  first = run(called_back)
  hits, misses = engine.cache_info()["hits"], engine.cache_info()["misses"]
  again = run(called_back)
  assert (engine.cache_info()["hits"], engine.cache_info()["misses"]) == (hits + 1, misses)
  plain = run(lambda p: {"total": total(p)})
  _equal((first.history.eval_metrics, first.history.replica_metrics),
         (again.history.eval_metrics, again.history.replica_metrics))
  _equal((first.history.eval_metrics, first.history.replica_metrics),
         (plain.history.eval_metrics, plain.history.replica_metrics))


def test_a_rule_takes_its_gradients_at_its_parameters_only_when_its_program_returns_them():
  """The runtime skips the program of the replicas' final models where ``grad_params`` returns the parameters
  themselves (D-PSGD, AD-PSGD), and only there."""
  from delayjax.runtime import _replicas

  def _models_returned_params(fn, params, extra):
    return _replicas._models_like(fn, params, extra)[1]

  params = {"b": np.zeros(3, np.float32), "w": np.zeros((2, 3), np.float32)}
  assert _models_returned_params(dj.gossip.d_psgd().grad_params, params, ())
  assert _models_returned_params(dj.gossip.ad_psgd().grad_params, params, ())
  sgp = dj.gossip.sgp()
  assert not _models_returned_params(sgp.grad_params, params, sgp.init(params))
  assert not _models_returned_params(lambda p, e: jax.tree.map(lambda x: x + 0, p), params, ())
  # Its leaves in another order, or the extra state in their place, are not the parameters.
  assert not _models_returned_params(lambda p, e: {"b": p["w"], "w": p["b"]}, params, ())
  assert not _models_returned_params(lambda p, e: e, params, {"b": params["b"], "w": params["w"]})


def _halfway(params, extra, mixed, self_weight, dt):
  del self_weight, dt
  return jax.tree.map(lambda p, q: 0.5 * (p + q), params, mixed), extra


def _advance_by_dt(params, extra, dt):
  return jax.tree.map(lambda p: p * (1.0 - 0.01 * dt), params), extra


def _damped_grad_params(params, extra):
  del extra
  return jax.tree.map(lambda p: 0.5 * p, params)


@pytest.mark.fast_compile
@pytest.mark.parametrize("change", ["receive", "advance", "grad_params", "loss constant", "eval constant"])
def test_a_run_that_changes_any_part_of_the_step_compiles_its_own_program(change):
  """The compile cache's keys name every part of the programs they are built from: a run of the same shapes and
  plan whose method's ``receive``, ``advance`` or ``grad_params``, or whose loss or evaluation closes over
  another array value, misses the cache and gives its own numbers (the first run's program would give the first
  run's)."""
  from delayjax.runtime import _engine as engine

  m = 8
  workers = dj.cluster.workers(m, compute="exponential", speed=[1.0] * (m - 1) + [0.25], seed=0)
  schedule = dj.cluster.simulate_gossip(dj.cluster.d_psgd(dj.topology.ring(m)), workers, num_steps=4, seed=1)
  data, loss_fn, params = regression()
  base = dj.gossip.d_psgd()

  def run(method, scale, shift):
    def scaled_loss(p, batch):
      return loss_fn(p, batch) * scale

    def evaluate(p):
      return {"shifted": jax.tree.leaves(p)[0].sum() + shift}

    return dj.simulate_gossip(scaled_loss, optax.sgd(LR, momentum=BETA), method, params, data, schedule,
                              sampling=dj.Sampling(batch_size=BATCH), seed=0,
                              record=dj.Record(eval_fn=evaluate, every=2))

  one, zero = jax.numpy.float32(1.0), np.float32(0.0)
  changed = {"receive": (base._replace(receive=_halfway), one, zero),
             "advance": (base._replace(advance=_advance_by_dt), one, zero),
             "grad_params": (base._replace(grad_params=_damped_grad_params), one, zero),
             "loss constant": (base, jax.numpy.float32(3.0), zero),
             "eval constant": (base, one, np.float32(7.0))}[change]
  engine.clear_cache()
  first = run(base, one, zero)
  misses = engine.cache_info()["misses"]
  again = run(*changed)
  # A changed evaluation is another program of the evaluations alone (the chunk only keeps the models they read);
  # a changed grad_params also another program of the replicas' final models, and its compile.
  assert engine.cache_info()["misses"] == misses + {"grad_params": 3}.get(change, 1)
  engine.clear_cache()
  fresh = run(*changed)
  _equal((again.params, again.history.eval_metrics), (fresh.params, fresh.history.eval_metrics))
  before, after = ((r.params, r.history.eval_metrics) for r in (first, again))
  assert any(not np.array_equal(np.asarray(x), np.asarray(y))
             for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after)))


@pytest.mark.fast_compile
def test_schedules_given_as_like_share_one_program_and_each_matches_the_reference():
  """Four paradigms, whose own plans differ (gradient mixes on all 8 replicas, fixed ring offsets, random pairs,
  an 8-member exponential graph), each run with the others as ``like``: one compiled chunk for the four, and each
  run is still its schedule's sequential reference."""
  from delayjax.runtime import _engine as engine

  m = 8
  workers = dj.cluster.workers(m, compute="exponential", speed=[1.0] * (m - 1) + [0.25], seed=0)
  paradigms = [dj.cluster.allreduce(), dj.cluster.d_psgd(dj.topology.ring(m)), dj.cluster.ad_psgd(),
               dj.cluster.d_psgd(dj.topology.exponential(m))]
  schedules = [dj.cluster.simulate_gossip(p, workers, num_steps=4, seed=1) for p in paradigms]
  assert len({(r.stats["mixing"], r.stats["lanes"]) for r in (_run(s, execution=dj.Execution(phases=2))
                                                               for s in schedules)}) > 1
  data, loss_fn, params = regression()

  def grad_fn(z, replica, batch_index):
    idx = np.asarray(dj.runtime.minibatch_indices(0, 0, replica, batch_index, num_examples=40, batch_size=BATCH))
    return grad(z, data, idx)

  engine.clear_cache()
  for i, schedule in enumerate(schedules):
    result = _run(schedule, execution=dj.Execution(phases=2, like=[s for s in schedules if s is not schedule]))
    if i == 0:
      misses = engine.cache_info()["misses"]
    assert (result.stats["mixing"], result.stats["lanes"], result.stats["slots"]) == ("gather", m, 3)
    ref = gossip_reference.run(schedule, grad_fn, flat(params), lr=LR, momentum=BETA)
    np.testing.assert_allclose(_stacked(result.params), ref["x"], rtol=2e-5, atol=2e-6)
    assert result.history.events[-1] == schedule.num_events
  assert engine.cache_info()["misses"] == misses


def test_mixes_of_parameters_and_of_gradients_each_take_their_narrowest_form():
  """All-reduce of gradients (every receiver takes 16 weights: dense) shares a program with gossip of parameters
  (a ring's mix of all 16 replicas gives each receiver 3 nonzero weights, AD-PSGD's pairs 2): the parameter mixes
  are gathered 3 wide, not applied as a dense [16, 16] matrix, and every run still matches its schedule's
  sequential reference."""
  from delayjax.runtime._replica_plan import MixForm, make_plan

  m = 16
  workers = dj.cluster.workers(m, compute="exponential", speed=[1.0] * (m - 1) + [0.25], seed=0)
  paradigms = [dj.cluster.allreduce(), dj.cluster.d_psgd(dj.topology.ring(m)), dj.cluster.ad_psgd()]
  methods = [dj.gossip.d_psgd, dj.gossip.d_psgd, dj.gossip.ad_psgd]
  schedules = [dj.cluster.simulate_gossip(p, workers, num_steps=3, seed=1) for p in paradigms]
  allreduce, ring, pairs = schedules
  # Alone: the ring by rolls at its three offsets, the all-reduce's gradients densely, the pairs gathered.
  assert make_plan(ring).forms["mix"] == MixForm("shift", (0, 1, m - 1), 3)
  assert make_plan(allreduce).forms["gmix"] == MixForm("dense", (), m)
  assert make_plan(pairs).forms["mix"] == MixForm("gather", (), 2)
  data, loss_fn, params = regression()

  def grad_fn(z, replica, batch_index):
    idx = np.asarray(dj.runtime.minibatch_indices(0, 0, replica, batch_index, num_examples=40, batch_size=BATCH))
    return grad(z, data, idx)

  for schedule, method in zip(schedules, methods, strict=True):
    like = tuple(s for s in schedules if s is not schedule)
    plan = make_plan(schedule, like=like)
    assert plan.forms == {"mix": MixForm("gather", (), 3), "gmix": MixForm("dense", (), m)}
    result = _run(schedule, method(), execution=dj.Execution(like=like))
    assert (result.stats["mixing"], result.stats["gradient_mixing"]) == ("gather", "dense")
    ref = gossip_reference.run(schedule, grad_fn, flat(params), lr=LR, momentum=BETA)
    np.testing.assert_allclose(_stacked(result.params), ref["x"], rtol=2e-5, atol=2e-6)


# One mixing path each: 1 device and 8 devices must agree bit for bit (plain sgd: nothing but the mixes
# and the gradient steps between them). Exponential graph: more than four offsets, the all-gather path;
# SGP with a 2-step overlap: late messages, gathered with every replica's kept past messages. (The dense path,
# mixes in which a receiver takes more than 8 weights, adds its terms the same way: see the next test.)
MESH_CASES = {
    "shift": (lambda: dj.cluster.d_psgd(dj.topology.ring(8)), 8, dj.gossip.d_psgd, lambda: dj.cluster.failures(0.3)),
    "gather": (lambda: dj.cluster.d_psgd(dj.topology.exponential(8)), 8, dj.gossip.d_psgd, lambda: None),
    "gather_late_push_sum": (lambda: dj.cluster.sgp(overlap=2), 8, dj.gossip.sgp, lambda: None),
}


@pytest.mark.parametrize("mixing", list(MESH_CASES))
def test_one_device_and_a_mesh_agree_bit_for_bit(mixing):
  paradigm, m, method, failures = MESH_CASES[mixing]
  workers = dj.cluster.workers(m, compute="exponential", speed=[1.0] * (m - 1) + [0.25], seed=0)
  schedule = dj.cluster.simulate_gossip(paradigm(), workers, num_steps=8, seed=1, failures=failures())
  data, loss_fn, params = regression()
  runs = [dj.simulate_gossip(loss_fn, optax.sgd(LR), method(), params, data, schedule,
                             sampling=dj.Sampling(batch_size=BATCH), execution=dj.Execution(mesh=mesh))
          for mesh in (None, jax.make_mesh((8,), ("workers",)))]
  one, eight = runs
  assert one.stats["mixing"] == eight.stats["mixing"] == mixing.split("_")[0]
  assert eight.stats["num_devices"] == 8 and one.stats["num_steps"] >= 6
  _equal((one.params, one.extra, one.opt_state), (eight.params, eight.extra, eight.opt_state))
  # Each device count plans its own steps; the final consensus distance is summed over devices (psum) on the
  # mesh rather than over one array: equal up to rounding.
  np.testing.assert_allclose(one.history.consensus[-1], eight.history.consensus[-1], rtol=1e-6)


def _numpy_mix(weight, sources):
  """Rows ``sum_k weight[:, k] * sources[k]`` in float32, every product rounded, added in ``k`` order."""
  acc = None
  for k, source in enumerate(sources):
    term = weight[:, k, None] * source
    acc = term if acc is None else acc + term
  return acc


def test_mix_adds_rounded_products_in_order_on_any_device_count():
  # The sums a CPU compiler would fuse into multiply-adds (or a matrix product), rounding differently per
  # shape, must be the plain float32 sums on one device and on every device of a mesh alike: by offsets (a
  # roll, ppermute on the mesh) and by a dense [M, M] matrix over all the replicas (gathered on the mesh).
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from delayjax.runtime._replicas import _dense_sum, _ordered_sum, _products_sum, _roll
  rows, cols = 8, 37
  rng = np.random.default_rng(0)
  x = rng.normal(size=(rows, cols)).astype(np.float32)
  shift_weight = rng.uniform(size=(rows, 3)).astype(np.float32)
  dense_weight = rng.uniform(size=(rows, rows)).astype(np.float32)
  shifts = (0, 1, rows - 1)

  def mix(x, shift_weight, dense_weight, num_devices):
    sharded = num_devices > 1
    full = jax.lax.all_gather(x, "workers", axis=0, tiled=True) if sharded else x
    # A dense mix both ways: all the products at once (small models) and in a loop (large ones).
    return (_products_sum(shift_weight, lambda k: _roll(x, shifts[k], rows, num_devices, sharded), len(shifts)),
            _ordered_sum(dense_weight, lambda k: full[k][None], rows),
            _dense_sum(dense_weight, full))

  mesh = jax.make_mesh((8,), ("workers",))
  on_mesh = jax.jit(jax.shard_map(lambda *a: mix(*a, 8), mesh=mesh, in_specs=P("workers"), out_specs=P("workers")))
  want = (_numpy_mix(shift_weight, [np.roll(x, -s, axis=0) for s in shifts]), _numpy_mix(dense_weight, x[:, None]),
          _numpy_mix(dense_weight, x[:, None]))
  spread = NamedSharding(mesh, P("workers"))
  for got in (jax.jit(lambda *a: mix(*a, 1))(x, shift_weight, dense_weight),
              on_mesh(*(jax.device_put(a, spread) for a in (x, shift_weight, dense_weight)))):
    for g, w in zip(got, want, strict=True):
      np.testing.assert_array_equal(np.asarray(g), w)


def _stacked(params):
  return np.concatenate([np.asarray(params["w"], np.float64), np.asarray(params["b"], np.float64)[:, None]], axis=1)


def test_resume_is_bit_identical(tmp_path):
  schedule = random_schedule(4, 70, seed=2, group=2)
  full = _run(schedule, execution=dj.Execution(chunk_size=3))

  def stop_after_two(info):
    if info["chunk"] == 1:
      raise KeyboardInterrupt

  with pytest.raises(KeyboardInterrupt):
    _run(schedule, execution=dj.Execution(chunk_size=3), checkpoint=dj.Checkpoint(tmp_path),
         record=dj.Record(callback=stop_after_two))
  resumed = _run(schedule, execution=dj.Execution(chunk_size=3), checkpoint=dj.Checkpoint(tmp_path))
  _equal((full.params, full.opt_state), (resumed.params, resumed.opt_state))
  np.testing.assert_array_equal(full.history.loss, resumed.history.loss)
  np.testing.assert_array_equal(full.history.consensus, resumed.history.consensus)
  with pytest.raises(ValueError, match="different run: .*schedule"):
    _run(random_schedule(4, 70, seed=3, group=2), execution=dj.Execution(chunk_size=3),
         checkpoint=dj.Checkpoint(tmp_path))
  # Another learning rate is another run, unless named as a knowing change (then the finished
  # checkpoint is continued: nothing is left to run).
  data, loss_fn, params = regression()
  other = dict(loss_fn=loss_fn, tx=optax.sgd(0.5, momentum=BETA), method=dj.gossip.d_psgd(), params=params,
               data=data, schedule=schedule, sampling=dj.Sampling(batch_size=BATCH),
               execution=dj.Execution(chunk_size=3), checkpoint=dj.Checkpoint(tmp_path))
  with pytest.raises(ValueError, match="different run: tx differ"):
    dj.simulate_gossip(**other)
  again = dj.simulate_gossip(**dict(other, checkpoint=dj.Checkpoint(tmp_path, changes=("tx",))))
  _equal((again.params, again.opt_state), (resumed.params, resumed.opt_state))


def test_complete_graph_full_averaging_is_all_reduce_sgd():
  # Rounds READ, GRAD, MIX with W = 1/M on all replicas: x <- mean_i (x - lr g_i(x)) = x - lr mean_i g_i(x).
  m, rounds = 4, 5
  rows = []
  for r in range(rounds):
    rows += [(3.0 * r, 0, i) for i in range(m)] + [(3.0 * r + 1, 1, i) for i in range(m)] + [(3.0 * r + 2, 2, -1)]
  kind = np.array([x[1] for x in rows], np.int8)
  k = rounds
  schedule = GossipSchedule(
      num_workers=m, time=[x[0] for x in rows], kind=kind, worker=np.array([x[2] for x in rows]),
      num_batches=np.where(kind == 2, 0, 1), mix=np.where(kind == 2, np.cumsum(kind == 2) - 1, -1),
      members=np.tile(np.arange(m), (k, 1)), weights=np.full((k, m, m), 1.0 / m), lag=np.zeros((k, m), np.int64),
      receives=np.ones((k, m), bool), mixes=np.zeros(k, np.int8))
  data, loss_fn, params = regression()
  result = dj.simulate_gossip(loss_fn, optax.sgd(LR), dj.gossip.d_psgd(), params, data, schedule,
                              sampling=dj.Sampling(batch_size=BATCH),
                              record=dj.Record(eval_fn=lambda p: {"loss": loss_fn(p, data)}, every=8))
  theta = flat(params)
  from method_reference import grad
  for r in range(rounds):
    gs = [grad(theta, data, np.asarray(dj.runtime.minibatch_indices(0, 0, i, r, num_examples=40,
                                                                     batch_size=BATCH))) for i in range(m)]
    theta = theta - LR * np.mean(gs, axis=0)
  for i in range(m):
    np.testing.assert_allclose(flat(jax.tree.map(lambda x: x[i], result.params)), theta, rtol=1e-5, atol=1e-6)
  # Full averaging leaves no disagreement; evaluations at 0, 8, 16 and 20 gradients, of the average model.
  np.testing.assert_allclose(result.history.consensus, 0.0, atol=1e-10)
  np.testing.assert_array_equal(result.history.eval_gradients, [0, 8, 16, 20])
  x = np.asarray(data["x"], np.float64)
  want = np.mean((x @ theta[:-1] + theta[-1] - np.asarray(data["y"], np.float64)) ** 2)
  np.testing.assert_allclose(result.history.eval_metrics["loss"][-1], want, rtol=1e-5)
  assert result.history.replica_metrics["loss"].shape == (4, m)


def test_nonfinite_gradients_are_reported():
  schedule = random_schedule(4, 40, seed=1, group=2)
  data, loss_fn, params = regression()
  data = dict(data, y=data["y"].copy())
  data["y"][::2] = np.inf
  # Zero updates keep every model finite, so a gradient is non-finite iff its minibatch has an even example.
  with pytest.warns(RuntimeWarning, match="gradients were not finite"):
    result = dj.simulate_gossip(loss_fn, optax.set_to_zero(), dj.gossip.d_psgd(), params, data, schedule,
                                sampling=dj.Sampling(batch_size=2))
  reads = np.zeros(4, int)
  want = []
  for e in range(schedule.num_events):
    if schedule.kind[e] == 0:
      i = int(schedule.worker[e])
      idx = np.asarray(dj.runtime.minibatch_indices(0, 0, i, int(schedule.batch_index()[e]),
                                                    num_examples=40, batch_size=2))
      later = np.any((schedule.kind[e + 1:] == 1) & (schedule.worker[e + 1:] == i))
      if np.any(idx % 2 == 0) and later:
        want.append((i, reads[i]))
      reads[i] += 1
  assert len(want) > 0
  np.testing.assert_array_equal(result.history.nonfinite, sorted(want))
  assert result.history.nonfinite_state is None
  # Applied, a non-finite gradient spoils the state: the chunk where it happened is named.
  with pytest.warns(RuntimeWarning, match="became non-finite between"):
    spoiled = dj.simulate_gossip(loss_fn, optax.sgd(LR), dj.gossip.d_psgd(), params, data, schedule,
                                 sampling=dj.Sampling(batch_size=2), execution=dj.Execution(chunk_size=4))
  first, last = spoiled.history.nonfinite_state
  assert 0 <= first <= last < schedule.num_events
  assert not np.all(np.isfinite(np.asarray(spoiled.params["w"])))


def test_bad_arguments_name_themselves():
  schedule = random_schedule(4, 20, seed=0)
  data, loss_fn, params = regression()
  tx = optax.sgd(0.1)
  with pytest.raises(TypeError, match="method"):
    dj.simulate_gossip(loss_fn, tx, "d_psgd", params, data, schedule)
  with pytest.raises(TypeError, match="schedule"):
    dj.simulate_gossip(loss_fn, tx, dj.gossip.d_psgd(), params, data, None)
  with pytest.raises(ValueError, match="batch_size"):
    dj.simulate_gossip(loss_fn, tx, dj.gossip.d_psgd(), params, data, schedule, sampling=dj.Sampling(batch_size=0))
  with pytest.raises(ValueError, match="split evenly"):
    dj.simulate_gossip(loss_fn, tx, dj.gossip.d_psgd(), params, data, schedule,
                       execution=dj.Execution(mesh=jax.make_mesh((8,), ("workers",))))
  with pytest.raises(ValueError, match="mixes gradients"):
    dj.simulate_gossip(loss_fn, tx, dj.gossip.gossip_grad(), params, data, schedule)
  # Late messages are gathered with the kept past messages: a receiver taking more than 8 weights is refused.
  with pytest.raises(ValueError, match="a replica takes more than 8 nonzero weights are not supported with late "
                                       "messages .*largest group has 10 members"):
    dj.simulate_gossip(loss_fn, tx, dj.gossip.sgp(), params, data,
                       random_schedule(12, 80, seed=0, group=10, lag=2, push_sum=True))
  with pytest.raises(TypeError, match="Execution.like must be a list or tuple of schedules .*, got "
                                      "GossipSchedule"):
    dj.simulate_gossip(loss_fn, tx, dj.gossip.d_psgd(), params, data, schedule,
                       execution=dj.Execution(like=schedule))
  with pytest.raises(TypeError, match="Execution.like\\[1\\] must be a dj.cluster.GossipSchedule, got str"):
    dj.simulate_gossip(loss_fn, tx, dj.gossip.d_psgd(), params, data, schedule,
                       execution=dj.Execution(like=[schedule, "ring"]))
  with pytest.raises(ValueError, match="Execution.like\\[0\\] has 6 replicas, but schedule has 4"):
    dj.simulate_gossip(loss_fn, tx, dj.gossip.d_psgd(), params, data, schedule,
                       execution=dj.Execution(like=[random_schedule(6, 20, seed=0)]))
  # dj.simulate's like is of server schedules: a gossip schedule is refused by type.
  with pytest.raises(TypeError, match="Execution.like\\[0\\] must be a dj.cluster.Schedule, got GossipSchedule"):
    dj.simulate(lambda w, b: (w * w).sum(), optax.sgd(0.1), np.zeros(2, np.float32), {"x": np.zeros((4, 1))},
                dj.delays.constant(0), num_updates=1, execution=dj.Execution(like=[schedule]))
  # The same standard as dj.simulate: seeds in [0, 2**32), bools that are bools, a writable checkpoint directory,
  # options that are option objects. The options are made inside the check: each is checked when it is made.
  cases = [(lambda: dict(seed=-1), ValueError, "seed must be an integer >= 0, got -1"),
           (lambda: dict(seed=2**32), ValueError, "seed must be an integer below 2\\*\\*32"),
           (lambda: dict(checkpoint=dj.Checkpoint("unused", resume="False")), TypeError,
            "Checkpoint.resume must be a bool, got str 'False'"),
           (lambda: dict(record=5), TypeError, "record must be a dj.Record"),
           (lambda: dict(checkpoint=dj.Checkpoint(3)), TypeError, "Checkpoint.directory must be a path"),
           (lambda: dict(execution=dj.Execution(phases=0)), ValueError,
            "Execution.phases must be an integer >= 1, got 0"),
           (lambda: dict(record=dj.Record(eval_fn=3)), TypeError, "Record.eval_fn must be callable or None, got int"),
           (lambda: dict(sampling=dj.Sampling(41, scheme="epoch")), ValueError,
            "batch_size=41 is larger than the data set")]
  for kwargs, error, message in cases:
    with pytest.raises(error, match=message):
      dj.simulate_gossip(loss_fn, tx, dj.gossip.d_psgd(), params, data, schedule, **kwargs())




def _evaluate(params):
  return {"norm": sum(jax.numpy.sum(x ** 2) for x in jax.tree.leaves(params)), "b": params["b"]}


def test_evaluations_are_the_same_whatever_the_chunks_and_on_resume(tmp_path):
  """A flagged step keeps its models in a snapshot slot of its chunk, evaluated after the chunk by the program
  that evaluates the initial models: the evaluations are the same bit for bit whatever the chunks' length, and
  on a resumed run; the last is the final models' (push-sum's x / w, the replicas' mean within float32)."""
  schedule = random_schedule(4, 70, seed=2, group=2, push_sum=True)
  record = dj.Record(eval_fn=_evaluate, every=3)
  runs = {size: _run(schedule, dj.gossip.sgp(), record=record, execution=dj.Execution(chunk_size=size))
          for size in (None, 1, 7)}
  base = runs[None]
  assert len(base.history.eval_gradients) > base.stats["num_chunks"] + 2
  for other in (runs[1], runs[7]):
    _equal((base.history.eval_metrics, base.history.replica_metrics, base.history.eval_gradients),
           (other.history.eval_metrics, other.history.replica_metrics, other.history.eval_gradients))
  z = jax.vmap(dj.gossip.sgp().grad_params)(base.params, base.extra)
  for name, want in (("norm", lambda p: sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree.leaves(p))),
                     ("b", lambda p: p["b"])):
    replicas = [want(jax.tree.map(lambda x, i=i: x[i], z)) for i in range(4)]
    np.testing.assert_allclose(base.history.replica_metrics[name][-1], replicas, rtol=1e-5)
    np.testing.assert_allclose(base.history.eval_metrics[name][-1], want(base.average), rtol=1e-5)
  # Before any step every replica holds params: the average's metrics and each replica's.
  data, loss_fn, params = regression()
  assert base.history.eval_metrics["norm"][0] == base.history.replica_metrics["norm"][0, 0] == np.float32(
      params["b"] ** 2 + np.sum(params["w"] ** 2))

  def stop_after_two(info):
    if info["chunk"] == 1:
      raise KeyboardInterrupt

  with pytest.raises(KeyboardInterrupt):
    _run(schedule, dj.gossip.sgp(), execution=dj.Execution(chunk_size=7), checkpoint=dj.Checkpoint(tmp_path),
         record=dj.Record(eval_fn=_evaluate, every=3, callback=stop_after_two))
  resumed = _run(schedule, dj.gossip.sgp(), record=record, execution=dj.Execution(chunk_size=7),
                 checkpoint=dj.Checkpoint(tmp_path))
  _equal((base.history.eval_metrics, base.history.replica_metrics), (resumed.history.eval_metrics,
                                                                     resumed.history.replica_metrics))


def test_a_chunk_holds_no_more_evaluations_than_its_snapshot_slots():
  """The slots bound every chunk's evaluations from the sizes alone (an independent count over random
  gradient counts per step), and a large model evaluated often runs in chunks whose snapshots fit the budget."""
  from delayjax.runtime import _replicas

  rng = np.random.default_rng(0)
  for _ in range(200):
    length, per_step, every = int(rng.integers(1, 40)), int(rng.integers(1, 9)), int(rng.integers(1, 30))
    steps = length * int(rng.integers(1, 5))
    done = np.cumsum(rng.integers(0, per_step + 1, steps))
    flags = done // every > np.r_[0, done[:-1]] // every
    flags[-1] = True
    most = max(int(flags[c:c + length].sum()) for c in range(0, steps, length))
    assert most <= _replicas._snapshot_slots(length, per_step, every)
  assert _replicas._snapshot_slots(64, 8, None) == 1
  params = {"w": np.zeros(200_000, np.float32)}
  length = _replicas._snapshot_chunk_limit(params, 8, 8, 1)
  # Every step evaluated: a slot per step, each 9 models of 0.8 MB, within 64 MiB.
  assert length == 8 and 8 * 9 * 800_000 <= 64 << 20 < 16 * 9 * 800_000
  assert _replicas._snapshot_chunk_limit({"w": np.zeros(10, np.float32)}, 8, 8, 1) == 4096


def test_the_evaluation_snapshots_count_in_a_runs_memory():
  """A run's evaluation snapshots are a term of its memory, refused (naming what shrinks it) where they would
  not fit."""
  schedule = random_schedule(4, 70, seed=2, group=2)
  bare = _run(schedule, execution=dj.Execution(chunk_size=64))
  evaluated = _run(schedule, record=dj.Record(eval_fn=_evaluate, every=1), execution=dj.Execution(chunk_size=64))
  memory = evaluated.stats["memory"]
  # A slot per step of the chunk, each the average model and the 4 replicas' (4 float32 entries each).
  assert memory["evaluation snapshots"] == 64 * 4 * 4 * 4 and memory["evaluation snapshots (average)"] == 64 * 4 * 4
  assert bare.stats["memory"]["evaluation snapshots"] == 0
  with pytest.raises(ValueError, match="evaluation snapshots.*evaluations less often"):
    _run(schedule, record=dj.Record(eval_fn=_evaluate, every=1),
         execution=dj.Execution(chunk_size=64, max_memory=bare.stats["memory"]["total"] + 100))
