"""kill -9 at random moments, during computing and during checkpoint writes, then resume: bit-identical."""

import os
import random
import subprocess
import sys

import jax
import numpy as np
import pytest

import delayjax as dj
from simulate_reference import killed_case

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "simulate_killed.py")


@pytest.mark.slow
@pytest.mark.standard_promotion
def test_resume_after_kill_9_is_bit_identical(tmp_path):
  loss_fn, tx, params, data, schedule, kwargs = killed_case()
  straight = dj.simulate(loss_fn, tx, params, data, schedule, **kwargs)
  assert straight.stats["num_chunks"] >= 24
  checkpoints = str(tmp_path / "checkpoints")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = os.pathsep.join([os.getcwd()] + sys.path)
  rng = random.Random(0)
  lines = []
  # Two kills: one soon after a chunk's checkpoint (likely inside the next chunk's compute or save), one later.
  for wait_chunks in (2, 2):
    proc = subprocess.Popen([sys.executable, SCRIPT, checkpoints], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
      for _ in range(wait_chunks):
        lines.append(proc.stdout.readline())
      # A few to a few hundred milliseconds later: a save takes about that long, so some kills land inside one.
      try:
        proc.wait(timeout=rng.uniform(0.005, 0.3))
      except subprocess.TimeoutExpired:
        pass
    finally:
      proc.kill()
      proc.wait()
  assert sum(line.startswith("chunk") for line in lines) == 4, lines
  chunks = []
  resumed = dj.simulate(loss_fn, tx, params, data, schedule, checkpoint=dj.Checkpoint(checkpoints),
                        record=dj.Record(callback=lambda info: chunks.append(info["chunk"])), **kwargs)
  assert chunks and chunks[0] >= 4, chunks  # it continued from a checkpoint of a killed process, not from the start
  np.testing.assert_array_equal(resumed.history.loss, straight.history.loss)
  for a, b in zip(jax.tree.leaves((resumed.params, resumed.opt_state)), jax.tree.leaves((straight.params,
                                                                                         straight.opt_state))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
