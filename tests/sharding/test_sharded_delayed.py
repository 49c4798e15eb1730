"""dj.delayed and the transformations on sharded parameters: 8 CPU devices, a (data=2, model=4) mesh.

The parameters are sharded FSDP-style on the ``data`` axis and tensor-parallel on the ``model`` axis. Every
buffer the state keeps per parameter (dj.delayed's gradient and parameter rings, per-worker tables, the inner
optimizer's moments) must keep its parameter's partition, a leading ring or row axis unsharded; the compiled
update must gather nothing (no all-gather, no all-to-all in its HLO); and the numbers must be those of the same
run on one device, bit for bit: every operation here is elementwise per parameter, so the partition cannot
change a result (the test asserts equality, not closeness).
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
pytestmark = [pytest.mark.standard_promotion, pytest.mark.fast_compile]

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


CASES = {
    "adam, uniform": (lambda: optax.adam(0.05), lambda: dj.delays.uniform(3), False),
    "dc-asgd-a per worker, constant": (
        lambda: optax.chain(dj.delay_compensation(2.0, adaptive=True, num_workers=3), optax.sgd(0.05)),
        lambda: dj.delays.constant(2), True),
    "weight_prediction of delay_compensated adam, per-stage": (
        lambda: dj.weight_prediction(dj.delay_compensated(optax.adam(0.05), 5.0), 2.0),
        lambda: dj.delays.per_leaf(dj.delays.by_path(dict.fromkeys(SHAPES, 0), {"^embed": 3, "^w_in": 2, "^w_out": 1})),
        False),
    # Per-worker momentum tables (DANA's one row per worker, as DC-ASGD-a's).
    "dana per worker, constant": (lambda: dj.dana(0.05, num_workers=3), lambda: dj.delays.constant(2), True),
}


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


def train(tx, params, with_worker, on_mesh):
  extra = (lambda t: {"worker": jnp.int32(t % 3)}) if with_worker else (lambda t: {})

  @jax.jit
  def step(params, state, t):
    read = dj.read_params(state, params)
    u, state = tx.update(grads_at(read), state, params, **extra(t))
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
  make_tx, make_delays, with_worker = CASES[name]
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type, axis_type))
  with jax.set_mesh(mesh):
    sharded, state, hlo = train(dj.delayed(make_tx(), make_delays()), make_params(mesh), with_worker, True)
  assert "all-gather" not in hlo and "all-to-all" not in hlo
  assert check_state_sharding(state, sharded) >= 2 * len(SHAPES)  # the rings (and moments) were there to check
  for k in SHAPES:
    assert normalized(sharded[k].sharding.spec, sharded[k].ndim) == normalized(SPECS[k], len(SHAPES[k]))
  single, _, _ = train(dj.delayed(make_tx(), make_delays()), make_params(), with_worker, False)
  for k in SHAPES:
    np.testing.assert_array_equal(np.asarray(sharded[k]), np.asarray(single[k]), err_msg=k)
  assert not np.allclose(np.asarray(single["w_in"]), np.asarray(make_params()["w_in"]))  # it trained


def test_plain_zeros_would_have_been_gathered():
  """The check above can fail: a ring made with plain jnp.zeros (as before) is not sharded like its parameter."""
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  params = make_params(mesh)
  plain = {"rings": jax.tree.map(lambda p: jnp.zeros((3,) + p.shape, p.dtype), params)}
  with pytest.raises(AssertionError):
    check_state_sharding(plain, params)
