"""The reproductions the CLI knows, by name (each a module of ``experiments`` defining ``REPRODUCTION``)."""

from __future__ import annotations

import importlib

from ._framework import Reproduction

# In the order of the list; the flagship first.
NAMES = (
    "dc_asgd",
    "staleness_aware",
    "dai_staleness",
    "dssp",
    "ksync",
    "momentum",
    "federated",
    "gem",
    "local_optimizers",
    "dana",
    "delay_adaptive",
    "async_local_sgd",
    "streaming_diloco",
    "accumulation",
    "variance_reduction",
    "gossip_adpsgd",
    "gossip_topology",
    "gossip_failures",
    "gossip_acid",
    "gossip_dcs3gd",
    "gossip_layup",
    "generalization",
    "async_sgdi",
    "sme",
    "pipeline_stashing",
    "pipeline_bubbles",
    "pipeline_2bw",
    "pipeline_pipemare",
    "weight_prediction",
    "async_rl",
    "compression",
    "consistency",
    "psp",
    "zeno",
    "hsag",
    "async_prox",
    "saddle_escape",
    "sketch_project",
    "gossip_grad",
    "apam",
    "gba",
    "async_svrg_variants",
    "pisces",
    "momentum_compensation",
    "coded_gradients",
    "crossbow",
    "hpsgd",
    "lasgd",
    "asap",
    "aet_sgd",
    "gossip_unreliable",
    "pipeline_dapple",
    "pipeline_decoupled",
    "digest",
    "gpu_asgd",
)


def get(name: str) -> Reproduction:
  """The reproduction called ``name``; a ``ValueError`` lists the known names otherwise."""
  if name not in NAMES:
    raise ValueError(f"unknown reproduction {name!r}; known: {', '.join(NAMES)} (python -m experiments list).")
  return importlib.import_module(f"{__package__}.{name}").REPRODUCTION


def all_reproductions() -> list[Reproduction]:
  return [get(n) for n in NAMES]
