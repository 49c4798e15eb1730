"""delayjax experiments: paper reproductions and benchmarks, installed beside ``delayjax``.

Installed from the wheel this package is ``delayjax_experiments`` (a top-level
``experiments`` would shadow a user's own folder); in a checkout it is also the
folder ``experiments``, whose modules import each other relatively so that
both names work. The public entry points, for notebooks and scripts (the
command line is ``python -m delayjax_experiments``, or ``python -m experiments``
in a checkout)::

    import delayjax_experiments as experiments
    repro = experiments.get("dc_asgd")              # a Reproduction; experiments.NAMES lists them
    config = experiments.config_for(repro, "quick")  # its settings at a scale
    result = experiments.execute(repro, config, "results/dc_asgd/quick")  # runs, resumably; tables, claims, plots
"""

from ._framework import Claim as Claim
from ._framework import Reproduction as Reproduction
from ._framework import config_for as config_for
from ._framework import execute as execute
from ._framework import load_results as load_results
from ._registry import NAMES as NAMES
from ._registry import all_reproductions as all_reproductions
from ._registry import get as get
