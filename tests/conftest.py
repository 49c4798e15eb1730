"""Test set-up: 8 host CPU devices for multi-device tests, strict dtype promotion."""

import contextlib
import os
import shutil
import tempfile

# Must be set before JAX initializes its backends.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import pytest  # noqa: E402
from jax._src import compiler as _compiler  # noqa: E402

from delayjax.runtime import _engine  # noqa: E402
from tests import fast_compile  # noqa: E402

# Silent float64/float32 or int/float mixes are bugs in a library; make them fail in tests.
jax.config.update("jax_numpy_dtype_promotion", "strict")

# One JAX persistent compilation cache for the session, in a temporary folder that the xdist workers share
# (they inherit the variable from the controller, which made the folder and removes it at the end): a program
# that both workers compile (a module's fixtures, when its tests are split between them), or that a test
# compiles again after a change of compile mode cleared the caches (pytest_runtest_setup), is compiled once. A
# program read from it is the one the compiler made, so no result changes. Only the test processes use it:
# the CLI's and the kill tests' child processes compile as users' do. A cache of the user's own
# (JAX_COMPILATION_CACHE_DIR) is left as it is.
_SESSION_CACHE = "DELAYJAX_TESTS_COMPILATION_CACHE"
_OWN_SESSION_CACHE = _SESSION_CACHE not in os.environ and not os.environ.get("JAX_COMPILATION_CACHE_DIR")
if _OWN_SESSION_CACHE:
  os.environ[_SESSION_CACHE] = tempfile.mkdtemp(prefix="delayjax-tests-xla-")
if os.environ.get(_SESSION_CACHE) and not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
  jax.config.update("jax_compilation_cache_dir", os.environ[_SESSION_CACHE])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _dist_given(config):
  args = list(config.invocation_params.args) + os.environ.get("PYTEST_ADDOPTS", "").split()
  return any(a in ("--dist", "-d") or a.startswith("--dist=") for a in args)


class _WorkStealing:
  """``-n N`` without ``--dist`` splits the tests between the workers and rebalances when one runs out.

  xdist's default (``--dist load``) hands out fixed batches in collection order; a few tests here take a
  minute (a reproduction or a notebook in a process of its own), and one such batch can leave a worker idle
  at the end while the other still runs it.
  """

  @pytest.hookimpl(tryfirst=True)
  def pytest_xdist_make_scheduler(self, config, log):
    if config.getvalue("dist") != "load" or _dist_given(config):
      return None
    from xdist.scheduler import WorkStealingScheduling
    return WorkStealingScheduling(config, log)


# Test directories whose programs compile without backend optimization (``jax_disable_most_optimizations``: LLVM
# at -O0, no expensive passes) and without XLA's CPU fusion emitters (fast_compile.py), which takes a third to a
# half off a test that is mostly compilation. The runtimes' tests (tests/runtime, tests/gossip, tests/pipeline)
# are left out: they pin results bit for bit across differently shaped programs (chunkings, lanes, devices,
# resumes), which depends on the code the backend generates, so they compile as users' programs do; a test there
# that compares with a NumPy reference to a tolerance carries the fast_compile marker itself.
_FAST_COMPILE_DIRS = ("cluster", "experiments", "methods", "transforms")


def pytest_collection_modifyitems(config, items):
  tests = os.path.dirname(os.path.abspath(__file__))
  for item in items:
    where = os.path.relpath(str(item.path), tests).split(os.sep)
    if (len(where) == 1 or where[0] in _FAST_COMPILE_DIRS):
      item.add_marker("fast_compile")


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "fast_compile(fusion_emitters=False): the test's programs compile without backend optimization "
      "and, unless fusion_emitters=True, without XLA's CPU fusion emitters (set by directory, see _FAST_COMPILE_DIRS)")
  config.addinivalue_line(
      "markers",
      "standard_promotion: the test runs third-party code that is not strict-promotion clean (e.g. "
      "optax.adam's bias correction mixes float and int32)")
  if config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workerinput"):
    config.pluginmanager.register(_WorkStealing(), "delayjax-work-stealing")


def pytest_unconfigure(config):
  if _OWN_SESSION_CACHE and not hasattr(config, "workerinput"):
    shutil.rmtree(os.environ.pop(_SESSION_CACHE), ignore_errors=True)


# A fast_compile test's programs also compile with fast_compile.OVERRIDES (no fusion emitters) unless it is marked
# fast_compile(fusion_emitters=True). JAX has no option for them, so the compile options it builds get them while
# _OVERRIDES_ON says so.
_OVERRIDES_ON = [False]
_compile_options = _compiler.get_compile_options


def _fast_compile_options(*args, **kwargs):
  options = _compile_options(*args, **kwargs)
  if _OVERRIDES_ON[0]:
    options.env_option_overrides = [*options.env_option_overrides, *fast_compile.OVERRIDES]
  return options


_compiler.get_compile_options = _fast_compile_options


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
  # Before any fixture of the test, so that its module- and session-scoped fixtures compile in its mode too.
  marker = item.get_closest_marker("fast_compile")
  fast = marker is not None
  overrides = fast and not marker.kwargs.get("fusion_emitters", False)
  if (jax.config.values["jax_disable_most_optimizations"], _OVERRIDES_ON[0]) != (fast, overrides):
    # Compiled programs are cached by what they compute, not by how they were compiled (JAX's caches and
    # dj.simulate's), and the modes differ in bits (the optimized backend fuses a * b + c into one rounding):
    # a test of one mode must not be served a program compiled in another.
    jax.clear_caches()
    _engine.clear_cache()
    jax.config.update("jax_disable_most_optimizations", fast)
    _OVERRIDES_ON[0] = overrides


@pytest.fixture(autouse=True)
def _promotion_mode(request):
  marked = request.node.get_closest_marker("standard_promotion") is not None
  with jax.numpy_dtype_promotion("standard") if marked else contextlib.nullcontext():
    yield
