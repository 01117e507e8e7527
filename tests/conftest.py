"""Shared test fixtures, and (opt-in) XLA's persistent compilation cache.

Most of the suite's time is XLA compiling tiny models, and many tests and the
scripts they launch compile the same programs. With SPECJAX_TEST_JAX_CACHE=DIR
set, jax's persistent compilation cache lives in DIR (keyed by the program,
the jax/XLA versions and the flags, so a hit is the same executable; at most
2 GB, least recently used evicted), exported before jax is imported so the
scripts run as subprocesses share it. Warm, tests/decode/test_trees.py takes
42 s against 186 s; a cold run writes every executable and was slower (1976 s
against 1776 s for the whole suite on 2 cores), so it is off by default.

The suite also compiles with LLVM's optimisation off
(--xla_backend_optimization_level=0, appended to XLA_FLAGS here so the
scripts it launches inherit it; SPECJAX_TEST_XLA_OPT=1 keeps XLA's default).
The tests check what the programs compute, not how fast: on 2 cores this
takes 10-25 % off (tests/bench: 368 s -> 305 s; test_attention + test_lossless:
103 s -> 80 s; the SmolLM2 tests, which run a 135 M model: 128 s -> 115 s).
On jaxlib 0.10 it also turns off XLA's CPU fusion emitters and LLVM's
expensive passes (FAST_COMPILE): test_lossless + test_smollm2 379 s -> 318 s.
Tests that start a subprocess with more virtual devices add that flag to
XLA_FLAGS, not replace it.
"""

import functools
import importlib.metadata
import os


def _jaxlib_version() -> str:
  try:
    return importlib.metadata.version("jaxlib")
  except importlib.metadata.PackageNotFoundError:
    return ""


# Checked on jaxlib 0.10 (CPU): the legacy elemental emitters and LLVM's cheap
# pass set compile the speculative loop in 2 s instead of 5 s. XLA aborts on
# an unknown flag, so they are added only where they were checked.
FAST_COMPILE = ("--xla_cpu_use_fusion_emitters=false", "--xla_llvm_disable_expensive_passes=true")

if os.environ.get("SPECJAX_TEST_XLA_OPT") != "1" and \
    "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = " ".join(
      [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0"]
      + (list(FAST_COMPILE) if _jaxlib_version().startswith("0.10.") else [])).strip()

_CACHE = os.environ.get("SPECJAX_TEST_JAX_CACHE")
if _CACHE:
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
  os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(2 << 30))

import jax  # pylint: disable=wrong-import-position
import pytest  # pylint: disable=wrong-import-position

from specjax.model import llama as model_lib  # pylint: disable=wrong-import-position

if _CACHE:  # also in this process, should a plugin have imported jax before this file
  jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  jax.config.update("jax_compilation_cache_max_size",
                    int(os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"]))


# The slowest files first: with pytest-xdist (the README's command: a file per
# worker at a time, so module fixtures are set up once) the workers then finish
# together instead of one waiting out a long file at the end.
SLOW_FILES_FIRST = ("parallel/test_sharding.py", "scripts/test_scripts.py",
                    "scripts/test_script_runs.py",
                    "drafters/test_tree_drafters.py", "bench/test_sweep.py",
                    "bench/test_taskbench.py", "train/test_selfdistill.py",
                    "drafters/test_eagle.py", "decode/test_trees.py",
                    "train/test_eagle3_train.py")


def pytest_collection_modifyitems(items):
  def rank(item):
    path = str(item.path).replace(os.sep, "/")
    return next((i for i, f in enumerate(SLOW_FILES_FIRST) if path.endswith(f)),
                len(SLOW_FILES_FIRST))
  items.sort(key=rank)  # stable: the order within a file, and of the rest, is kept


@pytest.fixture(scope="session")
def init_params():
  """model.init_params memoised on (cfg, seed): each call of the original
  compiles afresh (~1 s on CPU); jax arrays are immutable, so sharing is safe."""
  cached = functools.lru_cache(maxsize=None)(model_lib.init_params)
  return lambda cfg, seed=0: cached(cfg, seed)


@pytest.fixture(scope="module")
def transformers():
  """The transformers module; skips (with the install command) without torch."""
  pytest.importorskip("torch", reason="needs torch (pip install -e '.[test]')")
  return pytest.importorskip("transformers",
                             reason="needs transformers (pip install -e '.[test]')")
