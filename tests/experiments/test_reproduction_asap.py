"""experiments.asap: the specs' paradigms and the count of overwritten messages, against the schedules' own events."""

import numpy as np

import delayjax as dj
from experiments import asap

C = dj.cluster


def _config(**kw):
  return {**asap.SCALES["quick"], "steps": 15, **kw}


def test_specs_map_to_allreduce_and_asap_on_one_regular_graph():
  config = _config()
  paradigms = {s["key"]: asap.paradigm(config, s) for s in asap.specs(config)}
  assert str(paradigms["allreduce"]) == "allreduce()"
  assert paradigms["asap-notify_ack"].sync == "notify_ack" and paradigms["asap-none"].sync == "none"
  graph = paradigms["asap-none"].topology
  assert graph is not None and np.all(graph.degree == config["degree"]) and graph.num_nodes == 16
  assert np.array_equal(graph.adjacency, paradigms["asap-notify_ack"].topology.adjacency)
  assert graph.spectral_gap("uniform") > 0.1


def test_overwritten_fraction_accounts_for_every_message_sent():
  """Without NOTIFY-ACK every gradient but the run's last sends one message to each of the degree out-neighbours;
  each is consumed (a sender in a mix), overwritten, or still in flight at the end (at most one per link)."""
  config = _config()
  spec = {"key": "asap-none", "paradigm": "asap", "sync": "none"}
  sched = asap.schedule(config, spec, seed=0)
  assert asap.schedule(config, spec, seed=0) is sched   # simulated once: it is also the others' `like`
  consumed = int(np.count_nonzero(sched.members[:, 1:] >= 0))
  lost = int(sched.extras["overwritten"].sum())
  degree = config["degree"]
  sent = degree * (sched.num_gradients - 1)
  assert lost > 0 and 0 <= sent - consumed - lost <= degree * 16
  assert asap.overwritten_fraction(sched) == lost / (consumed + lost)
  notify = asap.schedule(config, {"key": "asap-notify_ack", "paradigm": "asap", "sync": "notify_ack"}, seed=0)
  allreduce = asap.schedule(config, {"key": "allreduce", "paradigm": "allreduce"}, seed=0)
  assert asap.overwritten_fraction(notify) == 0.0 and asap.overwritten_fraction(allreduce) == 0.0
  # NOTIFY-ACK waits for its receivers; the others' stragglers make all-reduce wait longest.
  assert sched.wait.sum() == 0 < notify.wait.sum()
  assert sched.total_time < notify.total_time < allreduce.total_time
