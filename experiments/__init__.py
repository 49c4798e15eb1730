"""delayjax experiments: paper reproductions and benchmarks, installed beside ``delayjax``.

The public entry points, for notebooks and scripts (the command line is
``python -m experiments``)::

    import experiments
    repro = experiments.get("dc_asgd")              # a Reproduction; experiments.NAMES lists them
    config = experiments.config_for(repro, "quick")  # its settings at a scale
    result = experiments.execute(repro, config, "results/dc_asgd/quick")  # runs, resumably; tables, claims, plots
"""

from experiments._framework import Claim as Claim
from experiments._framework import Reproduction as Reproduction
from experiments._framework import config_for as config_for
from experiments._framework import execute as execute
from experiments._framework import load_results as load_results
from experiments._registry import NAMES as NAMES
from experiments._registry import all_reproductions as all_reproductions
from experiments._registry import get as get
