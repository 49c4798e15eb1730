"""DC-ASGD (Zheng et al. 2017): delay compensation against sequential, asynchronous and synchronous SGD.

The paper trains ResNet-20 on CIFAR-10 with M = 4, 8, 16 workers and reports
the test error of sequential SGD, ASGD, SSGD, DC-ASGD-c and DC-ASGD-a. Every
method here processes the same number of gradients (``steps``, the paper's
equal-epochs protocol):

  sequential  one worker, ``steps`` updates
  ssgd        BSP with M workers: ``steps / M`` updates, each averaging M fresh gradients
  asgd        ASP with M workers: ``steps`` updates, each one stale gradient
  dc-asgd-c   ASP + ``dj.delay_compensation(lam)``            (constant lambda)
  dc-asgd-a   ASP + ``dj.delay_compensation(lam0, adaptive=True, num_workers=M)``

The worker schedules come from ``dj.cluster.simulate`` (gamma-distributed
compute times, mean 1 s) and are replayed exactly by ``dj.simulate``, which
hands each update its staleness, stale parameters and worker.

    python -m experiments run dc_asgd                     # quick: MLP on digits, 108 runs, 31 s on 2 cores
    python -m experiments run dc_asgd --scale paper --data-dir ~/data    # ResNet-20, CIFAR-10, GPU
"""

from __future__ import annotations

from typing import Any

import optax

import delayjax as dj
from . import _plots
from ._framework import Claim, ClaimResult, Comparison, Reproduction, Summary, mean_rows, paired
from ._training import learning_rate, schedule_once, seeds_like, shared_chunk_size, simulate_record, task_for

# Config. quick: where staleness costs an MLP on digits within 1000 gradients (lr 0.1, momentum 0.5), at M = 16
# and 32. The paper's claim is about M where ASGD is hurt, so both M are such M: at M = 4 every asynchronous run
# tied with sequential SGD (2.09% each on 359 test images), and at M = 8 DC-ASGD-a minus ASGD was +0.001
# [-0.002, +0.004] in training loss (5 seeds), so "at every M" could not be decided there whatever the method
# does. On 3 exploration seeds (100-102, apart from the reported 0-5) ASGD at M = 32 ended at a training loss
# of 2.06 (sequential: 0.05) and 62% test error, DC-ASGD-a at 0.14 and 7.3%; at M = 16, 0.15 against 0.09.
# A diverged run counts as infinitely bad, which a sign test decides (6 of 6 seeds is the fewest that reaches
# one-sided p <= 0.025). The claims about optimization compare final training losses (the
# test error is in the table). Seeds: 12. On seeds 0-5, DC-ASGD-a minus ASGD was -1.83 [-2.25, -1.41] at M = 32
# but -0.088 [-0.178, +0.003] at M = 16 (per-seed standard deviation 0.087), and "near sequential" was -0.14
# [-1.16, +0.89] points (std 0.98): 12 is the fewest seeds at which a t interval excludes zero (and 0.5 points)
# for differences of those sizes, fixed before seeds 6-11 ran. Nothing else changed. Measured with 12 seeds:
# -0.072 [-0.110, -0.033] at M = 16 (held), -0.30 [-0.89, +0.29] points (held), and DC-ASGD-c not held (it
# diverges on 7 and 10 of the 12 seeds). The training losses above counted the first 1,000 of digits' 1,438
# training examples (an evaluation in batches dropped the rest); over all of them, with 12 seeds: -0.076
# [-0.118, -0.034] at M = 16 (held), the same verdicts.
# DC-ASGD-c's lambda: MXNet's 0.04 (tried first) is about 20,000x weaker than DC-ASGD-a's effective
# coefficient lambda0 / sqrt(MS) on this data (measured at M = 16: 10%, 50%, 90% quantiles about 180, 830,
# 6300), so it changed nothing; 200 is of the order of that coefficient, kept below its median because a
# constant lambda also applies, unnormalized, where gradients are largest. It diverges on some seeds at
# M = 16 and 32, which the table and plots show as diverged. The paper's own CIFAR-10 value for DC-ASGD-c
# could not be confirmed from a reachable source. No lambda was chosen on this claim's verdict.
SCALES = {
    "quick": dict(data="digits", model="mlp", hidden=128, steps=1000, batch=32, lr=0.1, momentum=0.5,
                  workers=[16, 32], compute="gamma", dc_lambda=200.0, dc_lambda0=2.0, dc_mu=0.95,
                  seeds=12, eval_every=50),
    # The usual CIFAR ResNet-20 recipe (He et al. 2016): 160 epochs of batch 128, lr 0.1 divided by 10
    # at 50% and 75%; the DC-ASGD paper's exact schedule is not verified here. No data augmentation.
    "paper": dict(data="cifar10", model="resnet20", steps=62_500, batch=128, lr=0.1, momentum=0.9,
                  lr_decay_at=[0.5, 0.75], workers=[4, 8, 16], compute="gamma", dc_lambda=0.04,
                  dc_lambda0=2.0, dc_mu=0.95, seeds=1, eval_every=2500),
}
METHODS = ("ssgd", "asgd", "dc-asgd-c", "dc-asgd-a")
# Test error (%) of ResNet-20 on CIFAR-10, M = 4, from the paper (see the References page of the documentation); the
# other cells of the paper's table are not reproduced here because they were not checked against the paper.
PAPER_ERROR = {"sequential": 8.65, "asgd-M4": 9.27, "dc-asgd-a-M4": 8.19}


def specs(config: dict[str, Any]) -> list[dict[str, Any]]:
  runs = [{"key": "sequential", "method": "sequential", "workers": 1}]
  runs += [{"key": f"{method}-M{m}", "method": method, "workers": m}
           for m in config["workers"] for method in METHODS]
  return runs


def optimizer(config: dict[str, Any], method: str, num_workers: int, num_updates: int) -> optax.GradientTransformation:
  """The server's optimizer: SGD with momentum, behind the method's delay compensation."""
  sgd = optax.sgd(learning_rate(config, num_updates), momentum=config["momentum"])
  if method == "dc-asgd-c":
    return optax.chain(dj.delay_compensation(config["dc_lambda"]), sgd)
  if method == "dc-asgd-a":
    return optax.chain(dj.delay_compensation(config["dc_lambda0"], adaptive=True, momentum=config["dc_mu"],
                                             num_workers=num_workers), sgd)
  return sgd


def schedule(config: dict[str, Any], method: str, num_workers: int, seed: int) -> dj.cluster.Schedule:
  """The cluster run of a method: every method computes ``steps`` gradients in total (simulated once per process:
  it is also the ``like`` of the other seeds' runs)."""
  synchronous = method in ("sequential", "ssgd")

  def simulate() -> dj.cluster.Schedule:
    workers = dj.cluster.workers(num_workers, compute=config["compute"])
    if synchronous:
      return dj.cluster.simulate(dj.cluster.bsp(), workers, max(1, config["steps"] // num_workers), seed=seed)
    return dj.cluster.simulate(dj.cluster.asp(), workers, config["steps"], seed=seed)

  return schedule_once(simulate, "dc_asgd", synchronous, num_workers, config["compute"], config["steps"], seed)


def run(config: dict[str, Any], spec: dict[str, Any], seed: int, progress) -> dict[str, Any]:
  sched = schedule(config, spec["method"], spec["workers"], seed)
  tx = optimizer(config, spec["method"], spec["workers"], sched.num_updates)
  # Evaluations at the same fraction of the run for every method (SSGD has M times fewer updates).
  every = max(1, config["eval_every"] * sched.num_updates // config["steps"])
  # One chunk length and one program's sizes for every seed (their plans' steps and sizes differ), so that the
  # seeds share a compiled program.
  like = seeds_like(config, seed, lambda s: schedule(config, spec["method"], spec["workers"], s))
  return simulate_record(task_for(config), tx, sched, seed=seed, batch_size=config["batch"],
                         eval_every=every, progress=progress, chunk_size=shared_chunk_size(sched.num_updates),
                         like=like)


def summarize(config: dict[str, Any], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
  rows = mean_rows(records, fields=("method", "workers"))
  for r in rows:
    r["error_pct"] = 100 * r["test_error"]
    r["error_pct_std"] = 100 * r["test_error_std"]
  return rows


def _ms(summary: Summary, method: str) -> list[int]:
  return sorted({r["workers"] for r in summary.values() if r["method"] == method})


def _loss(summary: Summary, a: str, b: str, claim: str = "less") -> Comparison:
  return paired(summary, a, b, "train_loss", claim=claim, what=f"training loss {a} - {b}")


def _every_m(better: str, worse: str):
  def check(summary: Summary) -> ClaimResult:
    return ClaimResult.decide([_loss(summary, f"{better}-M{m}", f"{worse}-M{m}") for m in _ms(summary, better)])
  return check


def _asgd_degrades(summary: Summary) -> ClaimResult:
  ms = _ms(summary, "asgd")
  return ClaimResult.decide([_loss(summary, f"asgd-M{ms[-1]}", "sequential", "greater"),
                             _loss(summary, f"asgd-M{ms[-1]}", f"asgd-M{ms[0]}", "greater")])


def _dca_near_sequential(summary: Summary) -> ClaimResult:
  m = _ms(summary, "dc-asgd-a")[0]
  return ClaimResult.decide(paired(summary, f"dc-asgd-a-M{m}", "sequential", "test_error", scale=100.0, margin=0.5,
                                   what=f"test error dc-asgd-a-M{m} - sequential (points; claimed < 0.5)"))


CLAIMS = [
    Claim("asgd-degrades", "ASGD at the largest M ends with a higher training loss than sequential SGD and than "
          "ASGD at the smallest M", _asgd_degrades),
    Claim("dca-beats-asgd", "DC-ASGD-a ends with a lower training loss than ASGD at every M",
          _every_m("dc-asgd-a", "asgd")),
    Claim("dcc-beats-asgd", "DC-ASGD-c ends with a lower training loss than ASGD at every M",
          _every_m("dc-asgd-c", "asgd")),
    Claim("dca-beats-ssgd", "DC-ASGD-a ends with a lower training loss than SSGD at every M (equal gradients)",
          _every_m("dc-asgd-a", "ssgd")),
    Claim("dca-near-sequential", "DC-ASGD-a nearly reaches sequential SGD's test error (less than 0.5 points "
          "worse at the smallest M)", _dca_near_sequential),
]


def plots(config: dict[str, Any], records: list[dict[str, Any]], rows: list[dict[str, Any]], out: str) -> list[str]:
  ms = [f"M = {m}" for m in config["workers"]]
  panels = lambda spec: ms if spec["method"] == "sequential" else f"M = {spec['workers']}"  # noqa: E731
  label = lambda spec: spec["method"]  # noqa: E731
  colors = _plots.palette(("sequential",) + METHODS)
  per_m = ([r for r in rows if r["method"] != "sequential"] +
           [dict(r, workers=m) for r in rows if r["method"] == "sequential" for m in config["workers"]])
  per_m.sort(key=lambda r: (r["workers"], (("sequential",) + METHODS).index(r["method"])))
  return [
      _plots.curves(records, out, "loss_curves", y="train_loss", ylabel="training loss", log_y=True, panels=panels,
                    label=label, colors=colors),
      _plots.curves(records, out, "error_curves", panels=panels, label=label, colors=colors),
      _plots.bars(per_m, out, "loss_by_workers", x="workers", y="train_loss", series="method",
                  ylabel="final training loss", xlabel="workers M", colors=colors, log_y=True),
      _plots.bars(per_m, out, "error_by_workers", x="workers", y="error_pct", series="method",
                  ylabel="final test error (%)", xlabel="workers M", colors=colors, bounds=(0.0, 100.0)),
      _plots.staleness_histograms([r for r in records if r["spec"]["method"] == "asgd"], out,
                                  label=lambda spec: f"ASP, M = {spec['workers']}"),
  ]


REPRODUCTION = Reproduction(
    name="dc_asgd",
    paper="Zheng, Meng, Wang, Chen, Yu, Ma, Liu: Asynchronous SGD with Delay Compensation, ICML 2017",
    description="Sequential SGD, SSGD (BSP), ASGD (ASP), DC-ASGD-c and DC-ASGD-a at M = 16 and 32 workers "
                "(quick); equal number of gradients for all.",
    scales=SCALES, specs=specs, run=run, summarize=summarize, claims=CLAIMS, plots=plots,
    paper_numbers={k: {"error_pct": v} for k, v in PAPER_ERROR.items()},
    columns=("key", "train_loss", "error_pct", "updates", "simulated_time", "mean_staleness"),
    smoke=dict(steps=48, seeds=1, workers=[4], eval_every=16),
)


def main(argv: list[str] | None = None) -> int:
  """Runs this reproduction with the CLI's options (``python -m experiments.NAME --help``)."""
  from .__main__ import run_one

  return run_one(REPRODUCTION.name, argv)


if __name__ == "__main__":
  raise SystemExit(main())
