"""Every guarantee of a run, against every runtime: one matrix, so a runtime that lacks one fails here.

The engine (``delayjax.runtime._engine``) owns the guarantees a run has whatever its kind; each front end
(``dj.simulate``, ``dj.simulate_gossip``, ``dj.simulate_pipeline``) only declares its plan and its step. Each
test below is parametrized over the three runtimes with one small problem each (``RUNTIMES``), and asserts
the guarantee's effect, not that a call runs: a resumed run equals the uninterrupted one bit for bit, a
changed function is refused by name, a NaN is reported, a held lock refuses, a run too large is refused
before its state is allocated.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import tracemalloc
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj
from delayjax.runtime import _engine

X = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
DATA = {"x": X, "y": (X @ np.array([1.0, -2.0, 0.5], np.float32)).astype(np.float32)}


def _loss(w, batch):
  return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)


def _other_loss(w, batch):
  return jnp.mean(jnp.abs(batch["x"] @ w - batch["y"]))


def _eval(w):
  return {"loss": _loss(w, DATA)}


def _stage0(p, h):
  return h * p["s"]


def _stage1(p, h):
  return h @ p["w"]


def _pipe_loss(h, batch):
  return jnp.mean((h - batch["y"]) ** 2)


def _pipe_eval(ps):
  return {"loss": _pipe_loss(_stage1(ps[1], _stage0(ps[0], DATA["x"])), DATA)}


def _run(runtime: str, *, data=DATA, loss=None, tx=None, evaluate=False, change=None, callback=None,
         history="updates", nonfinite="report", **options):
  """One small run of ``runtime`` (``"simulate"``, ``"gossip"`` or ``"pipeline"``).

  ``evaluate``: with an ``eval_fn`` every 8 updates; ``callback``, ``history``, ``nonfinite``: the
  ``dj.Record`` fields. ``change`` names a function to swap for another that changes the numbers
  (``"loss_fn"``, ``"tx"``, ``"eval_fn"``, ``"method"``, ``"stage_fns"``), for the identity tests.
  """
  tx = tx or optax.sgd(0.05 if change != "tx" else 0.02)
  eval_fn = None
  if evaluate:
    base = _pipe_eval if runtime == "pipeline" else _eval
    eval_fn = (lambda w: {"loss": 2.0 * base(w)["loss"]}) if change == "eval_fn" else base
  options.setdefault("record", dj.Record(eval_fn=eval_fn, every=8 if evaluate else None, history=history,
                                         callback=callback, nonfinite=nonfinite))
  options.setdefault("sampling", dj.Sampling(batch_size=8))
  options.setdefault("execution", dj.Execution(chunk_size=4))
  if runtime == "simulate":
    sched = dj.cluster.simulate(dj.cluster.asp(), dj.cluster.workers(3, seed=0), num_updates=24, seed=0)
    return dj.simulate(loss or (_other_loss if change == "loss_fn" else _loss), tx, jnp.zeros(3, jnp.float32),
                       data, sched, **options)
  if runtime == "gossip":
    paradigm = dj.cluster.d_psgd(dj.topology.ring(4))
    sched = dj.cluster.simulate_gossip(paradigm, dj.cluster.workers(4, seed=0), num_steps=12, seed=0)
    # The same method with another hyper-parameter: the same name, other numbers.
    method = dj.gossip.accelerated_sgd(beta=1.5 if change == "method" else 2.0)
    return dj.simulate_gossip(loss or (_other_loss if change == "loss_fn" else _loss), tx, method,
                              jnp.zeros(3, jnp.float32), data, sched, **options)
  sched = dj.cluster.pipeline("1f1b", 2, 24, num_microbatches=2)
  stages = [_stage0, (lambda p, h: jnp.tanh(h @ p["w"])) if change == "stage_fns" else _stage1]
  params = [{"s": jnp.ones(3, jnp.float32)}, {"w": jnp.zeros(3, jnp.float32)}]
  pipe_loss = (lambda h, b: jnp.mean(jnp.abs(h - b["y"]))) if change == "loss_fn" else _pipe_loss
  return dj.simulate_pipeline(stages, loss or pipe_loss, tx, params, data, sched, **options)


def _params(result):
  return jax.tree.leaves(result.params)


RUNTIMES = ["simulate", "gossip", "pipeline"]
# The functions each runtime's identity must cover (every one that changes the numbers).
FUNCTIONS = {"simulate": ["loss_fn", "tx", "eval_fn"], "gossip": ["loss_fn", "tx", "eval_fn", "method"],
             "pipeline": ["loss_fn", "tx", "eval_fn", "stage_fns"]}


class _Stop(Exception):
  pass


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_an_interrupted_run_resumes_bit_identically(runtime, tmp_path):
  whole = _run(runtime, evaluate=True)
  calls = []

  def stop_after_two(info):
    calls.append(info)
    if len(calls) == 2:
      raise _Stop

  with pytest.raises(_Stop):
    _run(runtime, evaluate=True, checkpoint=dj.Checkpoint(tmp_path), callback=stop_after_two)
  resumed = _run(runtime, evaluate=True, checkpoint=dj.Checkpoint(tmp_path))
  for a, b in zip(_params(whole), _params(resumed), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for a, b in zip(jax.tree.leaves(whole.history.eval_metrics), jax.tree.leaves(resumed.history.eval_metrics),
                  strict=True):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(whole.history.loss, resumed.history.loss)


@pytest.mark.parametrize("runtime,function", [(r, f) for r in RUNTIMES for f in FUNCTIONS[r]])
def test_resuming_with_another_function_is_refused_by_name(runtime, function, tmp_path):
  first = _run(runtime, evaluate=True, checkpoint=dj.Checkpoint(tmp_path))
  with pytest.raises(ValueError, match=f"different run: .*{function}"):
    _run(runtime, evaluate=True, change=function, checkpoint=dj.Checkpoint(tmp_path))
  # Knowingly changed: the change is allowed by name, and the finished run is returned from its checkpoint.
  again = _run(runtime, evaluate=True, change=function, checkpoint=dj.Checkpoint(tmp_path, changes=(function,)))
  for a, b in zip(_params(first), _params(again), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_nan_example_is_reported(runtime):
  bad = {k: v.copy() for k, v in DATA.items()}
  bad["x"][5] = np.nan
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    result = _run(runtime, data=bad, sampling=dj.Sampling(batch_size=64))
  assert len(result.history.nonfinite) > 0
  assert result.history.nonfinite_state is not None
  assert any(issubclass(w.category, RuntimeWarning) and "not finite" in str(w.message) for w in caught)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_skipping_is_defined_by_the_server_runtime_only(runtime):
  bad = {k: v.copy() for k, v in DATA.items()}
  bad["x"][5] = np.nan
  if runtime == "simulate":
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", RuntimeWarning)
      result = _run(runtime, data=bad, nonfinite="skip")
    assert all(np.all(np.isfinite(p)) for p in _params(result))
    return
  with pytest.raises(ValueError, match="nonfinite='skip' is defined for dj.simulate only"):
    _run(runtime, data=bad, nonfinite="skip")


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_evaluations_only_history_keeps_no_rows_and_the_same_numbers(runtime):
  full = _run(runtime, evaluate=True)
  evals = _run(runtime, evaluate=True, history="evaluations")
  assert len(evals.history.loss) == 0 and len(full.history.loss) > 0
  for a, b in zip(_params(full), _params(evals), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for a, b in zip(jax.tree.leaves(full.history.eval_metrics), jax.tree.leaves(evals.history.eval_metrics),
                  strict=True):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_the_callback_is_called_after_every_chunk(runtime):
  seen = []
  _run(runtime, callback=seen.append)
  assert seen and [info["chunk"] for info in seen] == list(range(len(seen)))
  assert all(info["num_chunks"] == len(seen) for info in seen)
  assert len(seen) > 1  # chunks of 4 steps


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_the_callback_is_given_each_chunks_rows_as_the_history_keeps_them(runtime):
  seen = []
  result = _run(runtime, evaluate=True, callback=seen.append)
  loss = np.concatenate([info["rows"]["loss"] for info in seen])
  np.testing.assert_array_equal(loss, np.asarray(result.history.loss)[-len(loss):])
  # The evaluations after the first (made before any chunk) arrive chunk by chunk.
  metrics = np.concatenate([info["rows"]["metrics"]["loss"] for info in seen])
  np.testing.assert_array_equal(metrics, np.asarray(result.history.eval_metrics["loss"])[1:])
  assert metrics.size > 1


_HOLD_LOCK = textwrap.dedent("""
    import sys, time
    from delayjax.runtime._lock import locked
    with locked(sys.argv[1], sys.argv[2]):
      print("held", flush=True)
      time.sleep(60)
""")

_CHECKPOINT_NAMES = {"simulate": "simulate", "gossip": "simulate_gossip", "pipeline": "pipeline"}


@pytest.mark.slow
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_live_writer_is_refused_and_a_killed_one_is_taken_over(runtime, tmp_path):
  holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(tmp_path), _CHECKPOINT_NAMES[runtime]],
                            stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(ValueError, match=f"in use by a live run \\(pid {holder.pid} "):
      _run(runtime, checkpoint=dj.Checkpoint(tmp_path))
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
  # The killed holder's lock is free: the run goes ahead, and writes its checkpoint.
  result = _run(runtime, checkpoint=dj.Checkpoint(tmp_path))
  assert all(np.all(np.isfinite(p)) for p in _params(result))
  assert os.path.isdir(tmp_path / _CHECKPOINT_NAMES[runtime])


def _big_run(runtime, size):
  """A run whose state holds several copies of a ``size``-float model, built (data included) before the
  call: ``_big_run(...)(execution)`` makes only the call."""
  w = jnp.zeros(size, jnp.float32)
  data = {"x": np.zeros((8, 1), np.float32), "y": np.zeros(8, np.float32)}

  def loss(w, batch):
    return jnp.mean(w) * jnp.mean(batch["x"] - batch["y"])

  if runtime == "simulate":
    sched = dj.cluster.simulate(dj.cluster.asp(), dj.cluster.workers(4, seed=0), num_updates=8, seed=0)
    return lambda execution: dj.simulate(loss, optax.sgd(0.1), w, data, sched, execution=execution)
  if runtime == "gossip":
    sched = dj.cluster.simulate_gossip(dj.cluster.d_psgd(dj.topology.ring(4)), dj.cluster.workers(4, seed=0),
                                       num_steps=4, seed=0)
    return lambda execution: dj.simulate_gossip(loss, optax.sgd(0.1), dj.gossip.d_psgd(), w, data, sched,
                                                execution=execution)
  sched = dj.cluster.pipeline("1f1b", 2, 8, num_microbatches=2)
  stages = [lambda p, h: h * p["s"], lambda p, h: h * jnp.mean(p["w"])]
  params = [{"s": jnp.ones(1, jnp.float32)}, {"w": w}]
  return lambda execution: dj.simulate_pipeline(stages, lambda h, b: jnp.mean((h[:, 0] - b["y"]) ** 2),
                                                optax.sgd(0.1), params, data, sched, execution=execution)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_run_too_large_is_refused_before_its_state_is_allocated(runtime, monkeypatch):
  # Copies of a 2**22-float model (16 MiB each: replicas, versions, buffers), refused at a 1 MiB limit while
  # allocating on the host less than one copy: the state is sized from shapes, not made and measured.
  big = 2 ** 22
  call = _big_run(runtime, big)
  ran = []
  monkeypatch.setattr(_engine, "run", lambda *a, **k: ran.append(a))
  tracemalloc.start()
  try:
    with pytest.raises(ValueError, match="would keep .* more than 1.0 MiB \\(Execution.max_memory\\)"):
      call(dj.Execution(max_memory=2 ** 20))
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
  assert not ran
  assert peak < 4 * big


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_the_default_limit_on_a_cpu_is_the_available_memory(runtime, monkeypatch):
  monkeypatch.setattr(_engine, "available_memory", lambda: 2 ** 21)
  with pytest.raises(ValueError, match="the memory this machine has available, 2.0 MiB"):
    _big_run(runtime, 2 ** 20)(dj.Execution())


def _needs_worker():
  def update(updates, state, params=None, *, worker=None, **extra):
    del extra
    if worker is None:
      raise ValueError("this transformation needs the extra argument worker= (the pushing worker)")
    return updates, state
  return optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_tx_needing_an_argument_the_runtime_does_not_pass_is_refused_naming_the_runtime(runtime):
  if runtime == "simulate":
    # The server runtime passes worker: the same transformation trains.
    assert all(np.all(np.isfinite(p)) for p in _params(_run(runtime, tx=optax.chain(_needs_worker(),
                                                                                    optax.sgd(0.1)))))
    return
  name = {"gossip": "dj.simulate_gossip", "pipeline": "dj.simulate_pipeline"}[runtime]
  with pytest.raises(ValueError, match=f"tx needs the extra argument worker, which {name} does not pass"):
    _run(runtime, tx=optax.chain(_needs_worker(), optax.sgd(0.1)))


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("option", ["sampling", "record", "checkpoint", "execution"])
def test_an_option_of_the_wrong_type_names_the_keyword_and_its_class(runtime, option):
  with pytest.raises(TypeError, match=f"{option} must be a dj\\.(Sampling|Record|Checkpoint|Execution)"):
    _run(runtime, **{option: {"batch_size": 8}})


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_several_runs_in_one_call_equal_their_single_calls(runtime):
  runs = dj.Runs(seeds=[0, 1])
  results = _run(runtime, seed=runs)
  single = [_run(runtime, seed=s) for s in (0, 1)]
  for batched, alone in zip(results, single, strict=True):
    for x, y in zip(jax.tree.leaves(batched.params), jax.tree.leaves(alone.params), strict=True):
      if runtime == "simulate":
        # One vmap-ed program: to float rounding.
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)
      else:
        # Every run by a call of its own of the single run's program: bit for bit.
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert not all(np.array_equal(np.asarray(x), np.asarray(y))
                 for x, y in zip(jax.tree.leaves(results[0].params), jax.tree.leaves(results[1].params), strict=True))


@pytest.mark.parametrize("runtime,option", [("gossip", "lanes"), ("pipeline", "lanes"), ("pipeline", "phases"),
                                            ("simulate", "phases")])
def test_an_option_without_effect_is_an_error_naming_it(runtime, option):
  with pytest.raises(ValueError, match=f"Execution.{option}=2 has no effect in dj.simulate"):
    _run(runtime, execution=dj.Execution(**{option: 2}))


def test_every_without_an_evaluation_is_an_error():
  with pytest.raises(ValueError, match="Record.every=10 has no effect without Record.eval_fn"):
    dj.Record(every=10)


@pytest.mark.parametrize("runtime", ["simulate", "gossip"])
def test_a_loss_with_aux_trains_exactly_like_the_loss_alone(runtime):
  plain = _run(runtime)
  with_aux = _run(runtime, loss=lambda w, b: (_loss(w, b), {"norm": jnp.sum(w ** 2)}))
  for a, b in zip(_params(plain), _params(with_aux), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("runtime", ["simulate", "gossip"])
def test_a_loss_that_is_not_a_scalar_is_refused_naming_loss_fn(runtime):
  with pytest.raises(ValueError, match="loss_fn\\(params, batch\\) must return a real scalar loss.*float32\\[8\\]"):
    _run(runtime, loss=lambda w, b: b["x"] @ w)
