"""experiments.gossip_unreliable: the paired specs see the same failures and gradients; the claims' pairing."""

import numpy as np

import delayjax as dj
from experiments import gossip_unreliable as gu

C = dj.cluster


def _config(**kw):
  return {**gu.SCALES["quick"], "steps": 12, **kw}


def test_drop_and_reuse_specs_apply_the_same_gradients_at_the_same_moments():
  config = _config()
  by_key = {s["key"]: s for s in gu.specs(config)}
  assert set(by_key) == {"d_psgd-lossless", "d_psgd-drop", "d_psgd-reuse", "ad_psgd-drop", "ad_psgd-reuse"}
  assert gu.failures(config, by_key["d_psgd-lossless"]) is None
  for paradigm in ("d_psgd", "ad_psgd"):
    drop = gu.schedule(config, by_key[f"{paradigm}-drop"], seed=0)
    reuse = gu.schedule(config, by_key[f"{paradigm}-reuse"], seed=0)
    assert gu.schedule(config, by_key[f"{paradigm}-reuse"], seed=0) is reuse   # simulated once: also a `like`
    keep_d, keep_r = drop.kind != C.MIX, reuse.kind != C.MIX
    for name in ("time", "kind", "worker"):
      np.testing.assert_array_equal(getattr(drop, name)[keep_d], getattr(reuse, name)[keep_r])
    assert drop.num_gradients == reuse.num_gradients == config["steps"] * 16
    # Dropping never mixes a late message; reusing does, in mixes the replica runtime runs (at most 8 members).
    assert drop.max_lag == 0 and reuse.max_lag > 0 and reuse.group_size <= 8
    assert str(drop.paradigm).startswith(paradigm) and "ring(16)" in str(reuse.paradigm)


def test_claims_compare_reuse_with_drop_seed_by_seed():
  def row(key, values):
    paradigm, rule = key.rsplit("-", 1)
    return {"paradigm": paradigm, "on_failure": rule, **{m: float(np.mean(v)) for m, v in values.items()},
            "per_seed": {m: dict(enumerate(v)) for m, v in values.items()}}

  metrics = ("replica_loss", "mean_consensus", "loss")
  base = {m: [1.0, 1.1, 1.2, 1.3] for m in metrics}
  better = {m: [0.8, 0.9, 1.0, 1.1] for m in metrics}
  summary = {"d_psgd-lossless": row("d_psgd-lossless", base), "d_psgd-drop": row("d_psgd-drop", base),
             "d_psgd-reuse": row("d_psgd-reuse", better), "ad_psgd-drop": row("ad_psgd-drop", better),
             "ad_psgd-reuse": row("ad_psgd-reuse", base)}
  verdicts = {c.name: c.check(summary).verdict for c in gu.CLAIMS}
  assert len(verdicts) == 6
  assert all(verdicts[f"reuse-d_psgd-{m}"] == "held" for m in ("replica-loss", "consensus", "average-loss"))
  assert all(verdicts[f"reuse-ad_psgd-{m}"] == "not held" for m in ("replica-loss", "consensus", "average-loss"))
