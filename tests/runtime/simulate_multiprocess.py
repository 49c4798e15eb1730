"""One process of the two-process ``dj.simulate`` test (run by ``test_simulate.py``).

Usage: ``python simulate_multiprocess.py PORT PROCESS_ID OUT.npz CHECKPOINT_DIR``.
Each process has two CPU devices; together they form a 4-device ``workers``
mesh. It runs the simulation once straight through, and once interrupted after
its second chunk and resumed from a checkpoint; process 0 saves both results.
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_numpy_dtype_promotion", "strict")


class Stop(Exception):
  pass


def stop_after_two(info):
  if info["chunk"] == 1:
    raise Stop


def main(port: str, process_id: str, out: str, checkpoint_dir: str) -> None:
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                             process_id=int(process_id))
  import numpy as np

  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from simulate_reference import multiprocess_case

  import delayjax as dj

  mesh = jax.make_mesh((4,), ("workers",), devices=jax.devices())
  loss_fn, tx, params, data, schedule, kwargs = multiprocess_case(mesh)
  straight = dj.simulate(loss_fn, tx, params, data, schedule, **kwargs)
  try:
    dj.simulate(loss_fn, tx, params, data, schedule, checkpoint=dj.Checkpoint(checkpoint_dir),
                record=dj.Record(callback=stop_after_two), **kwargs)
  except Stop:
    pass
  resumed = dj.simulate(loss_fn, tx, params, data, schedule, checkpoint=dj.Checkpoint(checkpoint_dir), **kwargs)
  arrays = {}
  for name, result in (("straight", straight), ("resumed", resumed)):
    arrays[f"{name}_loss"] = result.history.loss
    for i, x in enumerate(jax.tree.leaves((result.params, result.opt_state))):
      arrays[f"{name}_{i}"] = np.asarray(x.addressable_data(0))
  if int(process_id) == 0:
    np.savez(out, **arrays)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(*sys.argv[1:])
