"""Where delays come from (2): workers, clocks and synchronization paradigms, simulated on the host in NumPy.

Describe the workers (``workers``, with time models ``constant``, ``uniform``,
``exponential``, ``gamma``, ``lognormal``, measured times via ``replay``, and
``random_stragglers`` / ``straggler_window``; a ``link`` makes the
communication time grow with the message's bytes), pick a paradigm (``bsp``,
``asp``, ``ssp``, ``dssp``, ``psp``, ``k_sync``, ``k_async``, ``k_batch_sync``,
``k_batch_async``, ``softsync``, ``backup_workers``, ``adasync``,
``elastic_bsp``, ``predictive_cutoff``, ``gba``, ``pisces``) and ``simulate`` it into a ``Schedule``
(contributions stored sparsely, with dense ``[updates, workers]`` views)::

  >>> import delayjax as dj
  >>> w = dj.cluster.workers(8, compute="exponential", speed=[1.0] * 7 + [0.25])
  >>> sched = dj.cluster.simulate(dj.cluster.ssp(3), w, num_updates=10_000, seed=0)
  >>> sched.num_updates, sched.num_workers
  (10000, 8)

``Simulation`` hands a schedule out in chunks with loss feedback (AdaSync),
``concatenate`` joins them, and ``plot_timeline`` / ``plot_staleness`` draw one.

Decentralized (gossip) training has no server: ``simulate_gossip`` runs a
gossip paradigm (``allreduce``, ``d_psgd``, ``ad_psgd``, ``sgp``,
``gossipgrad``; optionally with ``failures``) over a ``dj.topology`` into a
``GossipSchedule``, the event record (reads, gradient applications, mixes)
that a replica runtime executes; ``plot_gossip_timeline`` and ``plot_gossip_lags``
draw one.

Model-parallel pipelines have their own schedules: ``pipeline`` simulates
GPipe, DAPPLE and PipeDream's 1F1B (with and without weight stashing, or with
vertical sync) into a ``PipelineSchedule`` (per stage and micro-batch, the
weight version of the forward and of the backward pass), and
``plot_pipeline`` draws its timeline.
"""

from delayjax.cluster._distributions import TimeModel as TimeModel
from delayjax.cluster._distributions import constant as constant
from delayjax.cluster._distributions import exponential as exponential
from delayjax.cluster._distributions import gamma as gamma
from delayjax.cluster._distributions import lognormal as lognormal
from delayjax.cluster._distributions import uniform as uniform
from delayjax.cluster._gossip import GRAD as GRAD
from delayjax.cluster._gossip import GRADS as GRADS
from delayjax.cluster._gossip import MIX as MIX
from delayjax.cluster._gossip import PARAMS as PARAMS
from delayjax.cluster._gossip import READ as READ
from delayjax.cluster._gossip import GossipParadigm as GossipParadigm
from delayjax.cluster._gossip import GossipSchedule as GossipSchedule
from delayjax.cluster._gossip import ad_psgd as ad_psgd
from delayjax.cluster._gossip import allreduce as allreduce
from delayjax.cluster._gossip import asap as asap
from delayjax.cluster._gossip import d_psgd as d_psgd
from delayjax.cluster._gossip import failures as failures
from delayjax.cluster._gossip import gossipgrad as gossipgrad
from delayjax.cluster._gossip import node_down as node_down
from delayjax.cluster._gossip import sgp as sgp
from delayjax.cluster._gossip_plot import plot_gossip_lags as plot_gossip_lags
from delayjax.cluster._gossip_plot import plot_gossip_timeline as plot_gossip_timeline
from delayjax.cluster._gossip import simulate_gossip as simulate_gossip
from delayjax.cluster._lasgd import LASGD as LASGD
from delayjax.cluster._lasgd import lasgd as lasgd
from delayjax.cluster._link import Link as Link
from delayjax.cluster._link import link as link
from delayjax.cluster._admission import VersionBudget as VersionBudget
from delayjax.cluster._admission import version_budget as version_budget
from delayjax.cluster._paradigms import Paradigm as Paradigm
from delayjax.cluster._paradigms import adasync as adasync
from delayjax.cluster._paradigms import asp as asp
from delayjax.cluster._paradigms import backup_workers as backup_workers
from delayjax.cluster._paradigms import bsp as bsp
from delayjax.cluster._paradigms import dssp as dssp
from delayjax.cluster._paradigms import elastic_bsp as elastic_bsp
from delayjax.cluster._paradigms import gba as gba
from delayjax.cluster._paradigms import pisces as pisces
from delayjax.cluster._paradigms import k_async as k_async
from delayjax.cluster._paradigms import k_batch_async as k_batch_async
from delayjax.cluster._paradigms import k_batch_sync as k_batch_sync
from delayjax.cluster._paradigms import k_sync as k_sync
from delayjax.cluster._paradigms import predictive_cutoff as predictive_cutoff
from delayjax.cluster._paradigms import psp as psp
from delayjax.cluster._paradigms import softsync as softsync
from delayjax.cluster._paradigms import ssp as ssp
from delayjax.cluster._pipeline import PipelineSchedule as PipelineSchedule
from delayjax.cluster._pipeline import pipeline as pipeline
from delayjax.cluster._pipeline_plot import plot_pipeline as plot_pipeline
from delayjax.cluster._plot import plot_staleness as plot_staleness
from delayjax.cluster._plot import plot_timeline as plot_timeline
from delayjax.cluster._schedule import Contributions as Contributions
from delayjax.cluster._schedule import Schedule as Schedule
from delayjax.cluster._schedule import concatenate as concatenate
from delayjax.cluster._simulate import Simulation as Simulation
from delayjax.cluster._simulate import simulate as simulate
from delayjax.cluster._workers import Workers as Workers
from delayjax.cluster._workers import random_stragglers as random_stragglers
from delayjax.cluster._workers import replay as replay
from delayjax.cluster._workers import straggler_window as straggler_window
from delayjax.cluster._workers import workers as workers

__all__ = [
    "ad_psgd",
    "adasync",
    "allreduce",
    "asap",
    "asp",
    "backup_workers",
    "bsp",
    "concatenate",
    "constant",
    "Contributions",
    "d_psgd",
    "dssp",
    "elastic_bsp",
    "exponential",
    "failures",
    "gamma",
    "gba",
    "gossipgrad",
    "GossipParadigm",
    "GossipSchedule",
    "GRAD",
    "GRADS",
    "k_async",
    "k_batch_async",
    "k_batch_sync",
    "k_sync",
    "LASGD",
    "lasgd",
    "Link",
    "link",
    "lognormal",
    "MIX",
    "node_down",
    "Paradigm",
    "PARAMS",
    "pipeline",
    "PipelineSchedule",
    "pisces",
    "plot_gossip_lags",
    "plot_gossip_timeline",
    "plot_pipeline",
    "plot_staleness",
    "plot_timeline",
    "predictive_cutoff",
    "psp",
    "random_stragglers",
    "READ",
    "replay",
    "Schedule",
    "sgp",
    "simulate",
    "simulate_gossip",
    "Simulation",
    "softsync",
    "ssp",
    "straggler_window",
    "TimeModel",
    "uniform",
    "Workers",
    "workers",
    "version_budget",
    "VersionBudget",
]
