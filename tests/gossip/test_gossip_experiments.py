"""The gossip reproductions' runs on ``dj.simulate_gossip`` against the NumPy executor they ran on before, and that
executor against the sequential reference."""

import json

import numpy as np
import pytest

import delayjax as dj
import gossip_numpy_executor as executor
import gossip_reference as ref
from experiments import _gossip_train as gt

C = dj.cluster


@pytest.mark.parametrize("paradigm, push_sum", [
    (C.allreduce(), False), (C.d_psgd(dj.topology.ring(6)), False), (C.ad_psgd(), False),
    (C.ad_psgd(dj.topology.ring(6)), False), (C.sgp(2), True), (C.gossipgrad(), False),
], ids=str)
@pytest.mark.fast_compile
def test_executor_matches_the_reference(paradigm, push_sum):
  task = gt.digits_task(6, shards="label")
  w = C.workers(6, compute="exponential", comm=C.exponential(0.7), speed=[1, 1, 1, 1, 1, 0.3])
  fail = C.failures(drop=0.2) if isinstance(paradigm, (C._gossip.ADPSGD, C._gossip.DPSGD)) else None
  s = C.simulate_gossip(paradigm, w, 12, seed=3, failures=fail)
  x0 = np.random.default_rng(0).normal(size=(6, 650)) * 0.01
  got = executor.run_schedule(task, s, lr=0.3, momentum=0.5, batch=8, seed=1, eval_every=10, push_sum=push_sum,
                              x0=x0)
  idx = executor.batches(task, s, 8, 1)
  want = ref.run(s, lambda z, i, j: executor.gradient(task, z, idx[i][j]), x0, lr=0.3, momentum=0.5,
                 push_sum=push_sum)
  np.testing.assert_allclose(got["x"], want["x"] / want["w"][:, None], rtol=1e-10, atol=1e-12)
  # The recorded consensus distance is the definition's, on the final models.
  z = want["x"] / want["w"][:, None]
  assert got["metrics"]["consensus"] == pytest.approx(np.mean(np.sum((z - z.mean(0)) ** 2, axis=1)), rel=1e-9)
  assert got["metrics"]["loss"] == pytest.approx(float(executor.loss(task, z.mean(0))), rel=1e-9)


@pytest.mark.fast_compile
def test_loss_and_gradient_agree_with_finite_differences():
  task = gt.digits_task(1)
  rng = np.random.default_rng(0)
  p = rng.normal(size=650) * 0.1
  full = np.arange(task.y.shape[0])
  g = executor.gradient(task, p, full)
  for k in rng.integers(650, size=5):
    e = np.zeros(650)
    e[k] = 1e-6
    assert g[k] == pytest.approx((executor.loss(task, p + e) - executor.loss(task, p - e)) / 2e-6, rel=1e-4,
                                 abs=1e-8)


CONFIG = dict(speeds=[1.0] * 7 + [0.25], compute="exponential", comm=0.05, steps=6, batch=8, lr=0.5, momentum=0.5,
              shards="label", target_loss=2.0, evals=3)


def _specs(config):
  del config
  # Three paradigms of one rule (one shared program, in a mixing form none of them has on its own) and SGP with
  # late messages (a program of its own).
  return [{"key": "allreduce", "paradigm": "allreduce"},
          {"key": "d_psgd-ring", "paradigm": "d_psgd", "topology": "ring"},
          {"key": "ad_psgd", "paradigm": "ad_psgd", "drop": 0.2},
          {"key": "sgp", "paradigm": "sgp", "overlap": 1}]


@pytest.mark.fast_compile
@pytest.mark.parametrize("seed", [0, 2])
def test_a_reproductions_runs_on_the_library_match_the_numpy_executor(seed):
  """``gt.run_spec`` with the reproduction's specs (every run shares its rule's program through ``like``) ends at
  the models of the NumPy executor, on the same minibatches: the same average model's loss, replica losses and
  consensus distance, and the schedule's own figures."""
  m = len(CONFIG["speeds"])
  task = gt.digits_task(m, CONFIG["shards"])
  for spec in _specs(CONFIG):
    got = gt.run_spec(CONFIG, spec, seed, lambda *a: None, specs=_specs)
    schedule = gt.schedule_for(CONFIG, spec, seed)
    counts = np.bincount(schedule.worker[schedule.kind == C.READ], schedule.num_batches[schedule.kind == C.READ],
                         minlength=m).astype(int)
    idx = [np.stack([np.asarray(dj.runtime.minibatch_indices(
        seed, 0, i, b, num_examples=task.y.shape[0], batch_size=CONFIG["batch"], sampling="shard",
        shard=np.asarray(task.shards[i], np.int32), shard_size=task.shards[i].shape[0])) for b in range(counts[i])])
        for i in range(m)]
    want = executor.run_schedule(task, schedule, lr=CONFIG["lr"], momentum=CONFIG["momentum"],
                                 batch=CONFIG["batch"], seed=seed, eval_every=gt.eval_every(CONFIG, schedule),
                                 push_sum=spec["paradigm"] == "sgp", idx=idx)
    # The library's last evaluation comes after the last event; the executor's may come before the mixes that
    # follow the last gradient: both are checked on the executor's final models.
    z = want["x"]
    assert got["metrics"]["loss"] == pytest.approx(float(executor.loss(task, z.mean(0))), rel=1e-5), spec["key"]
    assert got["metrics"]["replica_loss"] == pytest.approx(float(executor.loss(task, z).mean()), rel=1e-5), spec["key"]
    assert got["metrics"]["consensus"] == pytest.approx(np.mean(np.sum((z - z.mean(0)) ** 2, axis=1)), rel=1e-4,
                                                        abs=1e-9), spec["key"]
    for name in ("gradients", "simulated_time", "idle_fraction", "mean_lag"):
      assert got["metrics"][name] == want["metrics"][name], (spec["key"], name)


@pytest.mark.fast_compile
def test_a_batch_of_runs_gives_each_run_its_single_record_bit_for_bit():
  """``gt.run_specs`` (a reproduction's ``run_batch``) computes the runs of one seed (``gt.batch_key``), one
  ``dj.simulate_gossip`` call per ``gt.call_key``, separate programs side by side; each record equals
  ``gt.run_spec``'s of that run alone, whatever other runs are in the batch."""
  specs = _specs(CONFIG)
  members = [(spec, 1) for spec in specs]
  assert len({gt.batch_key(CONFIG, spec, seed) for spec, seed in members}) == 1
  # D-PSGD's rule in one call for the all-reduce, D-PSGD and AD-PSGD runs (AD-PSGD's method is D-PSGD's under
  # another name: its runs computed by D-PSGD's method, their records still those of their own calls); SGP's
  # push-sum, another program, beside it.
  calls = [gt.call_key(CONFIG, spec, seed) for spec, seed in members]
  assert calls[0] == calls[1] == calls[2] != calls[3]
  alone = [gt.run_spec(CONFIG, spec, seed, lambda *a: None, specs=_specs) for spec, seed in members]
  told = []
  together = gt.run_specs(CONFIG, members, lambda done, total: told.append((done, total)), specs=_specs)
  as_text = lambda records: json.dumps(records, sort_keys=True, default=np.ndarray.tolist)  # noqa: E731
  assert as_text(together) == as_text(alone)
  assert alone[0]["metrics"]["loss"] != alone[1]["metrics"]["loss"]
  assert told[-1] == (len(members), len(members))
  # Another seed's run is not of the batch; nor is a run with a method of each schedule batched.
  with pytest.raises(ValueError, match="share a seed"):
    gt.run_specs(CONFIG, [members[0], (members[1][0], 2)], lambda *a: None, specs=_specs)
  with pytest.raises(ValueError, match="a method of each schedule are computed one at a time"):
    gt.run_specs(CONFIG, members[:2], lambda *a: None, method=lambda schedule: dj.gossip.d_psgd(), specs=_specs)
