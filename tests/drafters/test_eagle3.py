"""The EAGLE-3-style head (specjax/drafters/eagle3.py): the target's
three-layer features, the head's files, and drafting with it: greedy-exact
for chains, static and dynamic trees; the drafts the teacher-forced head
gives (the first from the fused target features, the next from the head's
own output); exact sampling (tests/lawcheck.py) with a reduced set that
leaves out ids the target drafts; and committed deliberate bugs that must
each fail."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.decode import generation
from specjax.decode import plan
from specjax.decode import speculative
from specjax.drafters import eagle3
from specjax.drafters import registry
from specjax.errors import CheckpointError, ConfigError
from specjax.model import kv_cache as kvc
from specjax.model import llama as model
from specjax.model import steps
from specjax.model import tree as trees
from specjax.model.config import ModelConfig
from specjax.model.sampling import SamplingParams

import lawcheck


def make_target(vocab_size: int, seed: int, n_layers: int = 4) -> steps.Runner:
  """A tiny float32 target with unit-scale embeddings and layer kernels x3,
  so that its features follow the tokens and the context, sharpened x4."""
  cfg = ModelConfig(name=f"v{vocab_size}", vocab_size=vocab_size, dim=32, n_layers=n_layers,
                    n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=64)
  params = dict(model.init_params(cfg, seed))
  params["embed"] = {"embedding": params["embed"]["embedding"] * 30}
  for i in range(n_layers):
    params[f"layers_{i}"] = jax.tree_util.tree_map(lambda x: 3 * x if x.ndim == 2 else x,
                                                   params[f"layers_{i}"])
  return lawcheck.sharpen(steps.Runner(cfg, params), 4.0)


def make_head(target: steps.Runner, ids, layers, path, seed: int = 3) -> str:
  """A random head whose q moves with every input the bookkeeping hands it:
  fuse and fc at a scale that keeps features O(1), a sharp LM head."""
  cfg = target.cfg
  hcfg = eagle3.head_config(cfg)
  hp = eagle3.init_head3(hcfg, len(ids), seed)
  hp["fuse"] = {"kernel": hp["fuse"]["kernel"] * 10}
  hp["fc"] = {"kernel": hp["fc"]["kernel"] * 20, "bias": hp["fc"]["bias"]}
  hp["block"] = jax.tree_util.tree_map(lambda x: 4 * x if x.ndim == 2 else x, hp["block"])
  hp["lm_head"] = {"table": hp["lm_head"]["table"] * 60}
  eagle3.save_head3(path, hcfg, hp, layers, ids, cfg, cfg.name)
  return str(path)


LAYERS = (0, 1, 2)  # of a 4-layer target: a shifted layer is still a layer


# ---------------------------------------------------------------- features


def test_three_layer_features_are_the_layers_outputs():
  """llama.forward(hidden_layers=...) returns the concatenated outputs of
  exactly those layers (captured independently from a full forward), the
  logits unchanged; a prefill's ragged rows get the same."""
  target = make_target(64, 1)
  cfg, params = target.cfg, target.params
  toks = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 9)), jnp.int32)
  cache = lambda: kvc.init_cache(cfg, 2, 16)
  logits0, _ = model.forward(params, toks, cache(), cfg)
  logits, _, feats = model.forward(params, toks, cache(), cfg, return_hidden=True,
                                   hidden_layers=(1, 3, 2))
  _, inter = model.Llama(cfg).apply(
      {"params": params}, toks, jnp.broadcast_to(jnp.arange(9), (2, 9)), cache(),
      capture_intermediates=lambda m, _: (m.name or "").startswith("layers_"),
      mutable=["intermediates"])
  out = lambda i: inter["intermediates"][f"layers_{i}"]["__call__"][0][0]
  want = jnp.concatenate([out(1), out(3), out(2)], -1)
  assert feats.shape == (2, 9, 3 * cfg.dim)
  np.testing.assert_allclose(np.asarray(feats), np.asarray(want), atol=1e-5)
  np.testing.assert_array_equal(np.asarray(logits), np.asarray(logits0))
  prompts = [np.asarray(toks[0, :5]).tolist(), np.asarray(toks[1]).tolist()]
  _, _, ph = target.prefill(prompts, target.new_cache(2, 16), return_hidden=True,
                            hidden_layers=(1, 3, 2))
  np.testing.assert_allclose(np.asarray(ph[0, :5]), np.asarray(want[0, :5]), atol=1e-4)
  np.testing.assert_allclose(np.asarray(ph[1, :9]), np.asarray(want[1]), atol=1e-4)
  with pytest.raises(ConfigError, match="hidden_layers"):
    model.forward(params, toks, cache(), cfg, return_hidden=True, hidden_layers=(0, 4))


def test_default_layers_are_eagle3s_low_middle_high():
  assert eagle3.default_layers(30) == (2, 15, 27)  # SmolLM2-135M
  assert eagle3.default_layers(32) == (2, 16, 29)
  assert eagle3.default_layers(3) == (2, 1, 0)


# ---------------------------------------------------------------- files


IDS64 = np.array([0, 1, 2, 3, 5, 8, 13, 21, 34, 55, 63], np.int32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_save_and_load_round_trip(tmp_path, dtype):
  target = make_target(64, 1)
  hcfg = eagle3.head_config(target.cfg)
  hp = eagle3.init_head3(hcfg, len(IDS64), 3)
  eagle3.save_head3(tmp_path / "h", hcfg, hp, LAYERS, IDS64, target.cfg, "v64", special=(0,),
                    dtype=dtype)
  head = eagle3.load_head3(tmp_path / "h")
  assert head.cfg == hcfg and head.layers == LAYERS and head.meta["target"] == "v64"
  np.testing.assert_array_equal(head.ids, IDS64)
  tol = 0 if dtype == "float32" else 2 ** -8
  for x, y in zip(jax.tree_util.tree_leaves(hp), jax.tree_util.tree_leaves(head.params)):
    assert y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=tol, atol=1e-7)
