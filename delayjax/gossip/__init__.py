"""Decentralized (gossip) methods: per-replica rules that ``dj.simulate_gossip`` runs on a gossip schedule.

:func:`layup` and :func:`accelerated_sgd` are the library's constructions
from their papers' abstracts (their rules could not be confirmed from a
reachable source); their docstrings say what is confirmed and what is not.
"""

from delayjax.gossip._a2cid2 import A2CiD2State as A2CiD2State
from delayjax.gossip._a2cid2 import a2cid2 as a2cid2
from delayjax.gossip._a2cid2 import acid_constants as acid_constants
from delayjax.gossip._accelerated import AcceleratedState as AcceleratedState
from delayjax.gossip._accelerated import accelerated_sgd as accelerated_sgd
from delayjax.gossip._aet import AETState as AETState
from delayjax.gossip._aet import aet_sgd as aet_sgd
from delayjax.gossip._averaging import PushSumState as PushSumState
from delayjax.gossip._averaging import ad_psgd as ad_psgd
from delayjax.gossip._averaging import d_psgd as d_psgd
from delayjax.gossip._averaging import gossip_grad as gossip_grad
from delayjax.gossip._averaging import sgp as sgp
from delayjax.gossip._dc_s3gd import DCS3GDState as DCS3GDState
from delayjax.gossip._dc_s3gd import dc_s3gd as dc_s3gd
from delayjax.gossip._hpsgd import HPSGDState as HPSGDState
from delayjax.gossip._hpsgd import hpsgd as hpsgd
from delayjax.gossip._lasgd import LASGDState as LASGDState
from delayjax.gossip._lasgd import lasgd as lasgd
from delayjax.gossip._layup import LayUpState as LayUpState
from delayjax.gossip._layup import layup as layup
from delayjax.gossip._method import GossipMethod as GossipMethod
from delayjax.gossip._method import check_method_schedule as check_method_schedule
from delayjax.gossip._sma import SMAState as SMAState
from delayjax.gossip._sma import sma as sma

__all__ = [
    "a2cid2",
    "A2CiD2State",
    "accelerated_sgd",
    "AcceleratedState",
    "acid_constants",
    "ad_psgd",
    "aet_sgd",
    "AETState",
    "check_method_schedule",
    "d_psgd",
    "dc_s3gd",
    "DCS3GDState",
    "gossip_grad",
    "GossipMethod",
    "hpsgd",
    "HPSGDState",
    "lasgd",
    "LASGDState",
    "layup",
    "LayUpState",
    "PushSumState",
    "sgp",
    "sma",
    "SMAState",
]
