"""experiments.compression: the grid, the message sizes each method pushes, and the claims' direction."""

import numpy as np

import delayjax as dj
from experiments import compression
from experiments._training import task_for

CONFIG = dict(compression.SCALES["quick"])


def test_the_grid_is_paradigm_by_bandwidth_by_method():
  keys = [s["key"] for s in compression.specs(CONFIG)]
  assert len(keys) == len(set(keys)) == 2 * 2 * 3
  assert {"bsp-high-dense", "asp-low-powersgd", "asp-high-topk"} <= set(keys)


def test_compressed_pushes_are_smaller_than_dense_ones():
  params = task_for(CONFIG).init(0)
  dense = dj.message_bytes(params, compression.compressor(CONFIG, "dense"))
  for method in CONFIG["compressors"]:
    assert dj.message_bytes(params, compression.compressor(CONFIG, method)) < dense / 10, method


def _row(values):
  return {"time_to_target_bound": float(np.mean(list(values.values()))), "per_seed":
          {"time_to_target_bound": values}}


def _summary(paradigm, bandwidth, dense, topk, powersgd):
  return {f"{paradigm}-{bandwidth}-{m}": _row(v) for m, v in
          (("dense", dense), ("topk", topk), ("powersgd", powersgd))}


def test_a_no_gain_claim_needs_every_compressor_slower_and_a_gain_claim_every_one_faster():
  seeds = range(6)
  base = {s: 20.0 + s for s in seeds}
  slower = {s: 30.0 + s + 0.1 * (s % 2) for s in seeds}
  faster = {s: 10.0 + s + 0.1 * (s % 2) for s in seeds}
  noisy = {s: 20.0 + s + (3.0 if s % 2 else -2.0) for s in seeds}
  claims = {c.name: c for c in compression.CLAIMS}
  high = claims["async-high-no-gain"].check
  assert high(_summary("asp", "high", base, slower, slower)).verdict == "held"
  # One compressor within the noise leaves the claim undecided; one significantly faster refutes it.
  assert high(_summary("asp", "high", base, slower, noisy)).verdict == "inconclusive"
  assert high(_summary("asp", "high", base, slower, faster)).verdict == "not held"
  low = claims["async-low-gain"].check
  assert low(_summary("asp", "low", base, faster, faster)).verdict == "held"
  assert low(_summary("asp", "low", base, faster, slower)).verdict == "not held"
