"""experiments.lasgd: the communication model, the specs' schedules (same compute times, same gradients, LASGD's
all-reduces priced like all-reduce SGD's), and the claims' direction."""

import math

import numpy as np
import pytest

from experiments import lasgd

CONFIG = {**lasgd.SCALES["quick"], "steps": 12}


@pytest.mark.parametrize("num", [2, 5, 16, 33])
def test_an_allreduce_is_log2_messages_and_a_gossip_averaging_one(num):
  assert lasgd.messages_per_step({"paradigm": "allreduce"}, num) == math.ceil(math.log2(num))
  assert lasgd.messages_per_step({"paradigm": "lasgd"}, num) == math.ceil(math.log2(num))
  assert lasgd.messages_per_step({"paradigm": "ad_psgd"}, num) == 1
  with pytest.raises(ValueError, match="no communication model for paradigm 'sgp'"):
    lasgd.messages_per_step({"paradigm": "sgp"}, num)


def test_specs_apply_the_same_gradients_from_the_same_compute_times():
  """Every spec applies steps * M gradients; LASGD's replicas and AD-PSGD's compute their first gradients for the
  same seconds (the workers' streams for the seed); LASGD's all-reduces last the priced log2 M messages."""
  num = len(CONFIG["speeds"])
  scheds = {s["key"]: lasgd.schedule_for(CONFIG, s, 3) for s in lasgd.specs(CONFIG)}
  for key, sched in scheds.items():
    assert sched.num_gradients == CONFIG["steps"] * num, key
  first = {}
  for key in ("ad_psgd", "lasgd"):
    s = scheds[key]
    grads = np.flatnonzero(s.kind == 1)
    first[key] = np.array([s.extras["compute_end"][grads[s.worker[grads] == m][0]] for m in range(num)])
  np.testing.assert_allclose(first["lasgd"], first["ad_psgd"], rtol=1e-12)
  starts = scheds["lasgd"].extras["allreduce_start"]
  np.testing.assert_allclose(np.diff(starts), CONFIG["message_seconds"] * math.ceil(math.log2(num)))
  # Nobody waits in LASGD; all-reduce SGD's fast replicas wait for the slow ones.
  assert scheds["lasgd"].wait.sum() == pytest.approx(0.0, abs=1e-6)
  assert scheds["allreduce"].idle_fraction.mean() > 0.3


def _row(**per_seed):
  return {k: float(np.mean(list(v.values()))) for k, v in per_seed.items()} | {"per_seed": per_seed}


def test_claims_favour_the_lower_time_and_consensus():
  seeds = range(4)
  fast = {s: 100.0 + s for s in seeds}
  slow = {s: 150.0 + 2 * s for s in seeds}

  def row(time, consensus):
    return _row(time_to_target=time, mean_consensus=consensus, simulated_time={s: 300.0 for s in seeds},
                test_error_pct={s: 4.0 for s in seeds}, loss={s: 0.3 for s in seeds},
                gradients={s: 3200.0 for s in seeds})

  summary = {"lasgd": row(fast, {s: 0.05 for s in seeds}), "ad_psgd": row(slow, {s: 0.1 + 0.01 * s for s in seeds}),
             "allreduce": row(slow, {s: 0.0 for s in seeds})}
  verdicts = {c.name: c.check(summary).verdict for c in lasgd.CLAIMS}
  assert verdicts == {"lasgd-faster-than-allreduce": "held", "lasgd-faster-than-adpsgd": "held",
                      "lasgd-accuracy": "held", "lasgd-exact-averaging": "held"}
  summary["lasgd"], summary["ad_psgd"] = summary["ad_psgd"], summary["lasgd"]
  assert lasgd.CLAIMS[1].check(summary).verdict == "not held"
  assert lasgd.CLAIMS[3].check(summary).verdict == "not held"
