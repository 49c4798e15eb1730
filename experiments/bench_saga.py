"""Cost of a SAGA update against plain SGD, as the table grows: is the table written in place?

A jitted ``lax.scan`` of single-example updates on a ridge-regression finite
sum (``dj.problems.make_dense``, d = 200 features), with ``optax.sgd`` and
with ``dj.saga(n)`` (table of n x d gradients) and ``dj.saga(n,
table="scalars")`` (n numbers) chained before it, for n in {2000, 20000}.
If the table were copied at every update, SAGA's time per update would grow
with n x d (a 20000 x 200 float32 table is 16 MB); written in place, it stays
within a small factor of SGD's at every n. Each variant is compiled first,
then timed in interleaved rounds (best round kept). Prints microseconds per
update and the ratio to SGD, and writes them to
``experiments/results/bench_saga.txt``.

    python -m experiments.bench_saga [--updates 4000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import delayjax as dj

DIM = 200


def make_loop(problem: dj.problems.FiniteSum, tx, updates: int, scalars: bool):
  data = problem.data()
  n = problem.num_samples

  @jax.jit
  def loop(w):
    def step(carry, t):
      w, state = carry
      i = jax.random.randint(jax.random.key(t), (1,), 0, n)
      batch = jax.tree.map(lambda x: x[i], data)
      grad = jax.grad(problem.loss_fn)(w, batch)
      extra = {"sample_indices": i}
      if scalars:
        terms = problem.per_sample(w, batch)
        extra.update(sample_scalars=terms.scalars, sample_features=terms.features)
      else:
        extra["sample_grads"] = grad[None]
      u, state = tx.update(grad, state, w, **extra)
      return (optax.apply_updates(w, u), state), None

    return jax.lax.scan(step, (w, tx.init(w)), jnp.arange(updates))[0][0]

  return loop


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--updates", type=int, default=4000)
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "bench_saga.txt"))
  args = parser.parse_args(argv)

  loops = {}
  for n in (2000, 20000):
    problem = dj.problems.make_dense("least_squares", n, DIM, lam=1e-3, seed=0)
    loops[f"sgd, n={n}"] = make_loop(problem, optax.sgd(1e-3), args.updates, False)
    loops[f"saga gradients table, n={n}"] = make_loop(problem, optax.chain(dj.saga(n), optax.sgd(1e-3)),
                                                      args.updates, False)
    loops[f"saga scalars table, n={n}"] = make_loop(
        problem, optax.chain(dj.saga(n, table="scalars"), optax.sgd(1e-3)), args.updates, True)
  w0 = jnp.zeros(DIM)
  for loop in loops.values():
    jax.block_until_ready(loop(w0))
  best = {name: np.inf for name in loops}
  for _ in range(args.rounds):
    for name, loop in loops.items():
      start = time.perf_counter()
      jax.block_until_ready(loop(w0))
      best[name] = min(best[name], time.perf_counter() - start)

  lines = [
      f"SAGA update cost: ridge regression, d = {DIM}, one example per update, {args.updates} updates in one "
      f"jitted lax.scan; best of {args.rounds} interleaved rounds",
      f"jax {jax.__version__}, backend {jax.default_backend()}, {os.cpu_count()} CPUs, {platform.machine()}",
      "",
      f"{'variant':<34} {'us/update':>10} {'ratio to sgd, same n':>22}",
  ]
  for name, seconds in best.items():
    base = best[f"sgd, n={name.split('n=')[1]}"]
    lines.append(f"{name:<34} {1e6 * seconds / args.updates:>10.2f} {seconds / base:>22.2f}")
  lines += ["", "command: python -m experiments.bench_saga"]
  text = "\n".join(lines)
  print(text)
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    f.write(text + "\n")


if __name__ == "__main__":
  main()
