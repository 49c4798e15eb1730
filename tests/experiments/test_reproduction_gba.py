"""experiments.gba: every spec computes the same gradients, GBA and BSP average M of them, and the claims'
direction and margins."""

import numpy as np

from experiments import gba

CONFIG = {**gba.SCALES["quick"], "steps": 64}


def test_every_spec_computes_the_same_gradients():
  m = CONFIG["workers"]
  for spec in gba.specs(CONFIG):
    sched = gba.schedule(CONFIG, spec, seed=2)
    assert sched.contributions.num_batches.sum() == CONFIG["steps"], spec["key"]
    per_update = 1 if spec["paradigm"] == "asp" else m
    assert sched.num_updates == CONFIG["steps"] // per_update, spec["key"]


def _row(paradigm, **per_seed):
  return ({k: float(np.mean(list(v.values()))) for k, v in per_seed.items()} | {"paradigm": paradigm,
          "per_seed": per_seed})


def test_the_accuracy_claims_are_decided_against_their_1_5_point_margins():
  seeds = range(6)
  time = {s: 500.0 + s for s in seeds}
  base = {s: 0.03 + 0.001 * s for s in seeds}
  near = {s: 0.035 + 0.001 * s + 0.0005 * (s % 2) for s in seeds}   # +0.5 points
  far = {s: 0.06 + 0.001 * s + 0.0005 * (s % 2) for s in seeds}     # +3 points
  summary = {"bsp": _row("bsp", test_error=base, simulated_time=time),
             "gba-iota2": _row("gba", test_error=near, simulated_time={s: 300.0 + s % 2 for s in seeds}),
             "asp": _row("asp", test_error=far, simulated_time=time)}
  verdicts = {c.name: c.check(summary).verdict for c in gba.CLAIMS}
  assert verdicts == {"gba-tuning-free": "held", "gba-faster": "held", "asp-needs-retuning": "held"}
  summary["gba-iota2"] = _row("gba", test_error=far, simulated_time=time)
  summary["asp"] = _row("asp", test_error=near, simulated_time=time)
  verdicts = {c.name: c.check(summary).verdict for c in gba.CLAIMS}
  assert verdicts["gba-tuning-free"] == "not held"
  assert verdicts["asp-needs-retuning"] == "not held"
