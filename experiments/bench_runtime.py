"""Throughput of ``dj.simulate`` against a synchronous loop, a Python-loop simulator, and on 8 devices.

For an MLP (64-256-10) and a small CNN on scikit-learn digits, batch 32 per
worker, and clusters of M in {4, 16, 64} workers (``dj.cluster.workers(M)``)
under ASP and SSP(3) with exponential compute times, and ASP with equal ones,
it measures gradient evaluations per second (medians over chunks, rounds or blocks of pushes, so
that other processes briefly sharing the CPUs skew them less) of

- ``dj.simulate`` on one CPU device (compilation excluded: the first chunk is
  left out);
- (a) a plain synchronous Optax loop doing as many batch-32 gradient
  evaluations (and updates) in one jitted ``lax.scan``;
- (b) a straightforward simulator: a Python loop over pushes, one jitted
  gradient-and-update per push on a copy of the stale parameters;
- (c) ``dj.simulate`` on 8 CPU devices (``shard_map`` over a ``workers`` mesh),
  run in a subprocess with ``--xla_force_host_platform_device_count=8``;

and the peak memory of the compiled chunk against the synchronous loop's,
from XLA's memory analysis (arguments + outputs + temporaries - aliased).
Prints the ratios (and writes them to ``--out FILE``; the published table is
``experiments/results/bench_runtime.txt``).

    python -m experiments.bench_runtime [--quick] [--out experiments/results/bench_runtime.txt]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import delayjax as dj
from ._bench import add_out_argument, best_times, publish

BATCH = 32


def digits_data():
  from sklearn.datasets import load_digits

  x, y = load_digits(return_X_y=True)
  return {"x": (x / 16.0).astype(np.float32), "y": y.astype(np.int32)}


def mlp():
  def init(key):
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (64, 256)) * jnp.sqrt(2.0 / 64), "b1": jnp.zeros(256),
            "w2": jax.random.normal(k2, (256, 10)) * jnp.sqrt(2.0 / 256), "b2": jnp.zeros(10)}

  def loss_fn(params, batch):
    h = jax.nn.relu(batch["x"] @ params["w1"] + params["b1"])
    logits = h @ params["w2"] + params["b2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  return init, loss_fn


def cnn():
  """conv 3x3x8 - conv 3x3x16 stride 2 - dense 10, on 8x8 images.

  The convolutions are written as patches times a matrix: XLA's CPU
  convolutions are several times slower inside a loop (``lax.scan``) than at
  the top level of a program, which would make every looped runtime here
  look worse than a Python loop for reasons that have nothing to do with it.
  """

  def init(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return {"c1": jax.random.normal(k1, (3, 3, 1, 8)) * jnp.sqrt(2.0 / 9), "b1": jnp.zeros(8),
            "c2": jax.random.normal(k2, (3, 3, 8, 16)) * jnp.sqrt(2.0 / 72), "b2": jnp.zeros(16),
            "w": jax.random.normal(k3, (256, 10)) * jnp.sqrt(1.0 / 256), "b": jnp.zeros(10)}

  def conv(x, w, stride):
    patches = jax.lax.conv_general_dilated_patches(x, (3, 3), (stride, stride), "SAME",
                                                   dimension_numbers=("NHWC", "HWIO", "NHWC"))
    # Patches come channel-major (c, kh, kw): order the weights the same way.
    return patches @ w.transpose(2, 0, 1, 3).reshape(-1, w.shape[-1])

  def loss_fn(params, batch):
    x = batch["x"].reshape(-1, 8, 8, 1)
    x = jax.nn.relu(conv(x, params["c1"], 1) + params["b1"])
    x = jax.nn.relu(conv(x, params["c2"], 2) + params["b2"])
    logits = x.reshape(x.shape[0], -1) @ params["w"] + params["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  return init, loss_fn


MODELS = {"mlp": mlp, "cnn": cnn}
# name -> (paradigm, compute-time model of dj.cluster.workers)
PARADIGMS = {
    "asp": (dj.cluster.asp, "exponential"),
    "ssp3": (lambda: dj.cluster.ssp(3), "exponential"),
    # Equal speeds: the best case, full waves of M gradients.
    "asp=": (dj.cluster.asp, "constant"),
}


def peak_bytes(compiled) -> int:
  m = compiled.memory_analysis()
  return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def tx():
  return optax.sgd(0.05)


def schedule_for(paradigm: str, num_workers: int, num_updates: int):
  make, compute = PARADIGMS[paradigm]
  return dj.cluster.simulate(make(), dj.cluster.workers(num_workers, compute=compute), num_updates=num_updates,
                             seed=0)


def time_simulate(model: str, paradigm: str, num_workers: int, num_updates: int, mesh=None):
  """Gradient evaluations per second of dj.simulate, compilation excluded; and the chunk's peak memory."""
  init, loss_fn = MODELS[model]()
  data = digits_data()
  schedule = schedule_for(paradigm, num_workers, num_updates)
  from delayjax.runtime._waves import plan_steps
  devices = 1 if mesh is None else mesh.shape["workers"]
  workers = -(-num_workers // devices) * devices
  plan = plan_steps(schedule, workers, devices)
  chunk_size = max(1, plan.num_steps // 8)
  marks, memory = [], {}

  def inspect(fn, args):
    memory["peak"] = peak_bytes(fn.lower(*args).compile())

  start = time.perf_counter()
  with dj.runtime._engine.inspecting(inspect):
    result = dj.simulate(loss_fn, tx(), init(jax.random.key(0)), data, schedule, sampling=dj.Sampling(BATCH),
                         record=dj.Record(callback=lambda info: marks.append(
                             (time.perf_counter(), info["updates_done"]))),
                         execution=dj.Execution(mesh=mesh, chunk_size=chunk_size))
  total = time.perf_counter() - start
  # The median over chunks (the first, which compiles, left out): robust to
  # other processes sharing the CPUs for a while.
  rates = [int(schedule.num_batches[u0:u1].sum()) / (t1 - t0) for (t0, u0), (t1, u1) in zip(marks[:-1], marks[1:])]
  return {"rate": float(np.median(rates)), "peak": memory["peak"], "total_s": total,
          "utilization": result.stats["lane_utilization"], "lanes": result.stats["lanes"],
          "mean_wave": result.stats["mean_wave_length"], "loss": float(result.history.loss[-50:].mean())}


def time_sync(model: str, steps: int, rounds: int = 5):
  """Synchronous Optax loop: `steps` batch-32 gradients and updates in one jitted lax.scan."""
  loop, params = sync_loop(model, steps)
  peak = peak_bytes(loop.lower(params).compile())
  jax.block_until_ready(loop(params))
  times = []
  for _ in range(rounds):
    start = time.perf_counter()
    jax.block_until_ready(loop(params))
    times.append(time.perf_counter() - start)
  return {"rate": steps / float(np.median(times)), "peak": peak}


def sync_loop(model: str, steps: int):
  """The plain synchronous loop, jitted, and its initial parameters: `steps` batch-32 gradients and updates."""
  init, loss_fn = MODELS[model]()
  data = jax.tree.map(jnp.asarray, digits_data())
  n = data["x"].shape[0]
  opt = tx()

  @jax.jit
  def loop(params):
    def step(carry, t):
      params, state = carry
      idx = dj.runtime.minibatch_indices(0, t, 0, 0, num_examples=n, batch_size=BATCH)
      grads = jax.grad(loss_fn)(params, jax.tree.map(lambda x: x[idx], data))
      updates, state = opt.update(grads, state, params)
      return (optax.apply_updates(params, updates), state), None
    return jax.lax.scan(step, (params, opt.init(params)), jnp.arange(steps, dtype=jnp.int32))[0][0]

  return loop, init(jax.random.key(0))


def time_python_loop(model: str, paradigm: str, num_workers: int, num_updates: int):
  """The straightforward simulator: stale parameter copies in a deque, one jitted call per push."""
  init, loss_fn = MODELS[model]()
  data = jax.tree.map(jnp.asarray, digits_data())
  n = data["x"].shape[0]
  schedule = schedule_for(paradigm, num_workers, num_updates)
  opt = tx()

  @jax.jit
  def push(params, state, stale, u, m, draw):
    idx = dj.runtime.minibatch_indices(0, u, m, draw, num_examples=n, batch_size=BATCH)
    grads = jax.grad(loss_fn)(stale, jax.tree.map(lambda x: x[idx], data))
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params = init(jax.random.key(0))
  state = opt.init(params)
  depth = int(schedule.staleness.max()) + 1
  versions = [params]  # versions[-1] is the current one; the deque keeps the last `depth`
  offset = 0
  drawn = np.zeros(schedule.num_workers, np.int64)
  warm, block = 20, 50
  marks = []
  for u in range(schedule.num_updates):
    if u >= warm and (u - warm) % block == 0:
      jax.block_until_ready(params)
      marks.append(time.perf_counter())
    (m,) = np.flatnonzero(schedule.contributes[u])  # ASP and SSP: one push per update
    stale = versions[int(schedule.read_version[u, m]) - offset]
    params, state = push(params, state, stale, u, int(m), int(drawn[m]))
    drawn[m] += 1
    versions.append(params)
    if len(versions) > depth:
      versions.pop(0)
      offset += 1
  return {"rate": block / float(np.median(np.diff(marks)))}


def gossip_schedule(num_workers: int, rounds: int):
  """Synchronous D-PSGD rounds on a ring (one mix of all replicas per round), equal compute times."""
  return dj.cluster.simulate_gossip(dj.cluster.d_psgd(dj.topology.ring(num_workers)),
                                    dj.cluster.workers(num_workers, compute="constant"), num_steps=rounds, seed=0)


def time_replicas(model: str, num_workers: int, rounds: int, python_rounds: int, timing_rounds: int = 5):
  """Gradient evaluations per second of dj.simulate_gossip (D-PSGD, ring), of the plain synchronous loop doing
  as many gradients (the two timed in interleaved rounds, best of each), and of a Python-loop gossip simulator."""
  init, loss_fn = MODELS[model]()
  data = digits_data()
  schedule = gossip_schedule(num_workers, rounds)
  captured = {}

  def inspect(fn, args):
    captured["fn"], captured["args"] = fn, jax.tree.map(jnp.copy, args)

  with dj.runtime._engine.inspecting(inspect):
    result = dj.simulate_gossip(loss_fn, tx(), dj.gossip.d_psgd(), init(jax.random.key(0)), data, schedule,
                                sampling=dj.Sampling(BATCH), execution=dj.Execution(chunk_size=rounds))
  fn, (carry, constants, tables) = captured["fn"], captured["args"]
  grads = int(np.asarray(tables["lane_active"]).sum())  # the gradients one chunk computes
  loop, start = sync_loop(model, grads)
  # The chunk donates its carry: each call gets a fresh copy (a few passes over the replicas, counted).
  best = best_times({"gossip": lambda: fn(jax.tree.map(jnp.copy, carry), constants, tables),
                            "sync": lambda: loop(start)}, timing_rounds)

  # The straightforward simulator: a Python loop over events, one jitted call per gradient and per mix row.
  small = gossip_schedule(num_workers, python_rounds)
  jdata = jax.tree.map(jnp.asarray, data)
  n = jdata["x"].shape[0]
  opt = tx()

  @jax.jit
  def apply(params, state, snap, i, draw):
    idx = dj.runtime.minibatch_indices(0, 0, i, draw, num_examples=n, batch_size=BATCH)
    grads = jax.grad(loss_fn)(snap, jax.tree.map(lambda x: x[idx], jdata))
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  @jax.jit
  def combine(rows, weights):
    return jax.tree.map(lambda *xs: sum(w * x for w, x in zip(weights, xs)), *rows)

  params = [init(jax.random.key(0))] * num_workers
  states = [opt.init(params[0])] * num_workers
  snaps, drawn, stamps = list(params), np.zeros(num_workers, np.int64), []
  for e in range(small.num_events):
    kind = small.kind[e]
    if kind == dj.cluster.READ:
      snaps[small.worker[e]] = params[small.worker[e]]
    elif kind == dj.cluster.GRAD:
      i = int(small.worker[e])
      params[i], states[i] = apply(params[i], states[i], snaps[i], i, int(drawn[i]))
      drawn[i] += 1
    else:
      k = small.mix[e]
      members = small.members[k][small.members[k] >= 0]
      new = {}
      for a, dst in enumerate(members):
        nz = np.flatnonzero(small.weights[k, a, :len(members)])
        new[dst] = combine(tuple(params[members[b]] for b in nz),
                           tuple(jnp.float32(small.weights[k, a, b]) for b in nz))
      params = [new.get(i, p) for i, p in enumerate(params)]
      jax.block_until_ready(params)
      stamps.append(time.perf_counter())
  py_rates = num_workers / np.diff(stamps[2:])  # one round of M gradients between mixes; warm-up left out
  return {"rate": grads / best["gossip"], "sync": grads / best["sync"], "python": float(np.median(py_rates)),
          "utilization": result.stats["lane_utilization"], "mixing": result.stats["mixing"]}


def replica_lines(model: str = "mlp", quick: bool = False) -> list[str]:
  """The replica runtime's rows: M = 16 and 64 replicas against the plain loop and the Python loop."""
  lines = ["", "dj.simulate_gossip (D-PSGD on a ring, sgd, batch 32 per replica, digits, one CPU device): "
           "gradient evaluations per second",
           f"{'model':5s} {'M':>3s} {'rounds':>6s} {'gossip/s':>8s} {'sync/s':>7s} {'(d)g/sync':>9s} {'py/s':>6s} "
           f"{'(e)g/py':>7s} {'mixing':>6s}"]
  for m, rounds in ((16, 100 if quick else 300), (64, 40 if quick else 120)):
    r = time_replicas(model, m, rounds, python_rounds=6)
    lines.append(f"{model:5s} {m:3d} {rounds:6d} {r['rate']:8.0f} {r['sync']:7.0f} {r['rate'] / r['sync']:9.2f} "
                 f"{r['python']:6.0f} {r['rate'] / r['python']:7.1f} {r['mixing']:>6s}")
    print(lines[-1], flush=True)
  lines += ["(d) sync: the plain synchronous loop above doing as many gradients, timed in interleaved rounds with",
            "    the replica runtime's compiled chunk (best of 5 each); target >= 0.8",
            "(e) py: a Python loop over the gossip events, one jitted call per gradient and per mixing row; "
            "target >= 3"]
  return lines


def second_call_lines(model: str = "mlp", paradigm: str = "asp", num_workers: int = 16,
                      num_updates: int = 16384) -> list[str]:
  """What an identical second ``dj.simulate`` call pays beyond its steady-state compute.

  The compute is the call's gradients at the median rate of its chunks; the rest (planning, placing, the
  cache look-up, the first dispatch, collecting the history) is overhead. The first call is timed too.
  """
  init, loss_fn = MODELS[model]()
  data = digits_data()
  schedule = schedule_for(paradigm, num_workers, num_updates)
  params = init(jax.random.key(0))
  timed = []
  for _ in range(3):
    marks = []
    start = time.perf_counter()
    result = dj.simulate(loss_fn, tx(), params, data, schedule, sampling=dj.Sampling(BATCH),
                         record=dj.Record(callback=lambda info: marks.append((time.perf_counter(),
                                                                              info["updates_done"]))),
                         execution=dj.Execution(chunk_size=256))
    jax.block_until_ready(result.params)
    total = time.perf_counter() - start
    rates = [int(schedule.num_batches[u0:u1].sum()) / (t1 - t0) for (t0, u0), (t1, u1) in zip(marks[:-1], marks[1:])]
    compute = int(schedule.num_batches.sum()) / float(np.median(rates))
    timed.append((total, compute))
  (first, _), *again = timed
  total, compute = min(again, key=lambda tc: tc[0] - tc[1])
  lines = ["", f"identical second call ({model}, {paradigm}, M = {num_workers}, {num_updates} updates, chunks of 256 "
           "steps): seconds",
           f"first call {first:.2f}, second call {total:.2f} = compute {compute:.2f} + overhead {total - compute:.2f} "
           "(target: overhead <= 0.3; best of 2 repeats)"]
  print("\n".join(lines[1:]), flush=True)
  return lines


# XLA compilations so far (one listener for the process: JAX 0.8 cannot unregister one).
_COMPILES: list[str] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, *_, **__: _COMPILES.append(event) if event == "/jax/core/compile/backend_compile_duration" else None)


def sweep_lines(model: str = "mlp", paradigm: str = "asp", num_workers: int = 16, num_updates: int = 1000,
                runs: int = 6) -> list[str]:
  """A sweep over seeds, each run with a schedule of its own (``dj.cluster.simulate(..., seed=s)``), as the
  reproductions run them: XLA compilations and seconds per call, with the plan's sizes rounded up (what
  ``dj.simulate`` does) against the plan's own sizes (a program per distinct plan), in one process."""
  from delayjax.runtime import _engine, _simulate

  init, loss_fn = MODELS[model]()
  data = digits_data()
  make, compute = PARADIGMS[paradigm]
  schedules = [dj.cluster.simulate(make(), dj.cluster.workers(num_workers, compute="gamma"), num_updates, seed=s)
               for s in range(runs)]
  params = init(jax.random.key(0))

  def sweep():
    _engine.clear_cache()
    seconds = []
    for seed, schedule in enumerate(schedules):
      if seed == 1:
        # The first call also compiles what every later one reuses whatever the sizes (module-level programs).
        before = len(_COMPILES)
      start = time.perf_counter()
      jax.block_until_ready(dj.simulate(loss_fn, tx(), params, data, schedule, seed=seed,
                                        sampling=dj.Sampling(BATCH)).params)
      seconds.append(time.perf_counter() - start)
    return len(_COMPILES) - before, seconds

  rounded = sweep()
  saved = _simulate._program_sizes, _simulate._shared_length
  _simulate._program_sizes, _simulate._shared_length = functools.partial(saved[0], rounded=False), lambda n: n
  try:
    own = sweep()
  finally:
    _simulate._program_sizes, _simulate._shared_length = saved
  lines = ["", f"a sweep of {runs} seeds, each with its own schedule ({model}, {paradigm}, M = {num_workers}, gamma "
           f"compute times, {num_updates} updates): XLA compilations in the calls after the first and seconds per call",
           *(f"{name:>13s}: {n:3d} compilations, {np.mean(sec[1:]):.2f} s per later call (first {sec[0]:.2f} s)"
             for name, (n, sec) in (("rounded sizes", rounded), ("plan's own", own))),
           f"ratio of later calls' time, own / rounded: {np.mean(own[1][1:]) / np.mean(rounded[1][1:]):.1f}"]
  print("\n".join(lines[1:]), flush=True)
  return lines


def batched_lines(model: str = "mlp", paradigm: str = "asp", num_workers: int = 16, num_updates: int = 4096,
                  runs: int = 8, rounds: int = 2) -> list[str]:
  """Throughput of ``runs`` seeds computed as one program (``seed=dj.Runs(seeds=[...])``) against as many calls in
  sequence, both compiled beforehand (best of ``rounds`` alternating rounds)."""
  init, loss_fn = MODELS[model]()
  data = digits_data()
  schedule = schedule_for(paradigm, num_workers, num_updates)
  params = init(jax.random.key(0))
  seeds = list(range(runs))

  def call(seed):
    seed = dj.Runs(seeds=seed) if isinstance(seed, list) else seed
    out = dj.simulate(loss_fn, tx(), params, data, schedule, seed=seed, sampling=dj.Sampling(BATCH))
    return [r.params for r in out] if isinstance(out, list) else out.params

  best = best_times({"batched": lambda: call(seeds), "sequence": lambda: [call(s) for s in seeds]}, rounds)
  grads = runs * int(schedule.num_batches.sum())
  lines = ["", f"{runs} runs (seeds) of one schedule ({model}, {paradigm}, M = {num_workers}, {num_updates} updates "
           f"each), compiled beforehand, best of {rounds}: gradient evaluations per second",
           f"batched (one program, seed=dj.Runs(seeds=[0..{runs - 1}])) {grads / best['batched']:.0f}/s, {runs} calls "
           f"in sequence {grads / best['sequence']:.0f}/s: ratio {best['sequence'] / best['batched']:.2f}"]
  print("\n".join(lines[1:]), flush=True)
  return lines


def chunk_and_loop(model: str, paradigm: str, num_workers: int, num_updates: int):
  """``dj.simulate``'s compiled chunk with its arguments, the gradients it computes, and the plain loop doing as
  many (jitted) with its start."""
  init, loss_fn = MODELS[model]()
  data = digits_data()
  schedule = schedule_for(paradigm, num_workers, num_updates)
  captured = {}

  def inspect(fn, args):
    captured["fn"], captured["args"] = fn, jax.tree.map(jnp.copy, args)

  with dj.runtime._engine.inspecting(inspect):
    dj.simulate(loss_fn, tx(), init(jax.random.key(0)), data, schedule, sampling=dj.Sampling(BATCH),
                execution=dj.Execution(chunk_size=256))
  fn, (carry, constants, tables) = captured["fn"], captured["args"]
  grads = int(np.asarray(tables[0]["lane_active"]).sum())
  loop, start = sync_loop(model, grads)
  return fn, (carry, constants, tables), grads, loop, start


def ratio_lines(model: str = "mlp", paradigm: str = "asp", workers=(4, 16, 64), rounds: int = 7) -> list[str]:
  """(a) interleaved: one compiled chunk of 256 steps against the plain loop doing as many gradients, best of
  ``rounds`` rounds each, timed alternately in one process (the chunk is fed its own output carry, so it never
  copies one)."""
  lines = ["", f"(a) interleaved: dj.simulate's chunk of 256 steps / the plain loop doing as many gradients ({model}, "
           f"{paradigm}, one CPU device, best of {rounds} alternating rounds)",
           f"{'M':>3s} {'grads':>6s} {'sim/s':>7s} {'sync/s':>7s} {'(a)sim/sync':>11s}"]
  for m in workers:
    fn, (carry, constants, tables), grads, loop, start = chunk_and_loop(model, paradigm, m, {4: 1024, 16: 2048}.get(m, 4096))
    state = {"carry": carry}

    def chunk():
      state["carry"], out = fn(state["carry"], constants, tables)
      return out

    best = best_times({"sim": chunk, "sync": lambda: loop(start)}, rounds)
    lines.append(f"{m:3d} {grads:6d} {grads / best['sim']:7.0f} {grads / best['sync']:7.0f} "
                 f"{best['sync'] / best['sim']:11.2f}")
    print(lines[-1], flush=True)
  lines.append("targets: >= 0.90 at M >= 16, >= 0.80 at M = 4")
  return lines


def child(args):
  """Runs the 8-device measurements and prints one JSON line per configuration."""
  mesh = jax.make_mesh((len(jax.devices()),), ("workers",))
  for model, paradigm, m, updates in json.loads(args.child):
    r = time_simulate(model, paradigm, m, updates, mesh=mesh)
    print(json.dumps({"key": [model, paradigm, m], **r}), flush=True)


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true", help="fewer updates and configurations")
  parser.add_argument("--child", help=argparse.SUPPRESS)
  parser.add_argument("--replicas", action="store_true", help="only the replica runtime's rows")
  parser.add_argument("--overhead", action="store_true", help="only the second-call overhead, the (a) ratios "
                      "measured interleaved and the batched runs")
  add_out_argument(parser, "bench_runtime")
  args = parser.parse_args(argv)
  if args.child:
    return child(args)
  if args.replicas:
    print("\n".join(replica_lines(quick=args.quick)))
    return None
  if args.overhead:
    publish(second_call_lines(num_updates=4096 if args.quick else 16384)
            + sweep_lines(runs=4 if args.quick else 6)
            + ratio_lines(rounds=3 if args.quick else 7)
            + batched_lines(num_updates=1024 if args.quick else 4096)
            + ["", f"command: python -m experiments.bench_runtime --overhead{' --quick' if args.quick else ''}"],
            args.out)
    return None

  workers = (4, 16, 64)
  updates = {4: 1500, 16: 3000, 64: 6000} if not args.quick else {4: 600, 16: 1200, 64: 2400}
  python_updates = 300 if args.quick else 800
  configs = [(model, paradigm, m, updates[m]) for model in MODELS for paradigm in PARADIGMS for m in workers]

  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
  env["PYTHONPATH"] = os.pathsep.join([os.getcwd()] + [p for p in sys.path if p])
  proc = subprocess.Popen([sys.executable, "-m", f"{__package__}.bench_runtime", "--child", json.dumps(configs)],
                          env=env, stdout=subprocess.PIPE, text=True)
  eight_out, _ = proc.communicate()  # run first, alone, so the two do not share the CPUs
  eight = {tuple(r["key"]): r for r in map(json.loads, eight_out.splitlines()) if r}

  rows = []
  for model, paradigm, m, num_updates in configs:
    # Measured back to back for each configuration, so both see the same load.
    one = time_simulate(model, paradigm, m, num_updates)
    s = time_sync(model, num_updates)
    py = time_python_loop(model, paradigm, m, python_updates)
    e = eight.get((model, paradigm, m))
    rows.append((model, paradigm, m, one, s, py, e))
    print(f"{model} {paradigm} M={m}: simulate {one['rate']:.0f}/s, sync {s['rate']:.0f}/s, "
          f"python {py['rate']:.0f}/s, 8 devices {e['rate'] if e else float('nan'):.0f}/s", flush=True)

  lines = [
      "dj.simulate throughput: gradient evaluations per second (batch 32), digits, sgd; "
      "dj.cluster.workers(M): asp, ssp3 with exponential compute times, asp= with equal (constant) ones",
      f"jax {jax.__version__}, backend {jax.default_backend()}, {platform.processor() or platform.machine()}, "
      f"{os.cpu_count()} CPUs; {'--quick' if args.quick else 'full'} run; compile time excluded",
      "",
      f"{'model':5s} {'sched':5s} {'M':>3s} {'updates':>7s} {'sim/s':>7s} {'sync/s':>7s} {'(a)sim/sync':>11s} "
      f"{'py/s':>6s} {'(b)sim/py':>9s} {'8dev/s':>7s} {'(c)8/1':>6s} {'util':>5s} {'lanes':>5s} "
      f"{'mem sim/sync':>12s}",
  ]
  for model, paradigm, m, one, s, py, e in rows:
    eight_rate = e["rate"] if e else float("nan")
    lines.append(
        f"{model:5s} {paradigm:5s} {m:3d} {updates[m]:7d} {one['rate']:7.0f} {s['rate']:7.0f} "
        f"{one['rate'] / s['rate']:11.2f} {py['rate']:6.0f} {one['rate'] / py['rate']:9.1f} {eight_rate:7.0f} "
        f"{eight_rate / one['rate']:6.2f} {one['utilization']:5.2f} {one['lanes']:5d} "
        f"{one['peak'] / s['peak']:12.1f}")
  lines += [
      "",
      "(a) sync: one jitted lax.scan of as many batch-32 gradients + sgd updates; target >= 0.95",
      "(b) py: Python loop over pushes, stale copies in a deque, one jitted gradient+update per push; target >= 3",
      "(c) 8 CPU devices (shard_map over 'workers', subprocess) / 1 device; the 8 virtual devices share the same",
      "    CPU cores and each runs the replicated server loop: it pays only where gradients dominate",
      "util: fraction of computed gradient lanes that were real (the rest masked); lanes: per step",
      "mem: peak bytes of the compiled chunk / of the synchronous loop (XLA memory analysis)",
  ]
  lines += replica_lines(quick=args.quick)
  lines += second_call_lines(num_updates=4096 if args.quick else 16384)
  lines += sweep_lines(runs=4 if args.quick else 6)
  lines += ratio_lines(rounds=3 if args.quick else 7)
  lines += batched_lines(num_updates=1024 if args.quick else 4096)
  lines += ["", f"command: python -m experiments.bench_runtime{' --quick' if args.quick else ''} "
            f"(rates are medians; on shared CPUs expect +-15%)"]
  publish(lines, args.out)


if __name__ == "__main__":
  main()
