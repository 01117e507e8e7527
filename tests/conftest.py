"""Shared test fixtures."""

import functools

import pytest

from specjax.model import llama as model_lib


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
