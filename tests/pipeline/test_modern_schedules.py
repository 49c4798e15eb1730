"""PipeDream-2BW, interleaved 1F1B and ZB-H1 against their closed forms and their papers' rules."""

import dataclasses

import numpy as np
import pytest

import delayjax as dj

C = dj.cluster


def _one_pass_at_a_time(p):
  """Every device runs one pass at a time, all its model stages and all three kinds of pass together."""
  for d in range(p.num_stages):
    cols = p.device_of == d
    b = np.concatenate([x[:, cols].ravel() for x in (p.forward_start, p.backward_start, p.weight_start)])
    e = np.concatenate([x[:, cols].ravel() for x in (p.forward_end, p.backward_end, p.weight_end)])
    order = np.lexsort((e, b))
    assert np.all(b[order][1:] >= e[order][:-1] - 1e-9)


def _versions_at(p, times):
  """int64 ``[N, S]``: the updates each model stage had applied by ``times`` (its current version then)."""
  return np.stack([np.searchsorted(np.sort(p.update_time[:, j]), times[:, j], side="right")
                   for j in range(p.num_model_stages)], axis=1)


@pytest.mark.parametrize("K,m,v,t_f,t_b", [(2, 2, 2, 1.0, 2.0), (4, 8, 2, 0.7, 1.9), (3, 6, 3, 1.3, 0.4),
                                           (4, 4, 4, 1.0, 1.0), (1, 3, 2, 1.0, 2.0)])
def test_interleaved_bubble_is_the_closed_form(K, m, v, t_f, t_b):
  U = 3
  p = C.pipeline("interleaved", K, U, num_microbatches=m, virtual_stages=v, forward=t_f, backward=t_b)
  # Megatron-LM: the bubble is (1/v)(K - 1)/m of the ideal time m v (t_f + t_b) per mini-batch.
  ideal = m * v * (t_f + t_b)
  np.testing.assert_allclose(p.total_time, U * ideal * (1 + (K - 1) / (v * m)), rtol=1e-12)
  np.testing.assert_allclose(p.bubble_fraction(), (K - 1) / (m * v + K - 1), rtol=1e-12, atol=1e-15)
  assert p.num_model_stages == K * v and p.forward_version.shape == (U * m, K * v)
  # A flush every mini-batch: every pass of mini-batch u reads version u.
  for a in (p.forward_staleness, p.backward_staleness, p.update_of[:, None] - p.weight_version):
    assert np.all(a == 0)
  assert p.versions_kept().tolist() == [1] * (K * v)


@pytest.mark.parametrize("K,m,v", [(4, 8, 2), (3, 3, 3)])
def test_interleaved_runs_megatrons_order(K, m, v):
  p = C.pipeline("interleaved", K, 2, num_microbatches=m, virtual_stages=v, forward="exponential",
                 backward=C.gamma(2.0, 1.0), comm=C.uniform(0.0, 0.3), seed=2)
  fs, fe, bs, be = p.forward_start, p.forward_end, p.backward_start, p.backward_end
  # The model is K v stages deep; activations go down and gradients up the chain of model stages.
  assert np.all(fs[:, 1:] >= fe[:, :-1]) and np.all(bs[:, :-1] >= be[:, 1:]) and np.all(bs >= fe)
  _one_pass_at_a_time(p)
  assert p.device_of.tolist() == [j % K for j in range(K * v)]
  first = slice(0, m)  # the first mini-batch
  for d in range(K):
    cols = np.flatnonzero(p.device_of == d)
    f_order = np.argsort(fs[first][:, cols].ravel())
    micro, chunk = np.divmod(f_order, v)
    # Megatron-LM's i-th forward: chunk (i // K) mod v of micro-batch (i // (K v)) K + i mod K.
    i = np.arange(m * v)
    np.testing.assert_array_equal(chunk, (i // K) % v)
    np.testing.assert_array_equal(micro, (i // (K * v)) * K + i % K)
    # Its warm-up, 2 (K - 1 - d) + (v - 1) K forwards, and the steady state's first forward precede its first
    # backward pass.
    before = int(np.sum(fs[first][:, cols] < bs[first][:, cols].min()))
    assert before == min(2 * (K - 1 - d) + (v - 1) * K + 1, m * v)


def _zb_times(rng):
  t_f, t_b = rng.uniform(0.2, 3.0, size=2)
  return t_f, t_b, rng.uniform(0.0, min(t_f, t_b))


@pytest.mark.parametrize("draw", range(6))
def test_zb_h1_bubble_is_the_closed_form(draw):
  rng = np.random.default_rng(draw)
  K = int(rng.integers(2, 7))
  m = int(rng.integers(K, K + 6))
  t_f, t_b, t_w = _zb_times(rng)
  U = 2
  p = C.pipeline("zb-h1", K, U, num_microbatches=m, forward=t_f, backward=t_b + t_w,
                 weight_fraction=t_w / (t_b + t_w))
  # Qi et al.: the bubble per mini-batch is (K - 1)(T_F + T_B - T_W).
  bubble = (K - 1) * (t_f + t_b - t_w)
  np.testing.assert_allclose(p.total_time, U * (m * (t_f + t_b + t_w) + bubble), rtol=1e-12)
  np.testing.assert_allclose(p.bubble_fraction(), bubble / (m * (t_f + t_b + t_w) + bubble), rtol=1e-12)
  # The same work as DAPPLE's one-pass backward; its bubble is (K - 1)(T_F + T_B + T_W).
  dapple = C.pipeline("dapple", K, U, num_microbatches=m, forward=t_f, backward=t_b + t_w)
  np.testing.assert_allclose(dapple.total_time - p.total_time, U * 2 * (K - 1) * t_w, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("K,m,t_f,t_b,t_w", [(4, 3, 1.0, 1.0, 1.0), (4, 2, 1.0, 1.0, 1.0), (4, 8, 1.0, 1.0, 1.5),
                                             (4, 8, 2.0, 0.5, 0.8)])
def test_zb_h1_outside_the_closed_forms_conditions_has_a_larger_bubble(K, m, t_f, t_b, t_w):
  p = C.pipeline("zb-h1", K, 2, num_microbatches=m, forward=t_f, backward=t_b + t_w,
                 weight_fraction=t_w / (t_b + t_w))
  bubble = (K - 1) * (t_f + t_b - t_w)
  assert p.bubble_fraction() > bubble / (m * (t_f + t_b + t_w) + bubble) + 1e-6


def test_zb_h1_with_equal_times_has_a_third_of_1f1bs_bubble_and_its_peak_memory():
  K, m = 4, 8
  zb = C.pipeline("zb-h1", K, 2, num_microbatches=m, forward=1.0, backward=2.0)  # T_F = T_B = T_W = 1
  dapple = C.pipeline("dapple", K, 2, num_microbatches=m, forward=1.0, backward=2.0)
  idle = lambda p: (1 - (p.busy_time().sum() / (K * p.total_time))) * K * p.total_time  # noqa: E731
  np.testing.assert_allclose(idle(zb), idle(dapple) / 3, rtol=1e-12)
  # Every device holds up to K micro-batches: the first device's 1F1B peak, the most any 1F1B device holds.
  assert zb.activations_kept().tolist() == [K] * K
  assert max(dapple.activations_kept()) == K


@pytest.mark.parametrize("K,m", [(4, 6), (3, 3)])
def test_zb_h1_versions_and_pass_order(K, m):
  U = 3
  p = C.pipeline("zb-h1", K, U, num_microbatches=m, forward="exponential", backward=C.gamma(2.0, 1.0),
                 comm=C.uniform(0.0, 0.2), weight_fraction=0.4, seed=7)
  fs, fe, bs, be, ws, we = (p.forward_start, p.forward_end, p.backward_start, p.backward_end, p.weight_start,
                            p.weight_end)
  assert np.all(fs[:, 1:] >= fe[:, :-1]) and np.all(bs[:, :-1] >= be[:, 1:]) and np.all(ws >= be)
  _one_pass_at_a_time(p)
  # The weight-gradient pass takes its share of the drawn backward time.
  np.testing.assert_allclose((we - ws) / (be - bs + we - ws), 0.4, rtol=1e-9)
  # The update follows the stage's last W pass; F, B and W of mini-batch u all read version u.
  np.testing.assert_allclose(p.update_time, we.reshape(U, m, K).max(axis=1))
  for version, start in ((p.forward_version, fs), (p.backward_version, bs), (p.weight_version, ws)):
    np.testing.assert_array_equal(version, np.repeat(p.update_of[:, None], K, axis=1))
    np.testing.assert_array_equal(version, _versions_at(p, start))
  # Stage d holds its W passes back: the W of micro-batch i follows the B of micro-batch i + d.
  for d in range(K):
    for i in range(m - d):
      assert np.all(ws[i::m][:U, d] >= be[i + d::m][:U, d])


@pytest.mark.parametrize("K,m", [(4, 4), (4, 3), (2, 1), (5, 8)])
def test_2bw_one_uniform_staleness_in_two_buffers(K, m):
  U = 12
  p = C.pipeline("2bw", K, U, num_microbatches=m)
  # W(t+1) = W(t) - lr grad f(W(t - 1)): mini-batch u reads version u - 1 at every stage, in every pass.
  want = np.repeat(np.maximum(p.update_of - 1, 0)[:, None], K, axis=1)
  for version in (p.forward_version, p.backward_version, p.weight_version):
    np.testing.assert_array_equal(version, want)
  assert np.all(p.forward_staleness[m:] == 1) and np.all(p.forward_staleness[:m] == 0)
  # The version read exists when the pass starts and is one of the stage's two newest: two buffers.
  current = _versions_at(p, p.forward_start)
  assert np.all((current - want >= 0) & (current - want <= 1))
  assert p.versions_kept().tolist() == [2] * K
  # 1F1B's timing: PipeDream's throughput, micro-batch for micro-batch (one update per micro-batch there).
  pipedream = C.pipeline("1f1b", K, U * m, num_microbatches=1, weights="stash")
  np.testing.assert_array_equal(p.forward_start, pipedream.forward_start)
  np.testing.assert_array_equal(p.backward_end, pipedream.backward_end)
  assert pipedream.versions_kept().tolist() == [min(K - k, U * m) for k in range(K)]


@pytest.mark.parametrize("schedule,K,U,m,t_f,t_b", [("2bw", 4, 5, 3, 0.7, 1.3), ("2bw", 3, 7, 2, 2.0, 0.5),
                                                     ("1f1b", 4, 10, 1, 1.0, 2.0), ("1f1b", 3, 4, 2, 1.5, 0.5)])
def test_no_flush_bubble_is_one_fill_and_drain(schedule, K, U, m, t_f, t_b):
  p = C.pipeline(schedule, K, U, num_microbatches=m, forward=t_f, backward=t_b)
  N = U * m
  np.testing.assert_allclose(p.total_time, (N + K - 1) * (t_f + t_b), rtol=1e-12)
  np.testing.assert_allclose(p.bubble_fraction(), (K - 1) / (N + K - 1), rtol=1e-12)


def test_2bw_with_random_times_keeps_its_versions():
  K, m, U = 4, 4, 10
  p = C.pipeline("2bw", K, U, num_microbatches=m, forward="exponential", backward=C.gamma(2.0, 1.0),
                 comm=C.uniform(0.0, 0.5), seed=11)
  assert np.all(p.backward_start[:, :-1] >= p.backward_end[:, 1:])
  assert np.all(p.forward_start[:, 1:] >= p.forward_end[:, :-1])
  _one_pass_at_a_time(p)
  want = np.maximum(p.update_of - 1, 0)[:, None]
  current = _versions_at(p, p.forward_start)
  assert np.all((current - want >= 0) & (current - want <= 1))
  assert max(p.versions_kept()) == 2
  np.testing.assert_allclose(p.update_time, p.backward_end.reshape(U, m, K).max(axis=1))


def test_fused_backward_schedules_report_their_weight_pass_inside_the_backward_pass():
  p = C.pipeline("1f1b", 3, 5, num_microbatches=2, weights="latest")
  np.testing.assert_array_equal(p.weight_version, p.backward_version)
  np.testing.assert_array_equal(p.weight_start, p.backward_end)
  np.testing.assert_array_equal(p.weight_end, p.backward_end)
  # A schedule built by hand without the W fields gets the same.
  q = dataclasses.replace(p, weight_version=None, weight_start=None, weight_end=None)
  np.testing.assert_array_equal(q.weight_version, p.backward_version)
  assert q.bubble_fraction() == p.bubble_fraction()


def test_bad_arguments_name_themselves():
  with pytest.raises(ValueError, match="virtual_stages=2 applies only to schedule='interleaved'"):
    C.pipeline("gpipe", 4, 2, num_microbatches=4, virtual_stages=2)
  with pytest.raises(ValueError, match="virtual_stages must be >= 2"):
    C.pipeline("interleaved", 4, 2, num_microbatches=4)
  with pytest.raises(ValueError, match="num_microbatches must be a multiple of num_stages"):
    C.pipeline("interleaved", 4, 2, num_microbatches=6, virtual_stages=2)
  with pytest.raises(TypeError, match="virtual_stages"):
    C.pipeline("interleaved", 4, 2, num_microbatches=4, virtual_stages=2.0)
  with pytest.raises(ValueError, match="num_microbatches must be >= num_stages - 1"):
    C.pipeline("2bw", 4, 2, num_microbatches=2)
  with pytest.raises(ValueError, match="weight_fraction applies only"):
    C.pipeline("1f1b", 4, 2, weight_fraction=0.5)
  with pytest.raises(ValueError, match="weight_fraction must be <= 1"):
    C.pipeline("zb-h1", 4, 2, num_microbatches=4, weight_fraction=1.5)
  with pytest.raises(ValueError, match="weights='latest' applies only to schedule='1f1b'"):
    C.pipeline("2bw", 4, 2, num_microbatches=4, weights="latest")
  with pytest.raises(ValueError, match=r"one time model per stage \(8: num_stages x virtual_stages\)"):
    C.pipeline("interleaved", 4, 2, num_microbatches=4, virtual_stages=2, forward=[1.0] * 4)


def test_plot_draws_weight_passes_and_chunks_on_their_devices():
  matplotlib = pytest.importorskip("matplotlib")
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  zb = C.pipeline("zb-h1", 3, 2, num_microbatches=3, forward="uniform", seed=1)
  bars = {c.get_label(): c.patches for c in C.plot_pipeline(zb).containers}
  np.testing.assert_allclose(sorted(b.get_width() for b in bars["weight"]),
                             np.sort((zb.weight_end - zb.weight_start).ravel()))
  plt.close("all")
  inter = C.pipeline("interleaved", 2, 1, num_microbatches=2, virtual_stages=3)
  ax = C.plot_pipeline(inter)
  bars = {c.get_label(): c.patches for c in ax.containers}
  assert "weight" not in bars
  rows = sorted(round(b.get_y() + b.get_height() / 2) for b in bars["forward"])
  assert rows == sorted([j % 2 for j in range(6)] * 2)
  # Micro-batch 1 on chunk c: model stages c K and c K + 1, a forward and a backward pass each.
  assert sorted(t.get_text() for t in ax.texts if t.get_text().startswith("1.")) == sorted(["1.0", "1.1", "1.2"] * 4)
  plt.close(ax.figure)
