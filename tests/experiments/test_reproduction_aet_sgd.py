"""The AET-SGD reproduction's message counting: D-PSGD's sends from the schedule, totals and the busiest replica."""

from __future__ import annotations

import numpy as np

import delayjax as dj
from experiments import aet_sgd


def test_dpsgd_sends_once_per_round_to_each_ring_neighbour():
  workers = dj.cluster.workers(5, compute="exponential")
  schedule = dj.cluster.simulate_gossip(dj.cluster.d_psgd(dj.topology.ring(5)), workers, num_steps=7, seed=0)
  sends = aet_sgd.sends_per_replica(schedule)
  # Synchronous rounds: every replica is a member of every mix.
  np.testing.assert_array_equal(sends, np.full(5, schedule.num_mixes))
  assert aet_sgd.message_counts(sends, 2) == (2 * 5 * schedule.num_mixes, 2 * schedule.num_mixes)


def test_message_counts_of_uneven_sends():
  assert aet_sgd.message_counts(np.array([3, 0, 5, 1]), 2) == (18, 10)
  assert aet_sgd.message_counts(np.array([4]), 3) == (12, 12)


def test_the_quick_config_has_two_specs_on_one_schedule():
  config = aet_sgd.SCALES["quick"]
  keys = [s["key"] for s in aet_sgd.specs(config)]
  assert keys == ["d_psgd", "aet_sgd"]
  assert aet_sgd._schedule(dict(config, steps=5), 0) is aet_sgd._schedule(dict(config, steps=5), 0)
