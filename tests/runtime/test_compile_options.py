"""On one CPU device the engine compiles a small model's programs with XLA's quicker-compiling options
(``_engine.compile_options``), chosen by the model alone: a run's numbers do not depend on how long it is or on
the runs computed beside it."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj
from delayjax.runtime import _engine

# optax.adam's bias correction mixes float and int32.
pytestmark = pytest.mark.standard_promotion

# Two LLVM modules (XLA's default is 32) where the installed jaxlib rounds them as it does 32.
SPLIT = {"xla_cpu_parallel_codegen_split_count": 2} if _engine._jaxlib_version() >= (0, 10) else {}
# LLVM's level 1 too where the installed jaxlib rounds a sharded program at that level as its one-device twin.
SMALL = {"xla_cpu_use_fusion_emitters": False, **SPLIT,
         **({"xla_backend_optimization_level": 1} if _engine._jaxlib_version() >= (0, 10) else {})}


def _mlp_loss(params, batch):
  x, y = batch
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  logits = jax.nn.relu(h @ params["w2"])
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def _problem():
  rng = np.random.default_rng(0)
  params = {"w1": jnp.asarray(rng.normal(size=(12, 16)), jnp.float32), "b1": jnp.zeros(16, jnp.float32),
            "w2": jnp.asarray(rng.normal(size=(16, 5)) / 4, jnp.float32)}
  data = (rng.normal(size=(64, 12)).astype(np.float32), rng.integers(0, 5, size=64).astype(np.int32))
  return params, data


def _bits(tree):
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def _chunk_options():
  return {key[-1] for key in _engine._cache if key[0] == "chunk"}


def test_a_small_model_gets_the_quick_compile_options_and_a_larger_one_the_defaults():
  assert jax.devices()[0].platform == "cpu"
  # The pinned XLA has the option, so the runs below are compiled with it.
  assert _engine.compile_options(1) == SMALL
  assert _engine.compile_options(_engine.SMALL_MODEL_ENTRIES) == SMALL
  assert _engine.compile_options(_engine.SMALL_MODEL_ENTRIES + 1) is None
  assert _engine.compile_options(None) is None


def test_the_probe_started_in_the_background_gives_the_answer_a_caller_waits_for(monkeypatch):
  """``start_compiler_probe`` (the gossip runtime's, once its arguments are checked) finds out in a thread of
  its own whether the XLA takes the small-model options; a caller meanwhile waits for that answer, and an XLA
  that refuses the options gets the defaults."""
  for supported, want in ((None, SMALL), (None, None)):
    monkeypatch.setattr(_engine, "_small_model_supported", supported)
    monkeypatch.setattr(_engine, "_probe_started", False)
    if want is None:
      # An XLA without the options refuses their compile.
      monkeypatch.setattr(_engine, "_SMALL_MODEL_OPTIONS", {"xla_cpu_no_such_option": False})
    _engine.start_compiler_probe()
    assert _engine._probe_started
    assert _engine.compile_options(1) == want
    assert _engine._small_model_supported is (want is not None)
    # Started once per process: a second start does nothing.
    _engine.start_compiler_probe()
    assert _engine.compile_options(1) == want


def test_an_older_jaxlib_keeps_the_default_level(monkeypatch):
  # On jaxlib 0.8.0 and 0.9.0 a sharded program at level 1 rounded otherwise than its one-device twin (by an ulp).
  monkeypatch.setattr(_engine, "_jaxlib_version", lambda: (0, 9, 2))
  assert _engine.compile_options(1) == {"xla_cpu_use_fusion_emitters": False}
  monkeypatch.setattr(_engine, "_jaxlib_version", lambda: (0, 10, 0))
  assert _engine.compile_options(1) == {"xla_cpu_use_fusion_emitters": False,
                                        "xla_cpu_parallel_codegen_split_count": 2,
                                        "xla_backend_optimization_level": 1}


def test_a_level_set_by_jax_or_xla_flags_is_kept(monkeypatch):
  # A program's own options override JAX's and XLA_FLAGS' levels, so a small model's level 1 is left out where
  # they set one (the tests' quick compiles at level 0, say).
  without_level = {"xla_cpu_use_fusion_emitters": False, **SPLIT}
  monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
  assert _engine.compile_options(1) == without_level
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  assert _engine.compile_options(1) == SMALL
  for name, value, default in (("jax_disable_most_optimizations", True, False), ("jax_optimization_level", "O0",
                                                                                 "UNKNOWN")):
    jax.config.update(name, value)
    try:
      assert _engine.compile_options(1) == without_level
    finally:
      jax.config.update(name, default)
  assert _engine.compile_options(1) == SMALL


def test_a_small_models_program_is_generated_in_two_modules_whatever_the_machine(monkeypatch):
  """Two LLVM modules on any number of CPUs (how kernels are grouped into modules can change their rounding, so
  the count is not the machine's); XLA's own count where XLA_FLAGS sets one, or before jaxlib 0.10."""
  monkeypatch.setattr(_engine, "_jaxlib_version", lambda: (0, 10, 2))
  monkeypatch.setenv("XLA_FLAGS", "")
  for cpus in (1, 2, 16, 64):
    monkeypatch.setattr(_engine, "_host_cpus", lambda cpus=cpus: cpus)
    assert _engine._codegen_split() == {"xla_cpu_parallel_codegen_split_count": 2}
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_parallel_codegen_split_count=8")
  assert _engine._codegen_split() == {}
  assert "xla_cpu_parallel_codegen_split_count" not in _engine.compile_options(1)
  monkeypatch.setenv("XLA_FLAGS", "")
  monkeypatch.setattr(_engine, "_jaxlib_version", lambda: (0, 9, 2))
  assert _engine._codegen_split() == {}


def test_the_runtime_compiles_by_the_size_of_the_model(monkeypatch):
  params, data = _problem()
  schedule = dj.cluster.simulate(dj.cluster.asp(), dj.cluster.workers(4), num_updates=30, seed=3)

  def compiled_with():
    _engine.clear_cache()
    dj.simulate(_mlp_loss, optax.adam(3e-3), params, data, schedule, sampling=dj.Sampling(batch_size=8), seed=5)
    return _chunk_options()

  assert compiled_with() == {str(SMALL)}
  # One entry fewer allowed than its 288 parameters makes it a larger model.
  monkeypatch.setattr(_engine, "SMALL_MODEL_ENTRIES", sum(x.size for x in jax.tree.leaves(params)) - 1)
  assert compiled_with() == {"None"}


@pytest.mark.parametrize("small", [True, False])
def test_a_runs_numbers_do_not_depend_on_its_length_or_the_runs_beside_it(small, monkeypatch):
  if not small:
    monkeypatch.setattr(_engine, "SMALL_MODEL_ENTRIES", 0)
  params, data = _problem()
  evaluate = lambda p: {"loss": _mlp_loss(p, (jnp.asarray(data[0]), jnp.asarray(data[1])))}  # noqa: E731
  kwargs = dict(sampling=dj.Sampling(batch_size=8), record=dj.Record(eval_fn=evaluate, every=10))
  tx = optax.adam(3e-3)
  _engine.clear_cache()
  short = dj.simulate(_mlp_loss, tx, params, data, dj.delays.uniform(3), num_updates=40, seed=1, **kwargs)
  long = dj.simulate(_mlp_loss, tx, params, data, dj.delays.uniform(3), num_updates=400, seed=1, **kwargs)
  # Twenty runs of their own schedules in one call, the first the short run's.
  sources = [dj.runtime.schedule_from_delays(dj.delays.uniform(3), 40, seed, num_workers=4) for seed in range(20)]
  batch = dj.simulate(_mlp_loss, tx, params, data, None, seed=dj.Runs(seeds=[1] * 20, sources=sources), **kwargs)
  alone = dj.simulate(_mlp_loss, tx, params, data, sources[0], seed=1, **kwargs)
  assert _chunk_options() == {str(SMALL) if small else "None"}
  assert _bits(short.history.loss) == _bits(long.history.loss[:40])
  assert _bits(short.history.eval_metrics) == _bits(jax.tree.map(lambda x: x[:5], long.history.eval_metrics))
  assert _bits((batch[0].params, batch[0].history.loss)) == _bits((alone.params, alone.history.loss))
