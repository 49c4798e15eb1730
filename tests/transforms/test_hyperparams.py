"""Hyper-parameters like Optax's: numbers, arrays (optax.inject_hyperparams, jax.vmap) and schedules.

Each entry wraps a transformation in ``optax.inject_hyperparams``, changes
hyper-parameters between jitted steps, and compares with the transformation
built with each value as Python numbers (the state carried over): the same
updates, and one trace.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj

from remedy_checks import counting_jit, params_tree, random_like

VECTOR = jnp.array([0.5, -1.0, 2.0], jnp.float32)


def extras(params, step):
  # PipeMare's discrepancy correction needs the stage's backward staleness (at most its forward one).
  return {"staleness": jnp.int32(step % 3), "backward_staleness": jnp.int32(min(step % 3, 1)),
          "stale_params": jax.tree.map(lambda p: 0.9 * p, params),
          "worker": jnp.int32(step % 2), "zeno_grad": jax.tree.map(jnp.ones_like, params)}


def sparse_extras(params, step):
  del params
  return {"sample_indices": jnp.int32(step % 2), "sample_scalars": jnp.float32(0.5 - step),
          "sample_features": (jnp.array([step % 3], jnp.int32), jnp.array([1.0], jnp.float32))}


def svrg_extras(params, step):
  return {"snapshot_grad": jax.tree.map(lambda p: 0.5 * p, params), "refresh": jnp.bool_(step % 3 == 0),
          "full_grad": jax.tree.map(lambda p: jnp.cos(p + step), params)}


# name: (factory, hyper-parameters before, after, static_args, params, extras)
CASES = {
    "scale_by_staleness": (dj.scale_by_staleness, dict(rule="hinge", a=2.0, b=1), dict(a=0.5, b=0), (), None, None),
    "scale_by_staleness_drop": (dj.scale_by_staleness, dict(rule="drop", threshold=2), dict(threshold=0), (), None,
                                None),
    "delay_compensation": (dj.delay_compensation, dict(lam=0.5), dict(lam=2.0), (), None, None),
    "delay_compensation_a": (dj.delay_compensation, dict(lam=2.0, adaptive=True, momentum=0.9, eps=1e-3,
                                                         num_workers=2), dict(lam=1.0, momentum=0.5, eps=0.1),
                             ("num_workers",), None, None),
    "dana": (dj.dana, dict(learning_rate=0.1, momentum=0.5, num_workers=2, dc_lambda=0.5),
             dict(learning_rate=0.05, momentum=0.8, dc_lambda=1.0), ("num_workers",), None, None),
    "dana_slim": (dj.dana_slim, dict(learning_rate=0.1, momentum=0.5, num_workers=2), dict(momentum=0.9),
                  ("num_workers",), None, None),
    "delayed_nesterov": (dj.delayed_nesterov, dict(learning_rate=0.1, momentum=0.5, buffer_size=2),
                         dict(momentum=0.9, buffer_size=3), (), None, None),
    "async_adam": (dj.async_adam, dict(learning_rate=0.1, b1=0.9, b2=0.99, eps=1e-8, staleness_rule="polynomial",
                                       a=0.5), dict(b1=0.5, a=1.0), (), None, None),
    "apam": (dj.apam, dict(learning_rate=0.1, b2=0.9, staleness_rule="exponential", a=0.1),
             dict(learning_rate=0.2, b2=0.99, a=0.3), (), None, None),
    "fed_async": (dj.fed_async, dict(mixing=0.9, rule="polynomial", a=0.5), dict(mixing=0.5, a=1.0), (), None,
                  None),
    "fed_buff": (dj.fed_buff, dict(server_optimizer=optax.sgd(0.5), buffer_size=2, a=0.5),
                 dict(buffer_size=1, a=1.0), (), None, None),
    "accumulate_sum": (dj.accumulate_sum, dict(inner=optax.sgd(0.5), k=2), dict(k=3), (), None, None),
    "zeno_plus_plus": (dj.zeno_plus_plus, dict(learning_rate=0.1, rho=0.01, eps=0.1),
                       dict(learning_rate=0.2, rho=0.0), (), None, None),
    "delay_adaptive_sgd": (dj.delay_adaptive_sgd, dict(max_step=0.1, step_budget=0.15, max_delay=4),
                           dict(max_step=0.05), ("max_delay",), None, None),
    "mindthestep": (dj.mindthestep, dict(learning_rate=0.1, num_workers=4, target_momentum=0.5),
                    dict(target_momentum=0.25), ("num_workers",), None, None),
    "proximal": (dj.proximal, dict(prox=dj.prox_l1(0.1), learning_rate=0.1), dict(learning_rate=0.3), ("prox",),
                 None, None),
    "prox_asaga": (dj.prox_asaga, dict(num_samples=2, learning_rate=0.1, prox=dj.prox_l1(0.1),
                                       support_counts=np.array([1, 1, 1])), dict(learning_rate=0.3),
                   ("num_samples", "prox", "support_counts"), VECTOR, sparse_extras),
    "spectrain": (dj.spectrain, dict(learning_rate=0.1, smoothing=0.9), dict(learning_rate=0.2, smoothing=0.5), (),
                  None, None),
    "pipemare": (dj.pipemare, dict(learning_rate=0.1, warmup_steps=4, momentum=0.5, discrepancy_decay=0.5),
                 dict(warmup_steps=2, momentum=0.9, discrepancy_decay=0.25), (), None, None),
    "tap_sgd": (dj.tap_sgd, dict(prox=dj.prox_l1(0.1), learning_rate=0.1), dict(learning_rate=0.3), ("prox",), None,
                None),
    "block_coordinate": (dj.block_coordinate, dict(learning_rate=0.1, prox=dj.prox_l1(0.1), seed=1),
                         dict(learning_rate=0.3, seed=2), ("prox",), None, None),
    "apcd": (dj.apcd, dict(learning_rate=0.1, prox=dj.prox_l1(0.1), selection="cyclic"), dict(learning_rate=0.3),
             ("prox",), None, None),
    "asysbcdvr": (dj.asysbcdvr, dict(learning_rate=0.1, prox=dj.prox_l1(0.1)), dict(learning_rate=0.3), ("prox",),
                  None, svrg_extras),
    "prox_svrg": (dj.prox_svrg, dict(prox=dj.prox_l1(0.1), learning_rate=0.1), dict(learning_rate=0.3), ("prox",),
                  None, svrg_extras),
    "prox_svrcd": (dj.prox_svrcd, dict(prox=dj.prox_l1(0.1), learning_rate=0.1), dict(learning_rate=0.3), ("prox",),
                   None, svrg_extras),
    "dap_svrg": (dj.dap_svrg, dict(prox=dj.prox_l1(0.1), learning_rate=0.1, server_rate=0.5),
                 dict(learning_rate=0.3, server_rate=0.25), ("prox",), None, svrg_extras),
}


def with_values(state, values):
  hyper = {k: jnp.full_like(state.hyperparams[k], v) for k, v in values.items()}  # same dtype and weak type
  return state._replace(hyperparams={**state.hyperparams, **hyper})


@pytest.mark.standard_promotion  # inject_hyperparams mixes int32 counts and floats
@pytest.mark.parametrize("name", CASES)
def test_inject_hyperparams_changes_values_without_recompiling(name):
  factory, before, after, static, params, extra = CASES[name]
  params = params_tree() if params is None else params
  extra = extras if extra is None else extra
  injected = optax.inject_hyperparams(factory, static_args=static)(**before)
  jitted, traces = counting_jit(injected)
  state = injected.init(params)
  reference = factory(**before)
  ref_state = reference.init(params)
  for i in range(6):
    if i == 3:
      state = with_values(state, after)
      reference = factory(**{**before, **after})
    grads = random_like(params, i)
    got, state = jitted(grads, state, params, extra(params, i))
    want, ref_state = reference.update(grads, ref_state, params, **extra(params, i))
    chex.assert_trees_all_close(got, want, rtol=2e-6, atol=1e-7)
    chex.assert_trees_all_close(state.inner_state, ref_state, rtol=2e-6, atol=1e-7)
    params = optax.apply_updates(params, got)
  assert len(traces) == 1


def test_vmap_sweep_over_lam_of_delay_compensation_equals_separate_runs():
  params = params_tree()

  def run(lam, adaptive):
    tx = optax.chain(dj.delay_compensation(lam, adaptive=adaptive, momentum=0.5), optax.sgd(0.1))

    def body(carry, step):
      p, s = carry
      grads = jax.tree.map(lambda x: jnp.sin(x + step.astype(x.dtype)), p)
      u, s = tx.update(grads, s, p, stale_params=jax.tree.map(lambda x: 0.9 * x, p))
      return (optax.apply_updates(p, u), s), None

    return jax.lax.scan(body, (params, tx.init(params)), jnp.arange(5, dtype=jnp.int32))[0][0]

  lams = (0.0, 0.5, 2.0)
  for adaptive in (False, True):
    swept = jax.jit(jax.vmap(lambda lam: run(lam, adaptive)))(jnp.asarray(lams, jnp.float32))
    for i, lam in enumerate(lams):
      jax.tree.map(lambda a, b: np.testing.assert_allclose(a[i], b, rtol=1e-6, atol=1e-7), swept, run(lam, adaptive))


def test_vmap_sweep_over_the_rates_of_dap_sgd_equals_separate_builds():
  params, grads = params_tree(), random_like(params_tree(), 0)

  def step(rate, server_rate):
    dap = dj.dap_sgd(dj.prox_l1(0.1), rate, server_rate=server_rate)
    delta, _ = dap.worker.update(grads, dap.worker.init(params), params)
    return dap.server.update(jax.tree.map(jnp.negative, delta), dap.server.init(params), params)[0]

  rates, server_rates = (0.1, 0.5), (1.0, 0.25)
  swept = jax.jit(jax.vmap(step))(jnp.asarray(rates, jnp.float32), jnp.asarray(server_rates, jnp.float32))
  for i, (rate, server_rate) in enumerate(zip(rates, server_rates)):
    chex.assert_trees_all_close(jax.tree.map(lambda a: a[i], swept), step(rate, server_rate), rtol=1e-6, atol=1e-7)


@pytest.mark.standard_promotion  # inject_hyperparams mixes int32 counts and floats
def test_injected_schedule_equals_the_schedule_given_directly():
  schedule = optax.linear_schedule(0.2, 0.05, transition_steps=4)
  injected = optax.inject_hyperparams(dj.dana, static_args=("num_workers",))(schedule, momentum=0.5, num_workers=2)
  direct = dj.dana(schedule, momentum=0.5, num_workers=2)
  params = params_tree()
  s, r = injected.init(params), direct.init(params)
  for i in range(5):
    g = random_like(params, i)
    u, s = injected.update(g, s, params, worker=i % 2)
    v, r = direct.update(g, r, params, worker=i % 2)
    chex.assert_trees_all_close(u, v, rtol=1e-6)


@pytest.mark.parametrize("make, exc, match", [
    (lambda: dj.delay_compensation(jnp.float32(-1.0)), ValueError, "lam must be >= 0.0"),
    (lambda: dj.delay_compensation(0.5, momentum=jnp.float32(1.0)), ValueError, "momentum must be < 1.0"),
    (lambda: dj.delay_compensation(jnp.ones(2)), ValueError, r"lam must be a scalar, got shape \(2,\)"),
    (lambda: dj.delay_compensation(lambda count: 0.5), TypeError, "lam must be a number or a scalar array"),
    (lambda: dj.dana(0.1, momentum=jnp.float32(1.5)), ValueError, "momentum must be < 1.0"),
    (lambda: dj.dana(0.1, num_workers=jnp.int32(2)), TypeError, r"static_args=\('num_workers',\)"),
    (lambda: dj.delayed_nesterov(0.1, buffer_size=jnp.int32(0)), ValueError, "buffer_size must be an integer >= 1"),
    (lambda: dj.async_adam(0.1, b1=jnp.float32(1.0)), ValueError, "b1 must be < 1.0"),
    (lambda: dj.delay_adaptive_sgd(jnp.float32(0.5), jnp.float32(0.25)), ValueError, "step_budget must be >= max_step"),
    (lambda: dj.mindthestep(0.1, 4, target_momentum=jnp.float32(0.9)), ValueError, r"target_momentum must be in \[0, 0.75\]"),
    (lambda: dj.zeno_plus_plus(jnp.float32(0.0)), ValueError, "learning_rate must be > 0.0"),
    (lambda: dj.spectrain(0.1, smoothing=jnp.float32(1.0)), ValueError, "smoothing must be < 1"),
    (lambda: dj.pipemare(0.1, warmup_steps=jnp.float32(1.5)), TypeError, "warmup_steps must be an integer"),
    (lambda: dj.pipemare(0.1, warmup_steps=2, discrepancy_decay=jnp.float32(0.0)), ValueError,
     "discrepancy_decay must be > 0.0"),
    (lambda: dj.dap_sgd(dj.prox_l1(0.1), jnp.float32(-0.1)), ValueError, "learning_rate must be > 0.0"),
    (lambda: dj.block_coordinate(jnp.ones(2)), ValueError, r"learning_rate must be a scalar, got shape \(2,\)"),
])
def test_concrete_arrays_keep_the_clear_errors(make, exc, match):
  with pytest.raises(exc, match=match):
    make()
