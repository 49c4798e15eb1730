"""``dj.delayed`` at a size that matters: a >= 10M-parameter Transformer LM, on one device and sharded over 8.

The same jitted training loop (``lax.scan`` over ``--steps`` Adam steps of a
decoder-only Transformer LM, next-token loss on random tokens) runs with
``optax.adam`` and with ``dj.delayed(optax.adam, constant(tau))``, first on
one device, then with the parameters, the optimizer state and the batch
sharded FSDP-style over a mesh of 8 devices (each parameter's largest axis
that 8 divides is split over the ``data`` axis, the batch too). The variants
are compiled first and timed in interleaved rounds, the best round of each
kept (``experiments._bench.best_times``). Reported side by side:

- the step time and its ratio to plain Adam on the same devices;
- the optimizer state's bytes on one device (for the mesh: device 0's shards)
  and their ratio to Adam's: ``dj.delayed`` adds ``tau + 1`` gradient and
  parameter copies to Adam's two moments;
- the compiled program's bytes per device (``memory_analysis``: arguments,
  outputs not aliased to them, and temporaries) and their ratio.

On a CPU host run with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``
(the module sets it when JAX is not yet imported), the 8 "devices" share the
host's cores, so the mesh's times compare the variants, not 1 device with 8.

    python -m experiments.bench_sharded [--steps 3] [--rounds 3] [--delay 4] [--out FILE]
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import sys

if "jax" not in sys.modules:
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import delayjax as dj  # noqa: E402
from ._bench import add_out_argument, best_times, publish  # noqa: E402
from ._models import transformer_lm  # noqa: E402


def fsdp_spec(shape: tuple[int, ...], size: int) -> P:
  """The largest axis that ``size`` divides, split over ``data``; a leaf with none is replicated."""
  axes = [i for i in np.argsort(shape)[::-1] if shape[i] % size == 0]
  if not axes:
    return P()
  spec = [None] * len(shape)
  spec[int(axes[0])] = "data"
  return P(*spec)


def state_bytes_on_device0(tree) -> int:
  """Bytes of ``tree``'s arrays that device 0 holds (its shards; the whole array if unsharded there)."""
  device = jax.devices()[0]
  total = 0
  for x in jax.tree.leaves(tree):
    total += sum(s.data.nbytes for s in x.addressable_shards if s.device == device)
  return total


def program_bytes(compiled) -> int:
  """Per-device bytes of a compiled program: arguments, outputs not aliased to arguments, temporaries."""
  m = compiled.memory_analysis()
  return int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes)


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, default=3, help="training steps per timed call")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--delay", type=int, default=4)
  parser.add_argument("--width", type=int, default=256)
  parser.add_argument("--depth", type=int, default=10)
  parser.add_argument("--vocab", type=int, default=8192)
  parser.add_argument("--seq-len", type=int, default=64)
  parser.add_argument("--batch", type=int, default=8)
  add_out_argument(parser, "bench_sharded")
  args = parser.parse_args(argv)

  init, apply = transformer_lm(args.vocab, args.width, args.depth, 8, args.seq_len)
  params = init(jax.random.PRNGKey(0))
  num_params = sum(x.size for x in jax.tree.leaves(params))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, args.vocab, (args.steps, args.batch, args.seq_len + 1)),
                       jnp.int32)

  def loss(p, batch):
    return optax.softmax_cross_entropy_with_integer_labels(apply(p, batch[:, :-1]), batch[:, 1:]).mean()

  def make_loop(tx):
    def loop(params, state, tokens):
      def step(carry, batch):
        p, s = carry
        u, s = tx.update(jax.grad(loss)(p, batch), s, p)
        return (optax.apply_updates(p, u), s), None
      return jax.lax.scan(step, (params, state), tokens)[0]
    return jax.jit(loop)

  variants = {"optax.adam": optax.adam(1e-3),
              f"dj.delayed(adam, constant({args.delay}))": dj.delayed(optax.adam(1e-3), dj.delays.constant(args.delay))}
  devices = jax.devices()
  # Auto axes: XLA partitions the model (an FSDP loop's all-gathers are the model's); Explicit axes would ask the
  # model's own code (the embedding lookup) for output shardings.
  mesh = jax.make_mesh((len(devices),), ("data",), axis_types=(AxisType.Auto,))
  placements = {
      "1 device": (params, tokens),
      f"{len(devices)} devices (FSDP)": (
          jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, fsdp_spec(x.shape, len(devices)))), params),
          jax.device_put(tokens, NamedSharding(mesh, P(None, "data")))),
  }
  rows = []
  for where, (p, toks) in placements.items():
    runs, info = {}, {}
    for name, tx in variants.items():
      state = tx.init(p)
      loop = make_loop(tx)
      compiled = loop.lower(p, state, toks).compile()
      info[name] = (state_bytes_on_device0(state), program_bytes(compiled))
      runs[name] = functools.partial(compiled, p, state, toks)
    best = best_times(runs, args.rounds)
    base_name = "optax.adam"
    for name in variants:
      rows.append((where, name, best[name] / args.steps, best[name] / best[base_name],
                   info[name][0], info[name][0] / info[base_name][0],
                   info[name][1], info[name][1] / info[base_name][1]))

  mb = lambda b: b / 2**20  # noqa: E731
  lines = [
      f"dj.delayed on a {num_params / 1e6:.1f}M-parameter Transformer LM (width {args.width}, depth {args.depth}, "
      f"vocab {args.vocab}, batch {args.batch} x {args.seq_len} tokens), Adam, {args.steps} steps per jitted "
      f"lax.scan; best of {args.rounds} interleaved rounds",
      f"jax {jax.__version__}, backend {jax.default_backend()}, {devices[0].device_kind}, {len(devices)} devices, "
      f"{os.cpu_count()} CPUs, {platform.machine()}",
      "state MiB: the optimizer state on device 0; program MiB: the compiled loop per device (arguments + "
      "unaliased outputs + temporaries)",
      "",
      f"{'devices':<18} {'variant':<30} {'s/step':>8} {'time ratio':>10} {'state MiB':>10} {'ratio':>6} "
      f"{'program MiB':>12} {'ratio':>6}",
  ]
  for where, name, seconds, ratio, sbytes, sratio, pbytes, pratio in rows:
    lines.append(f"{where:<18} {name:<30} {seconds:>8.3f} {ratio:>10.3f} {mb(sbytes):>10.1f} {sratio:>6.2f} "
                 f"{mb(pbytes):>12.1f} {pratio:>6.2f}")
  publish(lines, args.out)


if __name__ == "__main__":
  main()
