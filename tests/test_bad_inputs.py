"""One table of bad inputs, across the API and the CLI: each is an error of the right type naming the argument.

Every row is ``(id, call, exception type, text)``: ``call()`` must raise the
exception, and its message must contain ``text`` (the argument's name, and
where it helps what was given). Nothing here compiles a step: the checks run
before any compute.
"""

from __future__ import annotations

import contextlib
import io
import tempfile

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj

PARAMS = {"w": jnp.zeros(3), "b": jnp.zeros(())}
DATA = {"x": np.zeros((16, 3), np.float32), "y": np.zeros(16, np.float32)}


def loss_fn(params, batch):
  return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)


def _schedule(num_workers=4, num_updates=8):
  return dj.cluster.simulate(dj.cluster.asp(), dj.cluster.workers(num_workers, seed=0), num_updates=num_updates)


def simulate(**kw):
  args = {"loss_fn": loss_fn, "tx": optax.sgd(0.1), "params": PARAMS, "data": DATA, "source": _schedule()}
  args.update(kw)
  return dj.simulate(args.pop("loss_fn"), args.pop("tx"), args.pop("params"), args.pop("data"), args.pop("source"),
                     **args)


def _gossip_schedule():
  paradigm = dj.cluster.d_psgd(dj.topology.ring(4))
  return dj.cluster.simulate_gossip(paradigm, dj.cluster.workers(4, seed=0), num_steps=6)


def simulate_gossip(**kw):
  args = {"loss_fn": loss_fn, "tx": optax.sgd(0.1), "method": dj.gossip.d_psgd(), "params": PARAMS, "data": DATA,
          "schedule": _gossip_schedule(), "sampling": dj.Sampling(batch_size=4)}
  args.update(kw)
  return dj.simulate_gossip(args.pop("loss_fn"), args.pop("tx"), args.pop("method"), args.pop("params"),
                            args.pop("data"), args.pop("schedule"), **args)


def _stage(params, h):
  return h @ params["w"]


def simulate_pipeline(**kw):
  args = {"stage_fns": [_stage, _stage], "loss_fn": lambda h, batch: jnp.mean((h - batch["y"]) ** 2),
          "tx": optax.sgd(0.1), "params": [{"w": jnp.eye(3)}, {"w": jnp.ones(3)}], "data": DATA,
          "schedule": dj.cluster.pipeline("gpipe", 2, 3), "sampling": dj.Sampling(batch_size=4)}
  args.update(kw)
  return dj.simulate_pipeline(args.pop("stage_fns"), args.pop("loss_fn"), args.pop("tx"), args.pop("params"),
                              args.pop("data"), args.pop("schedule"), **args)


def _evaluate(params):
  return loss_fn(params, DATA)


def _vector_loss(params, batch):
  """A loss that is not a scalar (nor a (scalar, aux) pair): one value per example."""
  return (batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2


def cli(*argv):
  """``python -m experiments ARGV`` in this process: its error, as a ``SystemExit`` carrying what it printed."""
  from experiments.__main__ import main

  err = io.StringIO()
  with tempfile.TemporaryDirectory() as out, contextlib.redirect_stderr(err):
    try:
      code = main([*argv, "--out", out] if argv[:1] == ("run",) else list(argv))
    except SystemExit as e:
      code = e.code
  if code:
    raise SystemExit(f"exit {code}: {err.getvalue()}")


CASES = [
    # dj.delays
    ("delays.constant negative", lambda: dj.delays.constant(-1), ValueError, "tau"),
    ("delays.constant float", lambda: dj.delays.constant(2.5), TypeError, "tau"),
    ("delays.uniform negative", lambda: dj.delays.uniform(-2), ValueError, "max_delay"),
    ("delays.geometric p=0", lambda: dj.delays.geometric(0.0, 5), ValueError, "p"),
    ("delays.geometric p>1", lambda: dj.delays.geometric(1.5, 5), ValueError, "p"),
    ("delays.categorical zeros", lambda: dj.delays.categorical([0.0, 0.0]), ValueError, "probs"),
    ("delays.categorical negative", lambda: dj.delays.categorical([1.5, -0.5]), ValueError, "probs"),
    ("delays.trace negative", lambda: dj.delays.trace([1, -1]), ValueError, "delays"),
    ("delays.trace empty", lambda: dj.delays.trace([]), ValueError, "delays"),
    # dj.delayed
    ("delayed tx", lambda: dj.delayed("sgd", dj.delays.constant(1)), TypeError, "inner"),
    ("delayed delays", lambda: dj.delayed(optax.sgd(0.1), 3), TypeError, "delays"),
    ("delayed seed", lambda: dj.delayed(optax.sgd(0.1), dj.delays.constant(1), seed=-1), ValueError, "seed"),
    ("delayed store_stale_params", lambda: dj.delayed(optax.sgd(0.1), dj.delays.constant(1),
                                                      store_stale_params="yes"), TypeError, "store_stale_params"),
    # transformations
    ("scale_by_staleness rule", lambda: dj.scale_by_staleness("cubic"), ValueError, "rule"),
    ("scale_by_staleness a", lambda: dj.scale_by_staleness("polynomial", a=-1.0), ValueError, "a"),
    ("scale_by_staleness threshold", lambda: dj.scale_by_staleness("drop", threshold=-2), ValueError, "threshold"),
    ("delay_compensation lam", lambda: dj.delay_compensation(-0.5), ValueError, "lam"),
    ("delay_compensation momentum", lambda: dj.delay_compensation(adaptive=True, momentum=1.5), ValueError,
     "momentum"),
    ("delay_compensation num_workers", lambda: dj.delay_compensation(0.1, num_workers=0), ValueError, "num_workers"),
    ("dana momentum", lambda: dj.dana(0.1, momentum=-0.1), ValueError, "momentum"),
    ("dana num_workers", lambda: dj.dana(0.1, num_workers=0), ValueError, "num_workers"),
    ("dana num_workers float", lambda: dj.dana(0.1, num_workers=2.5), TypeError, "num_workers"),
    ("dana_slim momentum", lambda: dj.dana_slim(0.1, momentum=2.0), ValueError, "momentum"),
    ("fed_async mixing", lambda: dj.fed_async(1.5), ValueError, "mixing"),
    ("fed_async rule", lambda: dj.fed_async(0.5, "nope"), ValueError, "rule"),
    ("fed_buff buffer_size", lambda: dj.fed_buff(optax.sgd(1.0), buffer_size=0), ValueError, "buffer_size"),
    ("fed_buff server_optimizer", lambda: dj.fed_buff("sgd"), TypeError, "server_optimizer"),
    ("async_adam b2", lambda: dj.async_adam(0.1, b2=1.5), ValueError, "b2"),
    ("accumulate_sum k", lambda: dj.accumulate_sum(optax.sgd(0.1), 0), ValueError, "k"),
    ("saga num_samples", lambda: dj.saga(0), ValueError, "num_samples"),
    ("delay_adaptive_sgd policy", lambda: dj.delay_adaptive_sgd(0.1, 1.0, policy="nope"), ValueError, "policy"),
    ("mindthestep target_momentum", lambda: dj.mindthestep(0.1, 4, target_momentum=1.5), ValueError,
     "target_momentum"),
    ("spectrain smoothing", lambda: dj.spectrain(0.1, smoothing=1.5), ValueError, "smoothing"),
    ("pipemare warmup_steps", lambda: dj.pipemare(0.1, warmup_steps=-1), ValueError, "warmup_steps"),
    ("zeno_plus_plus rho", lambda: dj.zeno_plus_plus(0.1, rho=-1.0), ValueError, "rho"),
    ("prox_l1 strength", lambda: dj.prox_l1(-1.0), ValueError, "strength"),
    # dj.cluster
    ("workers num_workers", lambda: dj.cluster.workers(0), ValueError, "num_workers"),
    ("workers compute", lambda: dj.cluster.workers(4, compute="warp"), ValueError, "compute"),
    ("workers speed length", lambda: dj.cluster.workers(4, speed=[1.0, 2.0]), ValueError, "speed"),
    ("workers speed negative", lambda: dj.cluster.workers(2, speed=[1.0, -1.0]), ValueError, "speed"),
    ("workers seed", lambda: dj.cluster.workers(4, seed=-3), ValueError, "seed"),
    ("cluster.simulate paradigm", lambda: dj.cluster.simulate("asp", dj.cluster.workers(4), 10), TypeError,
     "paradigm"),
    ("cluster.simulate workers", lambda: dj.cluster.simulate(dj.cluster.asp(), 4, 10), TypeError, "workers"),
    ("cluster.simulate num_updates", lambda: dj.cluster.simulate(dj.cluster.asp(), dj.cluster.workers(4), 0),
     ValueError, "num_updates"),
    ("cluster.simulate seed", lambda: dj.cluster.simulate(dj.cluster.asp(), dj.cluster.workers(4), 10, seed=2**32),
     ValueError, "seed"),
    ("ssp staleness", lambda: dj.cluster.ssp(-1), ValueError, "staleness"),
    ("k_sync k", lambda: dj.cluster.k_sync(0), ValueError, "k"),
    ("k_async k", lambda: dj.cluster.k_async(0), ValueError, "k"),
    ("dssp bounds", lambda: dj.cluster.dssp(5, 2), ValueError, "s_upper"),
    ("backup_workers b", lambda: dj.cluster.backup_workers(-1), ValueError, "b"),
    ("exponential mean", lambda: dj.cluster.exponential(-1.0), ValueError, "mean"),
    ("uniform low high", lambda: dj.cluster.uniform(2.0, 1.0), ValueError, "high"),
    ("failures drop", lambda: dj.cluster.failures(drop=1.5), ValueError, "drop"),
    ("pipeline schedule", lambda: dj.cluster.pipeline("zigzag", 2, 3), ValueError, "schedule"),
    ("pipeline num_stages", lambda: dj.cluster.pipeline("gpipe", 0, 3), ValueError, "num_stages"),
    # dj.topology
    ("ring num_nodes", lambda: dj.topology.ring(1), ValueError, "num_nodes"),
    ("torus rows", lambda: dj.topology.torus(0, 3), ValueError, "rows"),
    ("random_regular degree", lambda: dj.topology.random_regular(5, 3), ValueError, "degree"),
    ("mixing_matrix rule", lambda: dj.topology.mixing_matrix(dj.topology.ring(4), "nope"), ValueError, "rule"),
    ("from_adjacency asymmetric shape", lambda: dj.topology.from_adjacency(np.ones((2, 3))), ValueError,
     "adjacency"),
    # dj.simulate
    ("simulate tx", lambda: simulate(tx="sgd"), TypeError, "tx"),
    ("simulate source", lambda: simulate(source=[1, 2]), TypeError, "source"),
    ("simulate Sampling.batch_size", lambda: simulate(sampling=dj.Sampling(batch_size=0)), ValueError,
     "Sampling.batch_size"),
    ("simulate seed negative", lambda: simulate(seed=-1), ValueError, "seed"),
    ("simulate seed large", lambda: simulate(seed=2**32), ValueError, "seed"),
    ("simulate Checkpoint.resume string", lambda: simulate(checkpoint=dj.Checkpoint("ckpt", resume="False")),
     TypeError, "Checkpoint.resume"),
    ("simulate Record.nonfinite string", lambda: simulate(record=dj.Record(nonfinite="False")), ValueError,
     "Record.nonfinite"),
    ("simulate Sampling.scheme", lambda: simulate(sampling=dj.Sampling(scheme="stratified")), ValueError,
     "Sampling.scheme"),
    ("simulate num_updates", lambda: simulate(num_updates=50), ValueError, "num_updates=50"),
    ("simulate Execution.chunk_size", lambda: simulate(execution=dj.Execution(chunk_size=0)), ValueError,
     "Execution.chunk_size"),
    ("simulate Record.every", lambda: simulate(record=dj.Record(eval_fn=_evaluate, every=0)), ValueError,
     "Record.every"),
    ("simulate Execution.mesh", lambda: simulate(execution=dj.Execution(mesh="devices")), TypeError,
     "Execution.mesh"),
    ("simulate Checkpoint.directory type", lambda: simulate(checkpoint=dj.Checkpoint(3)), TypeError,
     "Checkpoint.directory"),
    ("simulate Checkpoint.changes string", lambda: simulate(checkpoint=dj.Checkpoint("ckpt", changes="tx")),
     TypeError, "Checkpoint.changes"),
    ("simulate Record.every without eval_fn", lambda: simulate(record=dj.Record(every=5)), ValueError,
     "Record.eval_fn"),
    ("simulate per-worker table", lambda: simulate(tx=dj.dana(0.1, num_workers=2)), ValueError, "num_workers=4"),
    ("simulate data", lambda: simulate(data={"x": np.zeros((16, 3)), "y": np.zeros(15)}), ValueError, "data"),
    ("simulate LocalSteps.steps", lambda: simulate(worker=dj.workers.LocalSteps(0, optax.sgd(0.1))), ValueError,
     "LocalSteps.steps"),
    ("simulate Execution.max_memory", lambda: simulate(execution=dj.Execution(max_memory=-1)), ValueError,
     "Execution.max_memory"),
    ("simulate Record.history", lambda: simulate(record=dj.Record(history="steps")), ValueError,
     "Record.history must be one of 'updates', 'evaluations'; got 'steps'"),
    ("simulate record not a Record", lambda: simulate(record=5), TypeError, "record must be a dj.Record"),
    ("simulate worker not a plug-in", lambda: simulate(worker="local"), TypeError, "worker must be a dj.workers"),
    ("simulate loss not a scalar", lambda: simulate(loss_fn=_vector_loss), ValueError,
     "loss_fn(params, batch) must return a real scalar loss"),
    # dj.simulate_gossip
    ("gossip method", lambda: simulate_gossip(method="d_psgd"), TypeError, "method"),
    ("gossip schedule", lambda: simulate_gossip(schedule=_schedule()), TypeError, "schedule"),
    ("gossip seed negative", lambda: simulate_gossip(seed=-1), ValueError, "seed"),
    ("gossip Checkpoint.resume string", lambda: simulate_gossip(checkpoint=dj.Checkpoint("ckpt", resume="False")),
     TypeError, "Checkpoint.resume"),
    ("gossip Sampling.batch_size", lambda: simulate_gossip(sampling=dj.Sampling(batch_size=0)), ValueError,
     "Sampling.batch_size"),
    ("gossip Execution.phases", lambda: simulate_gossip(execution=dj.Execution(phases=0)), ValueError,
     "Execution.phases"),
    ("gossip Record.history", lambda: simulate_gossip(record=dj.Record(history="steps")), ValueError,
     "Record.history must be one of"),
    ("gossip Execution.lanes", lambda: simulate_gossip(execution=dj.Execution(lanes=2)), ValueError,
     "Execution.lanes"),
    ("gossip seed list", lambda: simulate_gossip(seed=[0, 1]), TypeError, "dj.Runs"),
    ("gossip Record.nonfinite skip", lambda: simulate_gossip(record=dj.Record(nonfinite="skip")), ValueError,
     "Record.nonfinite='skip'"),
    ("gossip record not a Record", lambda: simulate_gossip(record=5), TypeError, "record must be a dj.Record"),
    ("gossip loss not a scalar", lambda: simulate_gossip(loss_fn=_vector_loss), ValueError,
     "loss_fn(params, batch) must return a real scalar loss"),
    # dj.simulate_pipeline
    ("pipeline stage count", lambda: simulate_pipeline(stage_fns=[_stage]), ValueError, "stage_fns"),
    ("pipeline schedule type", lambda: simulate_pipeline(schedule=_schedule()), TypeError, "schedule"),
    ("pipeline seed large", lambda: simulate_pipeline(seed=2**32), ValueError, "seed"),
    ("pipeline Checkpoint.resume string", lambda: simulate_pipeline(checkpoint=dj.Checkpoint("ckpt", resume="no")),
     TypeError, "Checkpoint.resume"),
    ("pipeline data", lambda: simulate_pipeline(data={"y": np.zeros(4)}), ValueError, "data"),
    ("pipeline Record.history", lambda: simulate_pipeline(record=dj.Record(history=None)), ValueError,
     "Record.history must be one of"),
    ("pipeline Execution.phases", lambda: simulate_pipeline(execution=dj.Execution(phases=2)), ValueError,
     "Execution.phases"),
    ("pipeline checkpoint not a Checkpoint", lambda: simulate_pipeline(checkpoint="ckpt"), TypeError,
     "checkpoint must be a dj.Checkpoint"),
    # python -m experiments (in this process)
    ("cli unknown reproduction", lambda: cli("run", "nope"), SystemExit, "nope"),
    ("cli --set not a number", lambda: cli("run", "dc_asgd", "--set", "lr=abc"), SystemExit, "--set lr"),
    ("cli --set negative lr", lambda: cli("run", "dc_asgd", "--set", "lr=-1"), SystemExit, "--set lr"),
    ("cli --set unknown key", lambda: cli("run", "dc_asgd", "--set", "nope=1"), SystemExit, "nope"),
    ("cli --set choice", lambda: cli("run", "dc_asgd", "--set", "compute=fast"), SystemExit, "--set compute"),
    ("cli --set list entry", lambda: cli("run", "dssp", "--set", "speeds=[1, 0]"), SystemExit, "speeds[1]"),
    ("cli --scale", lambda: cli("run", "dc_asgd", "--scale", "huge"), SystemExit, "--scale"),
    ("cli --seed text", lambda: cli("run", "dc_asgd", "--seed", "x"), SystemExit, "--seed"),
    ("cli --steps float", lambda: cli("run", "dc_asgd", "--steps", "1.5"), SystemExit, "--steps"),
    ("cli no command", lambda: cli(), SystemExit, "usage"),
]


@pytest.mark.parametrize("call, error, text", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_a_clear_error_naming_the_argument(call, error, text):
  with pytest.raises(error) as info:
    call()
  message = str(info.value)
  assert text in message, message
  assert "Traceback" not in message


def test_the_table_covers_at_least_sixty_inputs():
  assert len(CASES) >= 60 and len({c[0] for c in CASES}) == len(CASES)
