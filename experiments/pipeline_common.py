"""The staged model the pipeline reproductions train: an MLP on digits cut into K stages.

The MLP has ``layers`` dense layers (``tanh`` after all but the last, which
maps to the 10 classes); stage ``k`` holds ``layers / K`` consecutive ones, so
one model can be cut into shallow or deep pipelines. The run record has the same form as the data-parallel
reproductions' (``metrics``, ``curves`` against updates and simulated time),
so the framework's tables and plots apply.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import delayjax as dj
from ._framework import Progress


def _stage(last: bool):
  def apply(params: list[dict[str, jax.Array]], h: jax.Array) -> jax.Array:
    for i, layer in enumerate(params):
      h = h @ layer["w"] + layer["b"]
      if not (last and i == len(params) - 1):
        h = jnp.tanh(h)
    return h

  return apply


_HIDDEN, _OUTPUT = _stage(False), _stage(True)


def loss_fn(logits: jax.Array, batch: dict[str, jax.Array]) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def stages(num_stages: int) -> list[Any]:
  return [_HIDDEN] * (num_stages - 1) + [_OUTPUT]


def init(num_stages: int, layers: int, width: int, seed: int, inputs: int = 64,
         classes: int = 10) -> list[list[dict[str, jax.Array]]]:
  """LeCun-normal weights (NumPy's generator: nothing to compile), zero biases; stage ``k`` gets layers
  ``k L/K .. (k+1) L/K - 1``. The weights depend on the seed and ``layers`` only, not on ``num_stages``.
  """
  if layers % num_stages:
    raise ValueError(f"layers ({layers}) must be a multiple of num_stages ({num_stages}).")
  sizes = [inputs] + [width] * (layers - 1) + [classes]
  rng = np.random.default_rng(seed)
  dense = [{"w": jnp.asarray(rng.standard_normal((a, b)) / np.sqrt(a), jnp.float32),
            "b": jnp.zeros((b,), jnp.float32)} for a, b in zip(sizes[:-1], sizes[1:])]
  per = layers // num_stages
  return [dense[k * per:(k + 1) * per] for k in range(num_stages)]


def digits_data() -> tuple[dict[str, np.ndarray], dict[str, jax.Array]]:
  from .data import digits

  split = digits()
  train = {"x": split.x_train, "y": split.y_train}
  test = {"x": jnp.asarray(split.x_test), "y": jnp.asarray(split.y_test),
          "x_train": jnp.asarray(split.x_train), "y_train": jnp.asarray(split.y_train)}
  return train, test


@jax.jit
def _evaluate(params: list[Any], test: dict[str, jax.Array]) -> dict[str, jax.Array]:
  # Module level, the data an argument: compiled once per model shape, not once per run.
  def logits(x):
    for f, p in zip(stages(len(params)), params):
      x = f(p, x)
    return x

  error = jnp.mean(jnp.argmax(logits(test["x"]), -1) != test["y"]).astype(jnp.float32)
  train_loss = loss_fn(logits(test["x_train"]), {"y": test["y_train"]})
  return {"test_error": error, "train_loss": train_loss}


def evaluator(test: dict[str, jax.Array]):
  return lambda params: _evaluate(list(params), test)


class Training(NamedTuple):
  """What a pipeline reproduction trains for one run: the config the record reads (``batch``, ``layers``,
  ``width``, ``eval_every``), the schedule, the optimizer (``None``: the schedule alone is measured, nothing is
  trained) and ``dj.simulate_pipeline``'s form of a backward pass at newer weights."""

  config: dict[str, Any]
  schedule: dj.cluster.PipelineSchedule
  tx: optax.GradientTransformation | None
  backward: str = "recompute"


Plan = Callable[[dict[str, Any], dict[str, Any], int], Training]
Finish = Callable[[dict[str, Any], dict[str, Any], dj.cluster.PipelineSchedule, dict[str, Any]], dict[str, Any]]


def run_one(config: dict[str, Any], spec: dict[str, Any], seed: int, progress: Progress, plan: Plan,
            finish: Finish) -> dict[str, Any]:
  """A reproduction's ``run``: ``finish(config, spec, schedule, record)`` of the record of ``plan(config, spec,
  seed)``'s training (:func:`pipeline_record`), or of its schedule alone (:func:`schedule_record`)."""
  training = plan(config, spec, seed)
  if training.tx is None:
    record = schedule_record(training.schedule, progress)
  else:
    record = pipeline_record(training.config, training.schedule, training.tx, seed, progress, training.backward)
  return finish(config, spec, training.schedule, record)


def runners(plan: Plan, finish: Finish) -> tuple[Callable[..., dict[str, Any]], Callable[..., list[dict[str, Any]]]]:
  """A pipeline reproduction's ``run`` (:func:`run_one`) and ``run_batch`` (:func:`run_many`, with
  ``batch=batch_key``: a spec's seeds in one call, side by side, each record as its own run's bit for bit), of its
  module-level ``plan`` and ``finish``: partial applications, which ``--jobs`` sends to its worker processes."""
  return functools.partial(run_one, plan=plan, finish=finish), functools.partial(run_many, plan=plan, finish=finish)


def as_trained(config: dict[str, Any], spec: dict[str, Any], schedule: dj.cluster.PipelineSchedule,
               record: dict[str, Any]) -> dict[str, Any]:
  """The :data:`Finish` of a reproduction that reports the record as trained."""
  del config, spec, schedule
  return record


def batch_key(config: dict[str, Any], spec: dict[str, Any], seed: int) -> str:
  """The runs computed together (:func:`run_many`): every seed of one spec."""
  del config, seed
  return spec["key"]


def run_many(config: dict[str, Any], members: list[tuple[dict[str, Any], int]], progress: Progress, plan: Plan,
             finish: Finish) -> list[dict[str, Any]]:
  """A reproduction's ``run_batch`` for the seeds of one spec (:func:`batch_key`): their records, each equal to
  :func:`run_one`'s bit for bit, trained in one ``dj.simulate_pipeline`` call (:func:`pipeline_records`)."""
  if len({spec["key"] for spec, _ in members}) > 1:
    raise ValueError(f"runs computed together are seeds of one spec (batch_key); got "
                     f"{[(spec['key'], seed) for spec, seed in members]}.")
  trainings = [plan(config, spec, seed) for spec, seed in members]
  first = trainings[0]
  if first.tx is None:
    records = [schedule_record(t.schedule, progress) for t in trainings]
  else:
    records = pipeline_records(first.config, [(t.schedule, seed) for t, (_, seed) in zip(trainings, members)],
                               first.tx, progress, first.backward)
  return [finish(config, spec, t.schedule, record)
          for (spec, _), t, record in zip(members, trainings, records, strict=True)]


def schedule_record(schedule: dj.cluster.PipelineSchedule, progress: Progress) -> dict[str, Any]:
  """The record of a schedule measured without training: its simulated time, bubbles, staleness and versions."""
  progress(schedule.num_updates, schedule.num_updates)
  return {"metrics": {"simulated_time": schedule.total_time, "bubble_fraction": schedule.bubble_fraction(),
                      "mean_staleness": float(schedule.forward_staleness.mean()),
                      "versions_kept": int(schedule.versions_kept().sum())}}


def pipeline_record(config: dict[str, Any], schedule: dj.cluster.PipelineSchedule, tx: optax.GradientTransformation,
                    seed: int, progress: Progress, backward: str = "recompute") -> dict[str, Any]:
  """Trains the staged MLP on ``schedule`` with ``tx`` (``backward``: ``dj.simulate_pipeline``'s form of a
  backward pass at newer weights) and returns the run record.

  ``metrics``: the final ``test_error`` and ``train_loss`` (NaN when the run
  diverged: not finite, or above chance level), ``diverged`` (0 or 1), ``simulated_time``, ``bubble_fraction``,
  ``mean_staleness`` (forward passes, all stages) and ``versions_kept``
  (summed over stages); ``curves``: ``update``, ``time`` and both metrics.
  """
  return pipeline_records(config, [(schedule, seed)], tx, progress, backward)[0]


def pipeline_records(config: dict[str, Any], runs: list[tuple[dj.cluster.PipelineSchedule, int]],
                     tx: optax.GradientTransformation, progress: Progress,
                     backward: str = "recompute") -> list[dict[str, Any]]:
  """:func:`pipeline_record` of several ``(schedule, seed)`` runs with one ``tx``: one ``dj.simulate_pipeline``
  call with ``seed=dj.Runs(...)`` (its own schedule and initial weights each; the runs computed side by side,
  each equal to its single call bit for bit), or the single call for one run."""
  # Model stages: K devices times their virtual stages (interleaved 1F1B), one stage function each.
  K = runs[0][0].num_model_stages
  train, test = digits_data()
  total = sum(schedule.num_updates for schedule, _ in runs)
  progress(0, total)
  options = dict(sampling=dj.Sampling(config["batch"]),
                 record=dj.Record(eval_fn=evaluator(test), every=config["eval_every"]), backward=backward)
  starts = [init(K, config["layers"], config["width"], seed) for _, seed in runs]
  if len(runs) == 1:
    (schedule, seed), = runs
    results = [dj.simulate_pipeline(stages(K), loss_fn, tx, starts[0], train, schedule, seed=seed, **options)]
  else:
    results = dj.simulate_pipeline(
        stages(K), loss_fn, tx, starts[0], train, None,
        seed=dj.Runs(seeds=[seed for _, seed in runs], sources=[schedule for schedule, _ in runs], params=starts),
        **options)
  progress(total, total)
  return [_record(schedule, result) for (schedule, _), result in zip(runs, results, strict=True)]


def _record(schedule: dj.cluster.PipelineSchedule, result: Any) -> dict[str, Any]:
  h = result.history
  metrics = {k: np.asarray(v, np.float64) for k, v in h.eval_metrics.items()}
  final = {k: float(v[-1]) for k, v in metrics.items()}
  # Chance level is ln 10 = 2.3: ending above it (or not finite) counts as diverged.
  diverged = not all(np.isfinite(v) for v in final.values()) or final["train_loss"] > float(np.log(10.0))
  if diverged:
    final = {k: float("nan") for k in final}
  return {
      "metrics": {**final, "diverged": float(diverged), "simulated_time": float(h.time[-1]),
                  "bubble_fraction": schedule.bubble_fraction(),
                  "mean_staleness": float(schedule.forward_staleness.mean()),
                  "versions_kept": int(schedule.versions_kept().sum())},
      "curves": {"update": h.eval_update, "time": h.eval_time, **metrics},
  }
