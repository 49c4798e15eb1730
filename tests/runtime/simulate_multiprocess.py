"""One process of the two-process ``dj.simulate`` test (run by ``test_simulate.py``).

Usage: ``python simulate_multiprocess.py PORT PROCESS_ID OUT.npz``. Each process
has two CPU devices; together they form a 4-device ``workers`` mesh.
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_numpy_dtype_promotion", "strict")


def main(port: str, process_id: str, out: str) -> None:
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                             process_id=int(process_id))
  import numpy as np

  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from simulate_reference import multiprocess_case

  import delayjax as dj

  mesh = jax.make_mesh((4,), ("workers",), devices=jax.devices())
  loss_fn, tx, params, data, schedule, kwargs = multiprocess_case()
  result = dj.simulate(loss_fn, tx, params, data, schedule, mesh=mesh, **kwargs)
  leaves = [np.asarray(x.addressable_data(0)) for x in jax.tree.leaves(result.params)]
  if int(process_id) == 0:
    np.savez(out, loss=result.history.loss, *leaves)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(*sys.argv[1:])
