"""dj.workers.Rollouts in dj.simulate against a sequential NumPy reference of asynchronous policy gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj

NUM_WORKERS, ROWS, BATCH, LR = 3, 5, 4, 0.5


def _softmax(z):
  e = np.exp(z - z.max(axis=-1, keepdims=True))
  return e / e.sum(axis=-1, keepdims=True)


def _setup(seed=0):
  task = dj.problems.contextual_bandit(6, 3, max_length=6, noise=0.0, seed=seed)
  prompts = np.random.default_rng(seed).integers(0, 6, (NUM_WORKERS, ROWS, BATCH))
  times = task.generation_times(prompts, per_token=1.0, overhead=0.5)
  sched = dj.cluster.simulate(dj.cluster.asp(), dj.cluster.workers(NUM_WORKERS, compute=times), 24, seed=seed)
  return task, prompts, sched


def _generate(task):
  # Deterministic actions (a function of the prompt), so the reference needs no PRNG: what varies with the
  # version read is the behaviour log-prob, hence the importance weight.
  def generate(params, key, contexts):
    del key
    actions = ((contexts * 2 + 1) % task.num_actions).astype(jnp.int32)
    means = jnp.asarray(task.means, jnp.float32)[contexts, actions]
    return {"contexts": contexts, "actions": actions, "rewards": means,
            "behaviour_logp": task.log_prob(params, contexts, actions)}
  return generate


def _reference(task, prompts, sched, weight_fn, max_staleness=None, lag_weight=None):
  """theta_{u+1} = theta_u - lr * g_u, g_u = -(1/kept) sum_i w_i A_i grad log pi_{theta_u}(a_i|s_i).

  With ``lag_weight``, w_i is multiplied by lag_weight(u - v): a correction that depends on the staleness.
  """
  thetas = [np.zeros((task.num_contexts, task.num_actions))]
  count = np.zeros(NUM_WORKERS, int)
  for u in range(sched.num_updates):
    (m,) = np.flatnonzero(sched.contributes[u])
    v = sched.read_version[u, m]
    s = prompts[m, count[m] % ROWS]
    count[m] += 1
    a = (s * 2 + 1) % task.num_actions
    adv = task.means[s, a] - task.means[s, a].mean()
    pi, mu = _softmax(thetas[u]), _softmax(thetas[v])
    ratio = pi[s, a] / mu[s, a]
    keep = max_staleness is None or u - v <= max_staleness
    g = np.zeros_like(thetas[u])
    if keep:
      w = weight_fn(ratio) * (1.0 if lag_weight is None else lag_weight(u - v))
      for i in range(BATCH):
        g[s[i]] -= w[i] * adv[i] * (np.eye(task.num_actions)[a[i]] - pi[s[i]]) / BATCH
    thetas.append(thetas[u] - LR * g)
  return thetas[-1]


@pytest.mark.parametrize("name, correction, weight, budget", [
    ("none", dj.no_correction(), lambda r: np.ones_like(r), None),
    ("tis", dj.truncated_is(1.05), lambda r: np.minimum(r, 1.05), None),
    ("discard", dj.importance_weighting(), lambda r: r, 2),
])
@pytest.mark.fast_compile
def test_rollouts_in_simulate_match_a_sequential_reference(name, correction, weight, budget):
  task, prompts, sched = _setup()
  assert sched.staleness[sched.contributes].max() > 2  # stale enough for the corrections and the budget to act
  worker = dj.workers.Rollouts(_generate(task), lambda p, r: task.log_prob(p, r["contexts"], r["actions"]),
                               correction=correction, max_staleness=budget, prompts=prompts)
  data = {"context": np.arange(task.num_contexts, dtype=np.int32)}
  loss_fn = lambda p, batch: jnp.mean(p["logits"][batch["context"]] ** 2)  # unused by the learner's gradient
  result = dj.simulate(loss_fn, optax.sgd(LR), task.init_params(), data, sched, seed=0,
                       sampling=dj.Sampling(batch_size=2), worker=worker)
  want = _reference(task, prompts, sched, weight, budget)
  np.testing.assert_allclose(np.asarray(result.params["logits"]), want, rtol=1e-5, atol=1e-6)


def test_same_seed_same_run_and_the_key_is_used():
  task, prompts, sched = _setup(1)
  worker = dj.workers.Rollouts(task.sample, lambda p, r: task.log_prob(p, r["contexts"], r["actions"]),
                               correction=dj.truncated_is(2.0), prompts=prompts)
  data = {"context": np.arange(task.num_contexts, dtype=np.int32)}
  loss_fn = lambda p, batch: jnp.mean(p["logits"][batch["context"]] ** 2)
  run = lambda seed: np.asarray(dj.simulate(loss_fn, optax.sgd(LR), task.init_params(), data, sched, seed=seed,
                                            sampling=dj.Sampling(batch_size=2), worker=worker).params["logits"])
  a, b, c = run(0), run(0), run(1)
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)  # the rollouts' actions are drawn from the contribution's key


def test_bad_rollout_workers_are_refused():
  task, prompts, _ = _setup()
  lp = lambda p, r: task.log_prob(p, r["contexts"], r["actions"])
  with pytest.raises(TypeError, match="generate"):
    dj.workers.Rollouts("sample", lp)
  with pytest.raises(TypeError, match="correction"):
    dj.workers.Rollouts(task.sample, lp, correction="tis")
  with pytest.raises(ValueError, match="max_staleness"):
    dj.workers.Rollouts(task.sample, lp, max_staleness=-1)
  with pytest.raises(ValueError, match="prompts"):
    dj.workers.Rollouts(task.sample, lp, prompts=np.zeros((3, 4)))
  with pytest.raises(ValueError, match="one row per worker"):
    dj.workers.Rollouts(task.sample, lp, prompts=prompts).bind(NUM_WORKERS + 1, NUM_WORKERS + 1)
  with pytest.raises(ValueError, match="prompts"):
    task.generation_times(np.full((2, 3), 99))


def test_the_compile_cache_tells_corrections_apart():
  # Two workers that differ only in their correction must not share a compiled program.
  task, prompts, sched = _setup()
  data = {"context": np.arange(task.num_contexts, dtype=np.int32)}
  loss_fn = lambda p, batch: jnp.mean(p["logits"][batch["context"]] ** 2)
  out = []
  for correction in (dj.no_correction(), dj.importance_weighting()):
    worker = dj.workers.Rollouts(_generate(task), lambda p, r: task.log_prob(p, r["contexts"], r["actions"]),
                                 correction=correction, prompts=prompts)
    out.append(np.asarray(dj.simulate(loss_fn, optax.sgd(LR), task.init_params(), data, sched, seed=0,
                                      sampling=dj.Sampling(batch_size=2), worker=worker).params["logits"]))
  np.testing.assert_allclose(out[1], _reference(task, prompts, sched, lambda r: r), rtol=1e-5, atol=1e-6)


def test_the_lag_reaches_a_correction_that_uses_it():
  # A correction of one's own whose weight halves per version of lag: the simulated run must apply, to each
  # contribution, the weight of its own staleness u - v (the NumPy reference reads u - v from the schedule).
  task, prompts, sched = _setup()
  lags = sched.staleness[sched.contributes]
  assert len(set(lags.tolist())) > 2  # several different lags, so a wrong or constant lag would show

  def objective(logp, behaviour_logp, advantages, staleness):
    assert staleness.shape == logp.shape and staleness.dtype == jnp.int32
    weight = jnp.exp(logp - behaviour_logp) * 0.5 ** staleness.astype(logp.dtype)
    return jax.lax.stop_gradient(weight * advantages) * logp

  halve = dj.Correction(objective, "halve_per_version", uses_staleness=True)
  worker = dj.workers.Rollouts(_generate(task), lambda p, r: task.log_prob(p, r["contexts"], r["actions"]),
                               correction=halve, prompts=prompts)
  data = {"context": np.arange(task.num_contexts, dtype=np.int32)}
  loss_fn = lambda p, batch: jnp.mean(p["logits"][batch["context"]] ** 2)
  result = dj.simulate(loss_fn, optax.sgd(LR), task.init_params(), data, sched, seed=0,
                       sampling=dj.Sampling(batch_size=2), worker=worker)
  got = np.asarray(result.params["logits"])
  np.testing.assert_allclose(got, _reference(task, prompts, sched, lambda r: r, lag_weight=lambda lag: 0.5 ** lag),
                             rtol=1e-5, atol=1e-6)
  # Without the lag's weight the run would be plain importance weighting: far from it.
  assert not np.allclose(got, _reference(task, prompts, sched, lambda r: r), rtol=1e-3, atol=1e-4)
