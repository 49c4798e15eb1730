"""The engine compiles a short run's programs for a short run (``_engine.compile_options``), and they compute
the same bits as the default compile: checked program by program (models, optimizers, dtypes) and through
``dj.simulate`` with the threshold moved on either side of the run."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj
from delayjax.runtime import _engine

# optax.adam's bias correction mixes float and int32.
pytestmark = pytest.mark.standard_promotion


def _mlp_loss(params, x, y):
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  h = jax.nn.relu(h @ params["w2"] + params["b2"])
  logits = h @ params["w3"]
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y)) + 1e-3 * jnp.sum(params["w1"] ** 2)


def _params(dtype):
  rng = np.random.default_rng(0)
  raw = {"w1": rng.normal(size=(12, 16)), "b1": rng.normal(size=16), "w2": rng.normal(size=(16, 16)) / 4,
         "b2": np.zeros(16), "w3": rng.normal(size=(16, 5)) / 4}
  return jax.tree.map(lambda a: jnp.asarray(a, dtype), raw)


def _train(tx, steps):
  """``steps`` steps of ``tx`` on the MLP: its parameters, state and losses at the end (one program)."""

  def run(params, x, y):
    def step(carry, _):
      params, state = carry
      loss, grads = jax.value_and_grad(_mlp_loss)(params, x, y)
      updates, state = tx.update(grads, state, params)
      return (optax.apply_updates(params, updates), state), loss
    (params, state), losses = jax.lax.scan(step, (params, tx.init(params)), None, length=steps)
    return params, state, losses, jax.nn.log_softmax(x @ params["w1"]), jnp.sqrt(jnp.abs(params["w2"]) + 1.0)

  return run


def _bits(tree):
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def test_a_program_of_little_work_gets_the_short_run_options_and_one_of_much_the_defaults():
  assert jax.devices()[0].platform == "cpu"
  # The pinned XLA has the option: a short run gets it (the bit-for-bit checks below compare two compiles).
  assert _engine.compile_options(0) == {"xla_cpu_use_fusion_emitters": False}
  assert _engine.compile_options(_engine.SHORT_RUN_WORK) == {"xla_cpu_use_fusion_emitters": False}
  assert _engine.compile_options(_engine.SHORT_RUN_WORK + 1) is None
  assert _engine.compile_options(None) is None


@pytest.mark.parametrize("x64", [False, True])
@pytest.mark.parametrize("name", ["sgd", "momentum", "adam", "rmsprop", "adamw"])
def test_a_program_compiled_for_a_short_run_computes_the_default_compiles_bits(name, x64):
  tx = {"sgd": optax.sgd(0.05), "momentum": optax.sgd(0.05, momentum=0.9), "adam": optax.adam(3e-3),
        "rmsprop": optax.rmsprop(3e-3), "adamw": optax.adamw(3e-3, weight_decay=1e-2)}[name]
  with jax.enable_x64(x64):
    dtype = jnp.float64 if x64 else jnp.float32
    params = _params(dtype)
    rng = np.random.default_rng(1)
    x, y = jnp.asarray(rng.normal(size=(40, 12)), dtype), jnp.asarray(rng.integers(0, 5, size=40))
    fn = _train(tx, 25)
    short = jax.jit(fn, compiler_options=_engine.compile_options(0)).lower(params, x, y).compile()
    default = jax.jit(fn).lower(params, x, y).compile()
    got, want = short(params, x, y), default(params, x, y)
    assert jax.tree.leaves(got)[0].dtype == dtype
    assert _bits(got) == _bits(want)


def test_a_simulated_run_is_the_same_compiled_for_a_short_or_a_long_run(monkeypatch):
  params = _params(jnp.float32)
  rng = np.random.default_rng(2)
  data = (rng.normal(size=(64, 12)).astype(np.float32), rng.integers(0, 5, size=64).astype(np.int32))
  loss_fn = lambda p, batch: _mlp_loss(p, *batch)  # noqa: E731
  schedule = dj.cluster.simulate(dj.cluster.asp(), dj.cluster.workers(4), num_updates=60, seed=3)
  evaluate = lambda p: {"loss": _mlp_loss(p, jnp.asarray(data[0]), jnp.asarray(data[1]))}  # noqa: E731

  works = []
  compile_options = _engine.compile_options
  monkeypatch.setattr(_engine, "compile_options", lambda work: works.append(work) or compile_options(work))

  def simulate():
    _engine.clear_cache()
    result = dj.simulate(loss_fn, optax.adam(3e-3), params, data, schedule, sampling=dj.Sampling(batch_size=8),
                         seed=5, record=dj.Record(eval_fn=evaluate, every=10))
    options = {str(key[-1]) for key in _engine._cache if key[0] == "chunk"}
    return result, options

  short, short_options = simulate()
  monkeypatch.setattr(_engine, "SHORT_RUN_WORK", 0)
  long, long_options = simulate()
  assert short_options == {str({"xla_cpu_use_fusion_emitters": False})} and long_options == {"None"}
  # The chunk's work: its steps (at most one per update of the 60) times the parameters' entries.
  entries = sum(x.size for x in jax.tree.leaves(params))
  chunk_works = {w for w in works if w}
  assert len(chunk_works) == 1 and all(w % entries == 0 and w // entries <= 60 for w in chunk_works)
  assert _bits(short.params) == _bits(long.params)
  assert _bits(short.opt_state) == _bits(long.opt_state)
  assert _bits((short.history.loss, short.history.eval_metrics)) == _bits((long.history.loss,
                                                                            long.history.eval_metrics))
