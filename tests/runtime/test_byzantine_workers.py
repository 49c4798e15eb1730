"""dj.workers.Byzantine: which pushes are attacked and what they push, against a NumPy server loop."""

import jax
import numpy as np
import optax
import pytest

import delayjax as dj
from delayjax.runtime._sampling import contribution_key, minibatch_indices
from tests.runtime.simulate_reference import regression_problem

BATCH = 4
LR = 0.05
SEED = 3


class Stop(Exception):
  pass


def _schedule(num_workers=4, num_updates=24):
  return dj.cluster.simulate(dj.cluster.asp(), dj.cluster.workers(num_workers), num_updates=num_updates, seed=5)


def _run(worker, schedule=None, **kw):
  data, loss_fn, params = regression_problem()
  return dj.simulate(loss_fn, optax.sgd(LR), params, data, _schedule() if schedule is None else schedule, seed=SEED,
                     worker=worker, sampling=dj.Sampling(batch_size=BATCH), **kw)


def _numpy_reference(schedule, attacked, forged):
  """SGD over the schedule in float64 NumPy: update ``u`` applies worker ``m``'s minibatch gradient at the version
  it read, or ``forged(u, m, draw, g)`` where ``attacked(u, m, draw)``. Returns the final ``w``, ``b`` and the
  mask of attacked updates (ASP: one contribution per update)."""
  data, _, params = regression_problem()
  x, y = data["x"].astype(np.float64), data["y"].astype(np.float64)
  versions = [np.concatenate([np.asarray(params["w"], np.float64), [float(params["b"])]])]
  contrib = schedule.contributions
  draws, mask = {}, []
  for u, (m, v) in enumerate(zip(contrib.worker.tolist(), contrib.read_version.tolist())):
    d = draws.get(m, 0)
    draws[m] = d + 1
    idx = np.asarray(minibatch_indices(SEED, u, m, d, num_examples=len(y), batch_size=BATCH))
    w = versions[v]
    err = x[idx] @ w[:-1] + w[-1] - y[idx]
    g = np.concatenate([2 * x[idx].T @ err / BATCH, [2 * err.mean()]])
    mask.append(attacked(u, m, d))
    push = forged(u, m, d, g) if mask[-1] else g
    versions.append(versions[-1] - LR * push)
  return versions[-1], np.asarray(mask)


def _uniform(u, m, d, seed=SEED):
  """The draw that decides a push under ``fraction`` (the docstring's formula)."""
  return float(jax.random.uniform(jax.random.fold_in(contribution_key(seed, u, m, d), 0)))


def _gaussian(scale):
  def forged(u, m, d, g):
    # One key per leaf, in the order of the leaves: b, then w.
    kb, kw = jax.random.split(jax.random.fold_in(contribution_key(SEED, u, m, d), 1), 2)
    b = np.asarray(jax.random.normal(kb, (), np.float32), np.float64)
    w = np.asarray(jax.random.normal(kw, (3,), np.float32), np.float64)
    return scale * np.concatenate([w, [b]])
  return forged


@pytest.mark.fast_compile
@pytest.mark.parametrize("worker, attacked, forged", [
    (dj.workers.Byzantine("sign_flip", scale=2.0, workers=[3, 1], start=5),
     lambda u, m, d: m in (1, 3) and u >= 5, lambda u, m, d, g: -2.0 * g),
    (dj.workers.Byzantine("sign_flip", scale=3.0, fraction=0.4),
     lambda u, m, d: _uniform(u, m, d) < 0.4, lambda u, m, d, g: -3.0 * g),
    (dj.workers.Byzantine("gaussian", scale=0.5, fraction=0.3, start=2),
     lambda u, m, d: u >= 2 and _uniform(u, m, d) < 0.3, _gaussian(0.5)),
], ids=["sign_flip-workers", "sign_flip-fraction", "gaussian-fraction"])
def test_attacked_pushes_and_what_they_push_match_numpy(worker, attacked, forged):
  schedule = _schedule()
  assert schedule.max_staleness.max() > 0
  res = _run(worker, schedule)
  want, mask = _numpy_reference(schedule, attacked, forged)
  # Not vacuous: some pushes are attacked and some are not.
  assert 0 < mask.sum() < len(mask)
  np.testing.assert_allclose(res.params["w"], want[:-1], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(res.params["b"], want[-1], rtol=1e-5, atol=1e-5)
  # The reference with no attack ends elsewhere: the comparison sees the attacks.
  honest, _ = _numpy_reference(schedule, lambda u, m, d: False, None)
  assert np.abs(honest[:-1] - want[:-1]).max() > 1e-3


@pytest.mark.parametrize("worker", [dj.workers.Byzantine(workers=()), dj.workers.Byzantine(fraction=0.0)],
                         ids=["no-workers", "fraction-0"])
def test_no_byzantine_worker_is_the_gradient_worker_bit_for_bit(worker):
  plain, byz = _run(dj.workers.Gradient()), _run(worker)
  for a, b in zip(jax.tree.leaves(plain.params), jax.tree.leaves(byz.params), strict=True):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(plain.history.loss, byz.history.loss)


def test_attacks_are_the_same_whatever_the_lanes_and_follow_the_seed():
  worker = dj.workers.Byzantine("gaussian", scale=0.5, fraction=0.5)
  one, four = (_run(worker, execution=dj.Execution(lanes=lanes)) for lanes in (1, 4))
  for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(four.params), strict=True):
    np.testing.assert_array_equal(a, b)
  # Which pushes are attacked is drawn from the run's seed: another seed attacks others.
  workers = _schedule().contributions.worker.tolist()
  masks = [[_uniform(u, m, workers[:u].count(m), seed) < 0.5 for u, m in enumerate(workers)]
           for seed in (SEED, SEED + 1)]
  assert masks[0] != masks[1]


@pytest.mark.fast_compile
def test_zeno_rejects_the_sign_flipped_pushes():
  """End to end with the rule it is for: every push of a sign-flipped worker fails Zeno++'s descent test."""
  data, loss_fn, params = regression_problem()
  schedule = _schedule()
  worker = dj.workers.Byzantine("sign_flip", scale=4.0, workers=[0, 2])
  res = dj.simulate(loss_fn, dj.zeno_plus_plus(LR), params, data, schedule, seed=SEED, worker=worker,
                    sampling=dj.Sampling(batch_size=BATCH))
  attacked = np.isin(schedule.contributions.worker, [0, 2])
  honest = len(attacked) - int(attacked.sum())
  state = res.opt_state
  # At most the honest pushes pass, and most of them do (each is scored against a fresh minibatch's gradient).
  assert int(state.count) == len(attacked)
  assert 0.7 * honest <= int(state.accepted) <= honest
  # Plain SGD under the same attack ends with a higher loss.
  plain = dj.simulate(loss_fn, optax.sgd(LR), params, data, schedule, seed=SEED, worker=worker,
                      sampling=dj.Sampling(batch_size=BATCH))
  assert float(res.history.loss[-4:].mean()) < float(plain.history.loss[-4:].mean())


def test_a_resumed_run_is_bit_identical_and_another_attack_is_another_run(tmp_path):
  worker = dj.workers.Byzantine("gaussian", scale=0.5, fraction=0.5)
  kw = dict(execution=dj.Execution(chunk_size=2))

  def stop(info):
    if info["chunk"] == 1:
      raise Stop

  with pytest.raises(Stop):
    _run(worker, checkpoint=dj.Checkpoint(tmp_path), record=dj.Record(callback=stop), **kw)
  with pytest.raises(ValueError, match="of a different run"):
    _run(dj.workers.Byzantine("gaussian", scale=0.6, fraction=0.5), checkpoint=dj.Checkpoint(tmp_path), **kw)
  seen = []
  resumed = _run(worker, checkpoint=dj.Checkpoint(tmp_path), record=dj.Record(callback=seen.append), **kw)
  assert seen[0]["chunk"] > 0  # it did resume, past the chunks already done
  full = _run(worker, **kw)
  for a, b in zip(jax.tree.leaves(full.params), jax.tree.leaves(resumed.params), strict=True):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(full.history.loss, resumed.history.loss)


@pytest.mark.parametrize("kwargs, err, match", [
    ({"attack": "label_flip", "workers": [0]}, ValueError,
     r"Byzantine.attack must be one of 'sign_flip', 'gaussian'; got 'label_flip'"),
    ({"fraction": 1.0}, ValueError, r"Byzantine.fraction must be in \[0, 1\) .*got 1.0"),
    ({"fraction": -0.1}, ValueError, r"Byzantine.fraction must be in \[0, 1\) .*got -0.1"),
    ({"workers": [2, -1]}, ValueError, r"Byzantine.workers\[1\] must be an integer >= 0, got -1"),
    ({"workers": [1, 1]}, ValueError, r"Byzantine.workers must name each worker once, got \[1, 1\]"),
    ({"workers": 2}, TypeError, r"Byzantine.workers must be a sequence of worker indices, got int 2"),
    ({}, ValueError, r"exactly one of workers .* and fraction .*got workers=None and fraction=None"),
    ({"workers": [0], "fraction": 0.5}, ValueError, r"exactly one of workers .*got workers=\[0\] and fraction=0.5"),
    ({"workers": [0], "scale": 0.0}, ValueError, r"Byzantine.scale must be > 0.0, got 0.0"),
    ({"workers": [0], "start": -1}, ValueError, r"Byzantine.start must be an integer >= 0, got -1"),
])
def test_bad_arguments(kwargs, err, match):
  with pytest.raises(err, match=match):
    dj.workers.Byzantine(**kwargs)


@pytest.mark.fast_compile
def test_workers_out_of_the_schedules_range():
  with pytest.raises(ValueError, match=r"Byzantine.workers must be worker indices in \[0, 4\) .*got \[4, 7\]"):
    _run(dj.workers.Byzantine(workers=[0, 4, 7]))
