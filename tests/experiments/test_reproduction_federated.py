"""experiments.federated: the non-iid split and the claims' direction."""

import numpy as np

from experiments import federated


def test_each_client_gets_its_classes_and_every_example_is_dealt_once():
  labels = np.repeat(np.arange(10), 30)
  shards = federated.non_iid_shards(labels, clients=10, classes_per_client=2, seed=3)
  assert len(shards) == 10
  np.testing.assert_array_equal(np.sort(np.concatenate(shards)), np.arange(labels.size))
  assert all(len(np.unique(labels[s])) <= 2 for s in shards)


def _row(**per_seed):
  return {k: float(np.mean(list(v.values()))) for k, v in per_seed.items()} | {"per_seed": per_seed}


def test_sooner_means_less_time_to_the_target_and_more_error_refutes_fedbuff():
  seeds = range(6)
  slow = {s: 80.0 + s for s in seeds}
  fast = {s: 50.0 + s + 0.5 * (s % 2) for s in seeds}
  err = {s: 0.06 for s in seeds}
  worse = {s: 0.08 + 0.001 * s for s in seeds}
  summary = {"fedavg": _row(time_to_target_bound=slow, test_error=err),
             "fedasync": _row(time_to_target_bound=fast, test_error=err),
             "fedbuff": _row(time_to_target_bound=fast, test_error=err)}
  verdicts = {c.name: c.check(summary).verdict for c in federated.CLAIMS}
  assert verdicts == {"fedasync-faster": "held", "fedbuff-faster": "held", "fedbuff-vs-fedasync": "held"}
  summary["fedasync"], summary["fedavg"] = summary["fedavg"], summary["fedasync"]
  summary["fedbuff"] = _row(time_to_target_bound=fast, test_error=worse)
  verdicts = {c.name: c.check(summary).verdict for c in federated.CLAIMS}
  assert verdicts["fedasync-faster"] == "not held"
  assert verdicts["fedbuff-vs-fedasync"] == "not held"
