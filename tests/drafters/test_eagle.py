"""The EAGLE-1 head (specjax/eagle.py): features, training, resume, files,
and drafting with it in the speculative loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import train as train_configs
from specjax.formats import checkpoint
from specjax.drafters import eagle
from specjax.train import eagle as eagle_train
from specjax.decode import generation
from specjax.model import llama as model
from specjax.decode import speculative
from specjax.model import steps
from specjax.train import loop as train
from specjax.model import kv_cache as kvc
from specjax.model.config import get_preset
from specjax.model.sampling import SamplingParams

CFG = get_preset("tiny")


def _tc(steps_=8):
  return train_configs._train(steps_, 4, 16, 2e-2, 1, seed=0, ce_weight=0.1, eval_every=100,
                              eval_batches=1, ckpt_every=2, log_every=1)


@pytest.fixture(scope="module")
def stream():
  """A learnable token stream: a noisy walk over the vocabulary."""
  rng = np.random.default_rng(0)
  steps_ = rng.choice([1, 2, 3], size=4000, p=[0.7, 0.2, 0.1])
  return (np.cumsum(steps_) % CFG.vocab_size).astype(np.int32)


def test_returned_hidden_states_are_the_lm_heads_input(init_params):
  params = init_params(CFG)
  toks = jnp.asarray(np.random.default_rng(1).integers(0, CFG.vocab_size, (2, 11)), jnp.int32)
  cache = lambda: kvc.init_cache(CFG, 2, 16)
  fwd = jax.jit(model.forward, static_argnames=("cfg", "return_hidden"))
  logits0, _ = fwd(params, toks, cache(), CFG)
  logits, _, hidden = fwd(params, toks, cache(), CFG, return_hidden=True)

  @jax.jit
  def captured(params, toks, cache):  # independently: final_norm's output on the default path
    _, inter = model.Llama(CFG).apply(
        {"params": params}, toks, jnp.broadcast_to(jnp.arange(11), (2, 11)), cache,
        capture_intermediates=lambda m, _: m.name == "final_norm", mutable=["intermediates"])
    return inter["intermediates"]["final_norm"]["__call__"][0]
  want = captured(params, toks, cache())
  np.testing.assert_allclose(np.asarray(hidden), np.asarray(want), atol=1e-6)
  np.testing.assert_array_equal(np.asarray(logits), np.asarray(logits0))
  np.testing.assert_allclose(np.asarray(jax.jit(model.head_logits, static_argnums=2)(
      params, hidden, CFG)), np.asarray(logits0), atol=1e-5)
  # a ragged prefill returns the same features at every prompt position
  runner = steps.Runner(CFG, params)
  prompts = [np.asarray(toks[0, :5]).tolist(), np.asarray(toks[1]).tolist()]
  _, _, ph = runner.prefill(prompts, runner.new_cache(2, 16), return_hidden=True)
  np.testing.assert_allclose(np.asarray(ph[0, :5]), np.asarray(want[0, :5]), atol=1e-5)
  np.testing.assert_allclose(np.asarray(ph[1, :11]), np.asarray(want[1]), atol=1e-5)


KW = dict(progress=False, log=lambda _: None)


@pytest.fixture(scope="module")
def sharp_target(init_params):
  """The tiny target with unit-scale embeddings and sharp logits (at 0.02
  its next-token law is uniform and its features barely move)."""
  p = dict(init_params(CFG))
  p["embed"] = {"embedding": p["embed"]["embedding"] * 30}
  p["lm_head"] = {"kernel": p["lm_head"]["kernel"] * 50}
  return p


@pytest.fixture(scope="module")
def whole_run(sharp_target, stream, tmp_path_factory):
  """An uninterrupted 8-step run: (workdir, final head params)."""
  work = tmp_path_factory.mktemp("eagle_whole")
  params = eagle_train.train(CFG, sharp_target, _tc(), work, stream[:3000], stream[3000:], **KW)
  return work, params


def test_head_training_loss_falls(whole_run):
  losses = [r["loss"] for r in train.read_metrics(whole_run[0]) if "loss" in r]
  assert len(losses) == 8
  assert np.mean(losses[-3:]) < 0.9 * np.mean(losses[:3]), losses


def test_resume_equals_uninterrupted(sharp_target, stream, tmp_path, whole_run):
  tparams = sharp_target
  eagle_train.train(CFG, tparams, _tc(), tmp_path, stream[:3000], stream[3000:], stop_at=3, **KW)
  resumed = eagle_train.train(CFG, tparams, _tc(), tmp_path, stream[:3000], stream[3000:], **KW)
  for x, y in zip(jax.tree_util.tree_leaves(whole_run[1]), jax.tree_util.tree_leaves(resumed)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  a = [r for r in train.read_metrics(whole_run[0]) if "loss" in r]
  b = [r for r in train.read_metrics(tmp_path) if "loss" in r]
  assert [r["loss"] for r in a] == [r["loss"] for r in b]


def test_save_and_load_round_trip(tmp_path, init_params):
  hcfg = eagle.head_config(CFG)
  hp = eagle.init_head(hcfg, 3)
  eagle.save_head(tmp_path / "h", hcfg, hp, CFG, "tiny")
  hcfg2, hp2, meta = eagle.load_eagle(tmp_path / "h")
  assert hcfg2 == hcfg and meta["target"] == "tiny"
  for x, y in zip(jax.tree_util.tree_leaves(hp), jax.tree_util.tree_leaves(hp2)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ------------------------------------------------- the shipped head, drafting


@pytest.fixture(scope="module")
def shipped():
  tcfg, tparams, tok = checkpoint.load_model("stdlib-target", dtype="float32")
  from specjax.train import pair
  prompts = [tok.encode(t) for t in pair.shipped_prompts(3)]
  prompts = [prompts[0][:9], prompts[1][:40], prompts[2][:23]]  # ragged
  return steps.Runner(tcfg, tparams), prompts


@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_with_the_head_equals_greedy_target_only(shipped, gamma):
  target, prompts = shipped
  res = speculative.generate(target, None, prompts, 24, gamma, drafter="eagle")
  ref = generation.generate(target, prompts, 24)
  assert res.tokens == ref.tokens
  assert res.stats.n_accept > 0  # the acceptance paths ran
  if gamma == 4:
    assert max(np.nonzero(res.stats.accept_hist)[0]) == gamma  # and full acceptance


def test_drafts_equal_the_teacher_forced_head(shipped):
  """After a run, the next draft phase's first distribution is the head's
  output at pair n-2 of a teacher-forced pass over the whole sequence (true
  features f_0..f_{n-2}, tokens x_1..x_{n-1}): the refresh pairs the verified
  features with the right tokens and takes the right index. Its second is the
  output at pair n-1 = (g_{n-2}, d_1) of the same pass extended by that pair:
  the T=1 steps continue at the right slot, with no padding pair left."""
  target, prompts = shipped
  # the greedy gamma-4 run above (compiled once); then one sampled draft
  # phase (its q) from the final state
  gamma, drafter = 4, eagle.EagleDrafter()
  res = speculative.generate(target, None, prompts, 24, gamma, keep_state=True,
                             drafter=drafter)
  st = res.state
  sc = speculative.SpecConfig(target.cfg, None, gamma, SamplingParams(1.0), drafter=drafter)
  hcfg, hparams = sc.draft, drafter.draft_params(target.params, None)["head"]
  d, _ = eagle.draft_phase(target.params, hparams, st.dcache.hcache, st.dcache.pending,
                           st.n, jax.random.PRNGKey(5), sc)
  for b, p in enumerate(prompts):
    seq = jnp.asarray([p + res.tokens[b]], jnp.int32)  # x_0 .. x_{n-1}
    n = seq.shape[1]
    assert int(st.n[b]) == n
    _, feats = eagle_train.target_features(target.params, target.cfg, seq)
    g, _ = eagle.head_forward(hparams, target.params, feats[:, :n - 1], seq[:, 1:],
                              eagle.new_cache(hcfg, 1, n), hcfg.replace(attn_block=0),
                              target.cfg)
    want = jax.nn.softmax(model.head_logits(target.params, g[0, n - 2], target.cfg))
    np.testing.assert_allclose(np.asarray(d.q[b, 0]), np.asarray(want), atol=1e-4)
    g2, _ = eagle.head_forward(hparams, target.params,
                               jnp.concatenate([feats[:, :n - 1], g[:, n - 2:n - 1]], 1),
                               jnp.concatenate([seq[:, 1:], d.tokens[b:b + 1, :1]], 1),
                               eagle.new_cache(hcfg, 1, n + 1), hcfg.replace(attn_block=0),
                               target.cfg)
    want = jax.nn.softmax(model.head_logits(target.params, g2[0, n - 1], target.cfg))
    np.testing.assert_allclose(np.asarray(d.q[b, 1]), np.asarray(want), atol=1e-4)


def test_sampled_output_follows_the_target_law(tmp_path):
  """Exact sampling with the head drafting (its own q) leaves the output law
  the target's: tests/test_lossless.py's chi-square machinery on its V=6
  target, top-p 0.8 at gamma 2 (a random head: many rejections, so the
  residual path carries the law)."""
  import lawcheck as lossless  # pylint: disable=import-outside-toplevel
  from specjax.model import config  # pylint: disable=import-outside-toplevel
  cfg = config.ModelConfig(name="v6", vocab_size=lossless.V, dim=32, n_layers=1, n_heads=2,
                           n_kv_heads=1, ffn_dim=64, max_seq_len=32)
  target = lossless.sharpen(steps.Runner(cfg, model.init_params(cfg, 11)), 4.0)
  hcfg = eagle.head_config(cfg)
  hp = jax.tree_util.tree_map(lambda x: x * 8 if x.ndim == 2 else x, eagle.init_head(hcfg, 4))
  eagle.save_head(tmp_path / "v6-eagle", hcfg, hp, cfg, "v6")
  drafter = eagle.EagleDrafter(str(tmp_path / "v6-eagle"))
  ps = {}
  for name, gamma in (("top_p0.8", 2),):
    sp = lossless.SAMPLINGS[name]
    tokens, ks, which = lossless.sample(target, None, sp, gamma, lossless.ROWS, drafter=drafter)
    assert ks[:, 0].max() > 0  # some drafts were accepted
    for i, prompt in enumerate(lossless.PROMPTS):
      laws = lossless.exact_laws(target, target, prompt, sp, gamma)
      t = tokens[which == i]
      for j, law in enumerate(laws.pairs):
        counts = np.bincount(t[:, j] * lossless.V + t[:, j + 1], minlength=lossless.V ** 2)
        ps[f"{name} prompt {i} pair t{j},t{j + 1}"] = lossless.chi2_pvalue(counts, law)
  assert min(ps.values()) * len(ps) > lossless.ALPHA, {
      k: v for k, v in ps.items() if v * len(ps) <= lossless.ALPHA}


def test_eagle_specs_and_errors(tmp_path):
  from specjax.drafters import registry
  from specjax.errors import CheckpointError, ConfigError
  assert registry.parse("eagle") == eagle.EagleDrafter()
  d = registry.parse(f"eagle:{tmp_path}")
  assert registry.parse(d.spec) == d and hash(d) == hash(registry.parse(d.spec))
  with pytest.raises(CheckpointError, match="not found"):
    speculative.SpecConfig(CFG, None, 2, drafter=d)
  eagle.save_head(tmp_path / "h", eagle.head_config(CFG), eagle.init_head(eagle.head_config(CFG)),
                  CFG, "tiny")
  with pytest.raises(ConfigError, match="does not fit"):  # a tiny head on a wider target
    speculative.SpecConfig(get_preset("tiny-draft").replace(vocab_size=256, dim=128), None, 2,
                           drafter=f"eagle:{tmp_path / 'h'}")
