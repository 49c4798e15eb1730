"""dj.delayed and the transformations on sharded parameters: 8 CPU devices, a (data=2, model=4) mesh.

The parameters are sharded FSDP-style on the ``data`` axis and tensor-parallel on the ``model`` axis. Every
buffer the state keeps per parameter (dj.delayed's gradient and parameter rings, its schedule replay's, per-worker
tables, SAGA's per-sample table, the inner optimizer's moments) must keep its parameter's partition, a leading ring
or row axis unsharded; the compiled update must gather nothing (no all-gather, no all-to-all in its HLO); and the
numbers must be those of the same run on one device, bit for bit: the operations are elementwise per parameter, so
the partition cannot change a result (the test asserts equality, not closeness), but for the few cases in
``ROUNDED`` (a reduction across devices, or a division the compiler rewrites in one program only).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import delayjax as dj

# optax.adam's bias correction mixes float and int32; the programs compile without backend optimization (as
# tests/transforms' do), which halves the test's time and does not touch the comparison: both runs compile so.
# With XLA's CPU fusion emitters, though: without them (as with backend optimization) five of the sharded
# programs round differently from their one-device twins (by about 1e-9).
pytestmark = [pytest.mark.standard_promotion, pytest.mark.fast_compile(fusion_emitters=True)]

SPECS = {"embed": P("data", None), "w_in": P("data", "model"), "w_out": P("model", "data"), "bias": P("model")}
SHAPES = {"embed": (24, 8), "w_in": (8, 16), "w_out": (16, 8), "bias": (16,)}
STEPS = 7


def make_params(mesh=None):
  # NumPy draws: eager jax.random ops on a fresh backend compile one program each, for seconds.
  rng = np.random.default_rng(0)
  params = {k: jnp.asarray(rng.normal(size=SHAPES[k]), jnp.float32) for k in sorted(SHAPES)}
  if mesh is None:
    return params
  return {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in params.items()}


def grads_at(params):
  return jax.tree.map(lambda w: jnp.sin(3.0 * w) + 0.1 * w, params)


def no_extra(t, params):
  del t, params
  return {}


def by_worker(t, params):
  del params
  return {"worker": jnp.int32(t % 3)}


def zeno_inputs(t, params):
  del t
  return {"zeno_grad": grads_at(params)}


def svrg_inputs(t, params):
  # A new epoch every third update: its full gradient, and the minibatch's gradient at the snapshot.
  return {"full_grad": grads_at(params), "refresh": t % 3 == 0,
          "snapshot_grad": jax.tree.map(lambda g: 0.5 * g, grads_at(params))}


def schedule(paradigm, num_updates):
  return dj.cluster.simulate(paradigm, dj.cluster.workers(3, seed=0), num_updates=num_updates, seed=0)


def dc_asgd_a(lam=2.0):
  return dj.delay_compensation(lam, adaptive=True, num_workers=3)


# name: (the transformation, its delays (None: called directly, for those whose per-example inputs dj.delayed
# would pair with the wrong gradient), its extra arguments (t, params) -> dict, the number of buffers shaped like
# each parameter (or [rows, *shape]) in the transformation's own state). Every transformation delayjax exports
# that keeps a buffer per parameter is here but prox_asaga (its parameters are one vector of a sparse linear model);
# those that keep only a count (block_coordinate, apcd, proximal, tap_sgd) take asysbcdvr's prox block step.
CASES = {
    "adam, uniform": (lambda: optax.adam(0.05), lambda: dj.delays.uniform(3), no_extra, 2),
    "dc-asgd-a per worker, constant": (
        lambda: optax.chain(dc_asgd_a(), optax.sgd(0.05)), lambda: dj.delays.constant(2), by_worker, 1),
    "weight_prediction of delay_compensated adam, per-stage": (
        lambda: dj.weight_prediction(dj.delay_compensated(optax.adam(0.05), 5.0), 2.0),
        lambda: dj.delays.per_leaf(dj.delays.by_path(dict.fromkeys(SHAPES, 0), {"^embed": 3, "^w_in": 2, "^w_out": 1})),
        no_extra, 3),
    # Per-worker momentum tables (DANA's one row per worker, as DC-ASGD-a's).
    "dana per worker, constant": (lambda: dj.dana(0.05, num_workers=3), lambda: dj.delays.constant(2), by_worker, 1),
    "dana-dc per worker": (lambda: dj.dana(0.05, num_workers=3, dc_lambda=2.0, dc_adaptive=True),
                           lambda: dj.delays.constant(2), by_worker, 2),
    "dana_slim per worker": (lambda: dj.dana_slim(0.05, num_workers=3), lambda: dj.delays.constant(2), by_worker, 1),
    "gem per worker": (lambda: dj.gem(0.05, num_workers=3), lambda: dj.delays.constant(2), by_worker, 2),
    "saga's table, called directly": (
        lambda: optax.chain(dj.saga(5), optax.sgd(0.05)), None, lambda t, p: {"sample_indices": t % 5}, 2),
    "asysbcdvr (svrg's snapshot, a prox block step), called directly": (
        lambda: dj.asysbcdvr(0.05, dj.prox_l1(0.01), selection="cyclic"), None, svrg_inputs, 2),
    "per_fragment nesterov": (lambda: dj.per_fragment(optax.sgd(0.05, momentum=0.9, nesterov=True), (0, 0, 1, 1)),
                              lambda: dj.delays.constant(2), no_extra, 1),
    "fed_buff, server momentum": (lambda: dj.fed_buff(optax.sgd(0.5, momentum=0.9), buffer_size=3),
                                  lambda: dj.delays.uniform(3), no_extra, 2),
    "fed_async, polynomial": (lambda: dj.fed_async(0.5, "polynomial", a=0.5), lambda: dj.delays.constant(2),
                              no_extra, 0),
    "accumulate_sum of adam": (lambda: dj.accumulate_sum(optax.adam(0.05), 3), lambda: dj.delays.constant(2),
                               no_extra, 3),
    # DESIGN.md's chain: DC-ASGD-a with one table for every worker, a staleness-scaled step, momentum.
    "dc-asgd-a, scale_by_staleness, momentum": (
        lambda: optax.chain(dj.delay_compensation(2.0, adaptive=True), dj.scale_by_staleness("inverse"),
                            optax.sgd(0.05, 0.9)), lambda: dj.delays.constant(2), no_extra, 2),
    "mindthestep": (lambda: dj.mindthestep(0.05, num_workers=3, target_momentum=0.5), lambda: dj.delays.constant(2),
                    no_extra, 0),
    "delay_adaptive_sgd": (lambda: dj.delay_adaptive_sgd(0.05, 0.2, max_delay=4), lambda: dj.delays.constant(2),
                           no_extra, 0),
    "async_adam, inverse": (lambda: dj.async_adam(0.05, staleness_rule="inverse"), lambda: dj.delays.constant(2),
                            no_extra, 2),
    "apam": (lambda: dj.apam(0.05), lambda: dj.delays.constant(2), no_extra, 3),
    "delayed_nesterov": (lambda: dj.delayed_nesterov(0.05, 0.9, buffer_size=2), lambda: dj.delays.constant(2),
                         no_extra, 2),
    "pipemare, discrepancy correction": (
        lambda: dj.pipemare(0.05, warmup_steps=3, momentum=0.9, discrepancy_decay=0.5), lambda: dj.delays.constant(2),
        lambda t, p: {"backward_staleness": jnp.int32(1)}, 2),
    "spectrain": (lambda: dj.spectrain(0.05), lambda: dj.delays.constant(2), no_extra, 1),
    "zeno++ of adam": (lambda: dj.zeno_plus_plus(0.05, inner=optax.adam(0.05)), lambda: dj.delays.constant(2),
                       zeno_inputs, 2),
    # The schedule replay's rings, and per_contribution's stacks of contributions (K-async: two per update).
    "schedule replay, per_contribution dc-asgd-a": (
        lambda: optax.chain(dj.per_contribution(dc_asgd_a()), optax.sgd(0.05)),
        lambda: schedule(dj.cluster.k_async(2), 3), no_extra, 1),
}
# Equal to one device up to rounding only: Zeno++'s score sums its products across devices, and SAGA's table sum
# over n (a traced divisor: NaN for an index out of range) is divided on 8 devices, multiplied by 1/n on one.
ROUNDED = ("zeno++ of adam", "saga's table, called directly")


def test_zeno_score_on_sharded_parameters_gathers_nothing():
  """Zeno++'s inner products reduce each leaf where it lies: no all-gather, the one-device score."""
  from delayjax.transforms._zeno import _dot

  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  with jax.set_mesh(mesh):
    sharded = make_params(mesh)
    compiled = jax.jit(_dot).lower(sharded, grads_at(sharded)).compile()
    value = compiled(sharded, grads_at(sharded))
  assert "all-gather" not in compiled.as_text() and "all-to-all" not in compiled.as_text()
  params = make_params()
  expected = sum(np.sum(np.asarray(p, np.float64) * np.asarray(g, np.float64))
                 for p, g in zip(jax.tree.leaves(params), jax.tree.leaves(grads_at(params))))
  np.testing.assert_allclose(float(value), expected, rtol=1e-5)


def normalized(spec, ndim):
  return tuple(spec) + (None,) * (ndim - len(spec))


def check_state_sharding(state, params):
  """Each leaf shaped like a parameter, or [rows, *shape], is sharded as that parameter (rows unsharded)."""
  by_shape = {p.shape: normalized(p.sharding.spec, p.ndim) for p in jax.tree.leaves(params)}
  checked = 0
  for path, x in jax.tree_util.tree_leaves_with_path(state):
    if x.shape in by_shape:
      expected = by_shape[x.shape]
    elif x.ndim >= 2 and x.shape[1:] in by_shape:
      expected = (None,) + by_shape[x.shape[1:]]
    else:
      # The tables of dj.delayed (issued, delays, workers), counts and keys: a few int32 each.
      assert x.size <= 8, (jax.tree_util.keystr(path), x.shape)
      continue
    assert isinstance(x.sharding, NamedSharding), (jax.tree_util.keystr(path), x.sharding)
    assert normalized(x.sharding.spec, x.ndim) == expected, (jax.tree_util.keystr(path), x.sharding.spec)
    checked += 1
  return checked


def make(name):
  """The case's transformation: wrapped in dj.delayed with its delays, or alone."""
  make_tx, make_delays, _, _ = CASES[name]
  return make_tx() if make_delays is None else dj.delayed(make_tx(), make_delays())


def train(tx, params, extra, on_mesh):
  @jax.jit
  def step(params, state, t):
    read = dj.read_params(state, params)
    u, state = tx.update(grads_at(read), state, params, **extra(t, params))
    return optax.apply_updates(params, u), state

  state = tx.init(params)
  hlo = None
  if on_mesh:
    check_state_sharding(state, params)
    # Run the very program whose HLO is checked (and compile it once).
    step = step.lower(params, state, jnp.int32(0)).compile()
    hlo = step.as_text()
  for t in range(STEPS):
    params, state = step(params, state, jnp.int32(t))
  return params, state, hlo


# Every case on Explicit axes (shardings are types: a ring sharded otherwise than its parameter fails to trace);
# one on Auto axes (init outside jit: the concrete parameters carry their sharding), the buffers made the same way.
@pytest.mark.parametrize("name, axis_type", [(name, AxisType.Explicit) for name in CASES]
                         + [("dc-asgd-a per worker, constant", AxisType.Auto)])
def test_sharded_state_stays_sharded_gathers_nothing_and_equals_one_device(name, axis_type):
  _, make_delays, extra, buffers = CASES[name]
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type, axis_type))
  with jax.set_mesh(mesh):
    sharded, state, hlo = train(make(name), make_params(mesh), extra, True)
  assert "all-gather" not in hlo and "all-to-all" not in hlo
  # Every buffer was there to check: dj.delayed's two rings (gradients, parameters read) and the transformation's own.
  own = state if make_delays is None else state.inner_state
  assert check_state_sharding(own, sharded) == buffers * len(SHAPES)
  assert check_state_sharding(state, sharded) == (buffers + (make_delays is not None) * 2) * len(SHAPES)
  for k in SHAPES:
    assert normalized(sharded[k].sharding.spec, sharded[k].ndim) == normalized(SPECS[k], len(SHAPES[k]))
  single, _, _ = train(make(name), make_params(), extra, False)
  for k in SHAPES:
    if name in ROUNDED:
      np.testing.assert_allclose(np.asarray(sharded[k]), np.asarray(single[k]), rtol=1e-6, atol=1e-6, err_msg=k)
    else:
      np.testing.assert_array_equal(np.asarray(sharded[k]), np.asarray(single[k]), err_msg=k)
  assert any(not np.allclose(np.asarray(single[k]), np.asarray(v)) for k, v in make_params().items())  # it trained


def test_plain_zeros_would_have_been_gathered():
  """The check above can fail: a ring made with plain jnp.zeros (as before) is not sharded like its parameter."""
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  params = make_params(mesh)
  plain = {"rings": jax.tree.map(lambda p: jnp.zeros((3,) + p.shape, p.dtype), params)}
  with pytest.raises(AssertionError):
    check_state_sharding(plain, params)
