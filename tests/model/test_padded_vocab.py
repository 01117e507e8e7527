"""A padded vocabulary on one device (ModelConfig.vocab_multiple, what
sharding.pad_vocab sets on a mesh the model axis does not divide): the same
real weights and logits as the unpadded model, the padded logits masked,
stripped back exactly, and no NaN where a distribution meets its log. The
mesh runs (tokens against transformers, saves) are in tests/parallel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.model import config
from specjax.model import kv_cache
from specjax.model import llama as model
from specjax.model import sharding
from specjax.train import loop

V = 250
CFG = config.get_preset("tiny").replace(vocab_size=V, n_layers=1)  # padded to 256 below
PADDED = CFG.replace(vocab_multiple=8)


def logits_and_hidden(cfg, params):
  """(the forward's logits, head_logits of its hidden states) [1, 5, V]."""
  def run(params):  # jitted afresh on each call: a patched MASKED_LOGIT is traced
    tokens = jnp.asarray([[1, 7, 3, 249, 0]], jnp.int32)
    cache = kv_cache.init_cache(cfg, 1, 8)
    logits, _, hidden = model.forward(params, tokens, cache, cfg, return_hidden=True)
    return logits, model.head_logits(params, hidden, cfg)
  return jax.jit(run)(params)


@pytest.fixture(scope="module")
def pair():
  return model.init_params(CFG, 3), model.init_params(PADDED, 3)


def test_padded_model_is_the_model_with_masked_extra_ids(pair):
  plain, padded = pair
  assert PADDED.padded_vocab == 256 and CFG.padded_vocab == V
  emb, head = padded["embed"]["embedding"], padded["lm_head"]["kernel"]
  assert emb.shape == (256, CFG.dim) and head.shape == (CFG.dim, 256)
  np.testing.assert_array_equal(emb[:V], plain["embed"]["embedding"])
  np.testing.assert_array_equal(head[:, :V], plain["lm_head"]["kernel"])
  assert not emb[V:].any() and not head[:, V:].any()
  want, _ = logits_and_hidden(CFG, plain)
  for got in logits_and_hidden(PADDED, padded):  # the forward's and head_logits'
    assert got.shape[-1] == 256
    np.testing.assert_allclose(got[..., :V], want, atol=1e-6)
    assert (got[..., V:] == model.MASKED_LOGIT).all()


def test_strip_gives_the_unpadded_model_back(pair):
  plain, padded = pair
  cfg, params = model.strip_vocab(PADDED, padded)
  assert cfg == CFG
  for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(plain)):
    np.testing.assert_array_equal(a, b)


def test_pad_vocab_follows_the_model_axis():
  assert sharding.pad_vocab(CFG) == CFG  # no mesh
  for m, want in ((1, V), (2, V), (4, 252), (8, 256)):
    assert sharding.pad_vocab(CFG, m).padded_vocab == want


def kl_of_padded_logits() -> float:
  logits = model.mask_padded_logits(jnp.asarray(np.random.RandomState(0).randn(3, 256),
                                                jnp.float32), PADDED)
  return float(loop.kl_to_teacher(logits, logits * 0.5))


def test_masked_logits_leave_no_nan_in_a_kl(monkeypatch):
  """0 * log 0 where a distribution meets its log (distillation, EAGLE
  training): finite with MASKED_LOGIT; the deliberate bug, padded logits at
  -inf, gives NaN."""
  assert np.isfinite(kl_of_padded_logits())
  monkeypatch.setattr(model, "MASKED_LOGIT", -np.inf)
  assert np.isnan(kl_of_padded_logits())
