"""experiments.gossip_grad: the communication model (messages per step) against the schedules' own mixes."""

import math

import numpy as np
import pytest

import delayjax as dj
from experiments import gossip_grad

C = dj.cluster


@pytest.mark.parametrize("num", [2, 5, 16, 33])
def test_messages_per_step_is_log2_for_allreduce_the_degree_for_dpsgd_and_one_for_gossipgrad(num):
  assert gossip_grad.messages_per_step({"paradigm": "allreduce"}, num) == math.ceil(math.log2(num))
  assert gossip_grad.messages_per_step({"paradigm": "d_psgd", "topology": "ring"}, num) == (1 if num == 2 else 2)
  assert gossip_grad.messages_per_step({"paradigm": "gossipgrad"}, num) == 1


def test_gossipgrad_schedule_sends_and_receives_one_gradient_per_replica_and_step():
  """The model's O(1): in every GRADS mix of the GossipGraD schedule, each replica's row and column have exactly one
  off-diagonal weight (one gradient received, one sent), 1/2 each."""
  sched = C.simulate_gossip(C.gossipgrad(), C.workers(16, compute="constant"), 9, seed=0)
  assert sched.num_mixes == 9 and np.all(sched.mixes == 1)
  off = sched.weights * ~np.eye(sched.group_size, dtype=bool)[None]
  assert np.all(np.count_nonzero(off, axis=2) == 1) and np.all(np.count_nonzero(off, axis=1) == 1)
  np.testing.assert_array_equal(off[off != 0], 0.5)


def test_each_spec_pays_its_messages_in_simulated_time():
  """With constant 1 s gradients, a synchronous step lasts 1 + message_seconds * messages."""
  config = {**gossip_grad.SCALES["quick"], "compute": "constant", "steps": 4}
  num = len(config["speeds"])
  for spec in gossip_grad.specs(config):
    sched = C.simulate_gossip(gossip_grad.gt.paradigm_for(spec, num),
                              C.workers(num, compute="constant", comm=gossip_grad._spec_config(config, spec)["comm"]),
                              4, seed=0)
    expected = 4 * (1.0 + config["message_seconds"] * gossip_grad.messages_per_step(spec, num))
    assert sched.total_time == pytest.approx(expected)


def test_an_unknown_paradigm_has_no_communication_model():
  with pytest.raises(ValueError, match="no communication model for paradigm 'sgp'"):
    gossip_grad.messages_per_step({"paradigm": "sgp"}, 16)
