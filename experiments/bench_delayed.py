"""Overhead of ``dj.delayed`` per training step, measured side by side with plain Optax.

A jitted ``lax.scan`` training loop (MLP 64-256-10 on digits, batch 32, one
gradient and one optimizer update per step) runs with ``optax.sgd`` and with
the same optimizer wrapped in ``dj.delayed`` at several delay models. Each
variant is compiled first, then the variants are timed in interleaved rounds
and the best round of each is kept, so background load hits all alike. Prints
the time per step and the ratio to plain SGD (and writes them to ``--out
FILE``; the published table is ``experiments/results/bench_delayed.txt``).

    python -m experiments.bench_delayed [--steps 2000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import functools
import os
import platform

import jax
import jax.numpy as jnp
import optax

import delayjax as dj
from ._bench import add_out_argument, best_times, publish
from .data import digits
from .delayed_digits import init_mlp, loss_fn


def variants():
  sgd = lambda: optax.sgd(0.05, momentum=0.9)
  return {
      "optax.sgd": sgd(),
      "delayed(sgd, constant(8))": dj.delayed(sgd(), dj.delays.constant(8)),
      "delayed(sgd, constant(8)), no stale_params": dj.delayed(sgd(), dj.delays.constant(8),
                                                                store_stale_params=False),
      "delayed(sgd, uniform(8))": dj.delayed(sgd(), dj.delays.uniform(8)),
      "delayed(dc-asgd-a + sgd, constant(8))": dj.delayed(
          optax.chain(dj.delay_compensation(adaptive=True), sgd()), dj.delays.constant(8)),
  }


def make_loop(tx, x, y, steps, batch):
  @jax.jit
  def loop(params):
    def step(carry, t):
      params, state = carry
      idx = jax.random.randint(jax.random.PRNGKey(t), (batch,), 0, x.shape[0])
      grads = jax.grad(loss_fn)(params, x[idx], y[idx])
      updates, state = tx.update(grads, state, params)
      return (optax.apply_updates(params, updates), state), None
    return jax.lax.scan(step, (params, tx.init(params)), jnp.arange(steps))[0][0]
  return loop


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, default=2000)
  parser.add_argument("--rounds", type=int, default=7)
  parser.add_argument("--batch", type=int, default=32)
  add_out_argument(parser, "bench_delayed")
  args = parser.parse_args(argv)

  data = digits()
  x, y = jnp.asarray(data.x_train), jnp.asarray(data.y_train)
  params = init_mlp(jax.random.PRNGKey(0), (64, 256, 10))
  loops = {name: make_loop(tx, x, y, args.steps, args.batch) for name, tx in variants().items()}
  best = best_times({name: functools.partial(loop, params) for name, loop in loops.items()}, args.rounds)

  base = best["optax.sgd"]
  lines = [
      f"dj.delayed overhead: MLP 64-256-10, digits, batch {args.batch}, {args.steps} steps in one jitted "
      f"lax.scan; best of {args.rounds} interleaved rounds",
      f"jax {jax.__version__}, backend {jax.default_backend()}, {jax.devices()[0].device_kind}, "
      f"{os.cpu_count()} CPUs, {platform.machine()}",
      "",
      f"{'variant':<45} {'us/step':>9} {'ratio to optax.sgd':>20}",
  ]
  for name, seconds in best.items():
    lines.append(f"{name:<45} {1e6 * seconds / args.steps:>9.1f} {seconds / base:>20.3f}")
  publish(lines, args.out)


if __name__ == "__main__":
  main()
