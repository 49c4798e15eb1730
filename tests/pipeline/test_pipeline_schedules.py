"""Pipeline schedules against closed forms (bubbles, staleness, memory) and their own timing invariants."""

import numpy as np
import pytest

import delayjax as dj

C = dj.cluster


@pytest.mark.parametrize("schedule", ["gpipe", "dapple"])
@pytest.mark.parametrize("K,m", [(2, 1), (4, 8), (8, 4), (5, 3)])
def test_synchronous_bubble_is_the_closed_form(schedule, K, m):
  p = C.pipeline(schedule, K, 3, num_microbatches=m, forward=1.0, backward=2.0)
  np.testing.assert_allclose(p.bubble_fraction(), (K - 1) / (m + K - 1), rtol=1e-12)
  # One mini-batch takes (m + K - 1)(t_f + t_b) seconds, and nothing is stale.
  np.testing.assert_allclose(p.total_time, 3 * (m + K - 1) * 3.0)
  assert np.all(p.forward_staleness == 0) and np.all(p.backward_staleness == 0)
  assert p.versions_kept().tolist() == [1] * K


def test_activation_memory_gpipe_holds_m_dapple_holds_k_minus_stage():
  K, m = 4, 8
  assert C.pipeline("gpipe", K, 2, num_microbatches=m).activations_kept().tolist() == [m] * K
  assert C.pipeline("dapple", K, 2, num_microbatches=m).activations_kept().tolist() == [K - k for k in range(K)]


@pytest.mark.parametrize("K", [2, 4, 6])
def test_1f1b_steady_state_staleness_is_k_minus_1_minus_stage(K):
  p = C.pipeline("1f1b", K, 40, weights="stash")
  steady = slice(K, 40 - K)
  expected = np.array([K - 1 - k for k in range(K)])
  assert np.all(p.forward_staleness[steady] == expected)
  # Weight stashing: the backward pass uses the forward pass's version, and stage k keeps K - k of them.
  np.testing.assert_array_equal(p.backward_version, p.forward_version)
  assert p.versions_kept().tolist() == [K - k for k in range(K)]


@pytest.mark.parametrize("m", [1, 2, 3])
def test_1f1b_latest_backward_is_fresh_and_forward_staleness_matches_the_closed_form(m):
  K, U = 4, 20
  p = C.pipeline("1f1b", K, U, num_microbatches=m, weights="latest")
  n = np.arange(U * m)[:, None]
  warmup = np.array([K - 1 - k for k in range(K)])[None, :]
  # Forward pass n of stage k follows the backward passes of micro-batches 0 .. n - warmup - 1.
  expected = n // m - np.maximum(n - warmup, 0) // m
  np.testing.assert_array_equal(p.forward_staleness, expected)
  assert np.all(p.backward_staleness == 0)
  assert p.versions_kept().tolist() == [1] * K


def test_vertical_sync_uses_stage_zero_version_everywhere():
  K = 4
  p = C.pipeline("1f1b", K, 30, weights="vertical_sync")
  stash = C.pipeline("1f1b", K, 30, weights="stash")
  for k in range(K):
    np.testing.assert_array_equal(p.forward_version[:, k], stash.forward_version[:, 0])
  np.testing.assert_array_equal(p.backward_version, p.forward_version)
  # The same timeline as 1F1B: only the versions differ.
  np.testing.assert_array_equal(p.forward_start, stash.forward_start)


@pytest.mark.parametrize("schedule,weights,m", [("gpipe", "stash", 3), ("dapple", "stash", 3),
                                                ("1f1b", "stash", 1), ("1f1b", "latest", 2)])
def test_timing_respects_data_flow_and_versions_follow_update_times(schedule, weights, m):
  K, U = 4, 12
  p = C.pipeline(schedule, K, U, num_microbatches=m, weights=weights, forward="exponential",
                 backward=C.gamma(2.0, 2.0), comm=C.uniform(0.0, 0.2), seed=3)
  fs, fe, bs, be = p.forward_start, p.forward_end, p.backward_start, p.backward_end
  assert np.all(fe[:, 1:] >= fe[:, :-1]) and np.all(fs[:, 1:] >= fe[:, :-1])
  assert np.all(bs[:, :-1] >= be[:, 1:]) and np.all(bs >= fe)
  for k in range(K):
    # One pass at a time per stage.
    b = np.concatenate([fs[:, k], bs[:, k]])
    e = np.concatenate([fe[:, k], be[:, k]])
    order = np.argsort(b, kind="stable")
    assert np.all(b[order][1:] >= e[order][:-1] - 1e-12)
    # A pass's version counts the stage's updates applied before it started.
    ut = p.update_time[:, k]
    np.testing.assert_array_equal(p.forward_version[:, k], np.searchsorted(np.sort(ut), fs[:, k], side="right"))
    if weights == "latest":
      np.testing.assert_array_equal(p.backward_version[:, k],
                                    np.searchsorted(np.sort(ut), bs[:, k], side="right"))
    # Update u follows the backward passes of its m micro-batches.
    np.testing.assert_allclose(ut, be[:, k].reshape(U, m).max(axis=1))
  busy = p.busy_time().sum()
  np.testing.assert_allclose(p.bubble_fraction(), 1 - busy / (K * p.update_time.max()))


def test_same_seed_same_times_and_per_stage_models():
  a = C.pipeline("1f1b", 3, 10, forward="exponential", seed=5)
  b = C.pipeline("1f1b", 3, 10, forward="exponential", seed=5)
  np.testing.assert_array_equal(a.forward_end, b.forward_end)
  slow_last = C.pipeline("gpipe", 3, 2, num_microbatches=2, forward=[1.0, 1.0, 3.0], backward=0.0)
  np.testing.assert_allclose(slow_last.forward_end[:, 2] - slow_last.forward_start[:, 2], 3.0)


def test_bad_arguments_name_themselves():
  with pytest.raises(ValueError, match="schedule"):
    C.pipeline("pipedream-flush", 4, 10)
  with pytest.raises(ValueError, match="weights"):
    C.pipeline("gpipe", 4, 10, weights="latest")
  with pytest.raises(ValueError, match="num_stages"):
    C.pipeline("1f1b", 0, 10)
  with pytest.raises(TypeError, match="num_microbatches"):
    C.pipeline("1f1b", 2, 10, num_microbatches=1.5)
  with pytest.raises(ValueError, match="forward"):
    C.pipeline("1f1b", 3, 10, forward=[1.0, 2.0])


def test_plot_draws_one_bar_per_pass():
  matplotlib = pytest.importorskip("matplotlib")
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  p = C.pipeline("1f1b", 3, 4, num_microbatches=2, weights="latest", forward="uniform", seed=1)
  ax = C.plot_pipeline(p)
  bars = {c.get_label(): c.patches for c in ax.containers}
  assert len(bars["forward"]) == len(bars["backward"]) == p.num_passes * 3
  widths = sorted(b.get_width() for b in bars["forward"])
  np.testing.assert_allclose(widths, np.sort((p.forward_end - p.forward_start).ravel()))
  assert sorted(round(b.get_y() + b.get_height() / 2) for b in bars["update"]) == sorted([0, 1, 2] * 4)
  plt.close(ax.figure)
