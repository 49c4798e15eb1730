"""Cost of the transformations that keep a table (per sample, per worker) against plain SGD: written in place?

Two jitted ``lax.scan`` loops, each variant compiled first, then timed in
interleaved rounds (best round kept):

* single-example updates on a ridge-regression finite sum
  (``dj.problems.make_dense``, d = 200 features), with ``optax.sgd`` and with
  ``dj.saga(n)`` (a table of n x d gradients) or ``dj.saga(n,
  table="scalars")`` (n numbers) chained before it, n in {2000, 20000};
* single-example updates on a sparse logistic regression (n = 200000, d =
  5000, 8 nonzeros per row), with ``optax.sgd`` and with ``dj.prox_asaga``
  (a table of n scalars and a sum of d);
* updates of a 50000-parameter vector from M = 64 workers in turn, with
  ``optax.sgd`` with momentum and with ``dj.dana``, ``dj.dana_slim`` and
  DC-ASGD-a with per-worker mean squares (tables of M x 50000).

If a table were copied at every update, the time per update would grow with
its size (16 MB for the largest SAGA table, 12.8 MB per worker table);
written in place, it stays within a small factor of SGD's. Prints
microseconds per update and the ratio to the baseline (and writes them to
``--out FILE``; the published table is ``experiments/results/bench_tables.txt``).

    python -m experiments.bench_tables [--updates 4000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

import delayjax as dj
from ._bench import add_out_argument, best_times, publish

DIM = 200
WORKERS, PARAMS = 64, 50_000
SPARSE = dict(n=200_000, d=5_000, nnz=8)


def make_loop(problem: dj.problems.FiniteSum, tx, updates: int, extra_args: Callable[..., dict[str, Any]]):
  """Single-example updates; ``extra_args(w, batch, i, grad)`` gives ``tx`` its per-example inputs."""
  data = problem.data()
  n = problem.num_samples

  @jax.jit
  def loop(w):
    def step(carry, t):
      w, state = carry
      i = jax.random.randint(jax.random.key(t), (1,), 0, n)
      batch = jax.tree.map(lambda x: x[i], data)
      grad = jax.grad(problem.loss_fn)(w, batch)
      u, state = tx.update(grad, state, w, **extra_args(w, batch, i, grad))
      return (optax.apply_updates(w, u), state), None

    return jax.lax.scan(step, (w, tx.init(w)), jnp.arange(updates))[0][0]

  return loop


def no_inputs(w, batch, i, grad):
  return {}


def saga_inputs(problem: dj.problems.FiniteSum, scalars: bool):
  def extra_args(w, batch, i, grad):
    if scalars:
      terms = problem.per_sample(w, batch)
      return {"sample_indices": i, "sample_scalars": terms.scalars, "sample_features": terms.features}
    return {"sample_indices": i, "sample_grads": grad[None]}

  return extra_args


def prox_asaga_inputs(problem: dj.problems.FiniteSum):
  def extra_args(w, batch, i, grad):
    return {"sample_indices": i, "sample_scalars": problem.per_sample(w, batch).scalars,
            "sample_features": {"indices": batch["indices"], "values": batch["values"]}}

  return extra_args


def make_worker_loop(tx, updates: int):
  """``updates`` pushes from the workers in turn, each a fixed gradient scaled by the update index."""
  grad = jnp.ones(PARAMS)

  @jax.jit
  def loop(w):
    def step(carry, t):
      w, state = carry
      u, state = tx.update(grad * (t % 3).astype(grad.dtype), state, w, worker=t % WORKERS, staleness=t % 5,
                           stale_params=w)
      return (optax.apply_updates(w, u), state), None

    return jax.lax.scan(step, (w, tx.init(w)), jnp.arange(updates, dtype=jnp.int32))[0][0]

  return loop


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--updates", type=int, default=4000)
  parser.add_argument("--rounds", type=int, default=5)
  add_out_argument(parser, "bench_tables")
  args = parser.parse_args(argv)

  loops = {}
  for n in (2000, 20000):
    problem = dj.problems.make_dense("least_squares", n, DIM, lam=1e-3, seed=0)
    loops[f"sgd, n={n}"] = make_loop(problem, optax.sgd(1e-3), args.updates, no_inputs)
    loops[f"saga gradients table, n={n}"] = make_loop(problem, optax.chain(dj.saga(n), optax.sgd(1e-3)),
                                                      args.updates, saga_inputs(problem, False))
    loops[f"saga scalars table, n={n}"] = make_loop(
        problem, optax.chain(dj.saga(n, table="scalars"), optax.sgd(1e-3)), args.updates, saga_inputs(problem, True))
  baseline = {name: f"sgd, n={name.split('n=')[1]}" for name in loops}
  sparse = dj.problems.make_sparse("logistic", SPARSE["n"], SPARSE["d"], SPARSE["nnz"], lam=1e-4, seed=0)
  n = SPARSE["n"]
  loops[f"sgd, sparse, n={n}"] = make_loop(sparse, optax.sgd(0.1), args.updates, no_inputs)
  loops[f"prox_asaga, sparse, n={n}"] = make_loop(
      sparse, dj.prox_asaga(n, 0.1, dj.prox_l1(1e-4), support_counts=sparse.support_counts()), args.updates,
      prox_asaga_inputs(sparse))
  baseline.update({name: f"sgd, sparse, n={n}" for name in loops if "sparse" in name})
  sgd = lambda: optax.sgd(0.1, momentum=0.9)
  worker_loops = {
      "sgd with momentum, M=64": sgd(),
      "dana, M=64": dj.dana(0.1, 0.9, WORKERS),
      "dana_slim, M=64": dj.dana_slim(0.1, 0.9, WORKERS),
      "dc-asgd-a per worker + sgd, M=64": optax.chain(
          dj.delay_compensation(adaptive=True, num_workers=WORKERS), sgd()),
  }
  for name, tx in worker_loops.items():
    loops[name] = make_worker_loop(tx, args.updates)
    baseline[name] = "sgd with momentum, M=64"
  sizes = {name: PARAMS if name in worker_loops else SPARSE["d"] if "sparse" in name else DIM for name in loops}
  runs = {name: functools.partial(loop, jnp.zeros(sizes[name])) for name, loop in loops.items()}
  best = best_times(runs, args.rounds)

  lines = [
      f"Table updates: SAGA on ridge regression (d = {DIM}, one example per update), ProxASAGA on sparse "
      f"logistic regression (d = {SPARSE['d']}, {SPARSE['nnz']} nonzeros per row) and per-worker tables "
      f"({WORKERS} workers x {PARAMS} parameters); {args.updates} updates in one jitted lax.scan; best of "
      f"{args.rounds} interleaved rounds",
      f"jax {jax.__version__}, backend {jax.default_backend()}, {os.cpu_count()} CPUs, {platform.machine()}",
      "",
      f"{'variant':<36} {'us/update':>10} {'ratio to its baseline':>22}",
  ]
  for name, seconds in best.items():
    lines.append(f"{name:<36} {1e6 * seconds / args.updates:>10.2f} {seconds / best[baseline[name]]:>22.2f}")
  lines += ["", "baselines: sgd on the same problem; sgd with momentum for the worker tables",
            "command: python -m experiments.bench_tables"]
  publish(lines, args.out)


if __name__ == "__main__":
  main()
