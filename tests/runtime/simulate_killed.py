"""One process of the kill -9 test (run by ``test_kill.py``): a run that checkpoints after every chunk.

Usage: ``python simulate_killed.py CHECKPOINT_DIR``. It prints a line after
each chunk (after that chunk's checkpoint is written), so the test knows the
run is computing and saving when it kills it.
"""

import os
import sys


def main(checkpoint_dir: str) -> None:
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from simulate_reference import killed_case

  import delayjax as dj

  loss_fn, tx, params, data, schedule, kwargs = killed_case()
  dj.simulate(loss_fn, tx, params, data, schedule, checkpoint=dj.Checkpoint(checkpoint_dir),
              record=dj.Record(callback=lambda info: print("chunk", info["chunk"], flush=True)), **kwargs)


if __name__ == "__main__":
  main(*sys.argv[1:])
