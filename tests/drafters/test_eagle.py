"""The EAGLE-1 head (specjax/drafters/eagle.py, its training
specjax/train/eagle.py): features, training, resume, files, and drafting
with it in the speculative loop: greedy-exact, the drafts the teacher-forced
head gives, and exact sampling (tests/lawcheck.py's output law, and the
acceptance law of the head's own q, which deliberate bookkeeping bugs
fail)."""

import functools
import itertools

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
from specjax.decode import plan
from specjax.decode import speculative
from specjax.model import steps
from specjax.train import loop as train
from specjax.model import kv_cache as kvc
from specjax.model.config import get_preset
from specjax.model.sampling import SamplingParams

import lawcheck

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
  sc = plan.SpecConfig(target.cfg, None, gamma, SamplingParams(1.0), drafter=drafter)
  drafter = sc.drafter  # the shipped head, resolved for the target
  dparams = drafter.draft_params(target.params, None)
  hcfg, hparams = sc.draft, dparams["head"]
  d = _propose(dparams, st.dcache, st.tail, st.n, jax.random.PRNGKey(5), sc=sc)
  # every row's passes at one padded width, one compile each (both passes are
  # causal: the padding past a row's real pairs changes nothing before it)
  seqs = [p + out for p, out in zip(prompts, res.tokens)]  # x_0 .. x_{n-1}
  n = np.array([len(x) for x in seqs])
  assert np.asarray(st.n).tolist() == n.tolist()
  width, rows = int(n.max()) + 1, np.arange(len(seqs))
  seq = np.array([x + [0] * (width - len(x)) for x in seqs], np.int32)
  feats = np.array(_features(target.params, target.cfg, jnp.asarray(seq))[1])
  feats[np.arange(width)[None] >= (n - 1)[:, None]] = 0  # pairs 0..n-2 only
  toks = np.concatenate([seq[:, 1:], np.zeros_like(seq[:, :1])], 1)  # x_1 ..
  head = lambda f, t: np.asarray(_head_pass(hparams, target.params, jnp.asarray(f),
                                            jnp.asarray(t), hcfg=hcfg.replace(attn_block=0),
                                            tcfg=target.cfg))
  g = head(feats, toks)
  want = jax.nn.softmax(model.head_logits(target.params, jnp.asarray(g[rows, n - 2]), target.cfg))
  np.testing.assert_allclose(np.asarray(d.q[:, 0]), np.asarray(want), atol=1e-4)
  feats[rows, n - 1] = g[rows, n - 2]  # the pair (g_{n-2}, d_1) appended
  toks[rows, n - 1] = np.asarray(d.tokens[:, 0])
  g2 = head(feats, toks)
  want = jax.nn.softmax(model.head_logits(target.params, jnp.asarray(g2[rows, n - 1]),
                                          target.cfg))
  np.testing.assert_allclose(np.asarray(d.q[:, 1]), np.asarray(want), atol=1e-4)


_features = jax.jit(eagle_train.target_features, static_argnums=1)


@functools.partial(jax.jit, static_argnames="sc")
def _propose(dparams, dcache, tail, n, key, sc):
  """One draft phase of every row, jitted: one compile where the eager
  drafter compiled each op."""
  return sc.drafter.propose(dparams, dcache, None, tail, n, jnp.ones(n.shape, bool), key, sc)[0]


@functools.partial(jax.jit, static_argnames=("hcfg", "tcfg"))
def _head_pass(hparams, tparams, feats, tokens, *, hcfg, tcfg):
  """The head over pairs [B, W] from an empty cache: its outputs."""
  return eagle.head_forward(hparams, tparams, feats, tokens,
                            eagle.new_cache(hcfg, tokens.shape[0], tokens.shape[1]), hcfg,
                            tcfg)[0]


# ------------------------------------------------- exact sampling on a V = 6 target


@pytest.fixture(scope="module")
def v6_head(tmp_path_factory):
  """(target, drafter, law): lawcheck's V = 6 target with unit-scale
  embeddings (x30) and layer kernels x3, so that its features follow the
  tokens and the context; a head built to draft it: the target's own layer
  (its attention logits and output x4) over fc = the token's embedding +
  the feature, so that q moves with each input the bookkeeping hands it (a
  random head's q barely does: stale features and unshifted pairs passed
  unseen with one); `law(prompt, sp, gamma)` the exact acceptance law of its
  drafts, jointly with t_0 (head_acceptance_law)."""
  from specjax.model import config  # pylint: disable=import-outside-toplevel
  cfg = config.ModelConfig(name="v6", vocab_size=lawcheck.V, dim=32, n_layers=1, n_heads=2,
                           n_kv_heads=1, ffn_dim=64, max_seq_len=32)
  params = dict(model.init_params(cfg, 11))
  params["embed"] = {"embedding": params["embed"]["embedding"] * 30}
  params["layers_0"] = jax.tree_util.tree_map(lambda x: 3 * x if x.ndim == 2 else x,
                                              params["layers_0"])
  target = lawcheck.sharpen(steps.Runner(cfg, params), 4.0)
  hcfg = eagle.head_config(cfg)
  block = jax.tree_util.tree_map(lambda x: x, target.params["layers_0"])
  scale = {"wq": 2, "wk": 2, "wo": 4}  # attention logits x4, its output x4
  block["attn"] = {k: {"kernel": v["kernel"] * scale.get(k, 1)} for k, v in block["attn"].items()}
  eye = jnp.eye(cfg.dim)
  hp = {"fc": {"kernel": jnp.concatenate([eye, eye], 0), "bias": jnp.zeros(cfg.dim)},
        "block": block}
  path = eagle.save_head(tmp_path_factory.mktemp("v6") / "v6-eagle", hcfg, hp, cfg, "v6")
  hcfg, hp, _ = eagle.load_eagle(path)  # what the drafter runs
  return target, eagle.EagleDrafter(str(path)), head_acceptance_law(target, hcfg, hp)


def head_acceptance_law(target, hcfg, hparams):
  """law(prompt, sp, gamma) -> the law of (t_0, k1, 1[k2 > 0]) [V, gamma+1, 2]
  (lawcheck.acceptance_law) under EAGLE drafting, its q from teacher-forced
  passes without a cache (none of the drafter's bookkeeping: the head cache's
  rollbacks, the pending pairs, the output index), over every continuation
  of the prompt at once:
    second step's first draft after x_0..x_{n-1}: the head over the true
      pairs (f_i, x_{i+1}), i = 0..n-2, output n-2 (module docstring);
    first step's draft d_j after the prompt (P tokens) and t_0 d_1..d_{j-1}:
      the true pairs 0..P-1, then (g_{P-2+i}, d_i), i = 1..j-1 (the head's
      own predictions stand in for the features), output P+j-2."""
  tcfg = target.cfg.replace(attn_block=0)
  hcfg = hcfg.replace(attn_block=0)

  @jax.jit
  def features(tokens):
    cache = kvc.init_cache(tcfg, tokens.shape[0], tokens.shape[1])
    return model.forward(target.params, tokens, cache, tcfg, return_hidden=True)[2]

  @jax.jit
  def head_q_logits(feats, tokens):  # pairs 0..T-1 -> (g [B, T, E], logits of g [B, T, V])
    cache = eagle.new_cache(hcfg, tokens.shape[0], tokens.shape[1])
    g = eagle.head_forward(hparams, target.params, feats, tokens, cache, hcfg, tcfg)[0]
    return g, model.head_logits(target.params, g, tcfg)

  def q_laws(prompt, sp, gamma, tie_shift):
    v, big_p, m = lawcheck.V, len(prompt), gamma + 2
    seqs = np.array(list(itertools.product(range(v), repeat=m)), np.int32)
    x = jnp.asarray(np.concatenate([np.tile(prompt, (len(seqs), 1)), seqs], 1))
    f = features(x)                                    # f_0 .. f_{P+m-1}
    g, logits = head_q_logits(f[:, :-1], x[:, 1:])     # g_0 .. g_{P+m-2}
    law = lambda a, j: lawcheck.warp(np.asarray(a)[::v ** (m - j)], sp, tie_shift)
    q_next = [None, None] + [law(logits[:, big_p + j - 2], j) for j in range(2, m + 1)]
    q_draft, pred = [None, law(logits[:, big_p - 1], 1)], [g[:, big_p - 1]]
    for j in range(2, gamma + 1):
      feats = jnp.concatenate([f[:, :big_p], jnp.stack(pred, 1)], 1)
      gj, lj = head_q_logits(feats, x[:, 1:big_p + j])
      q_draft.append(law(lj[:, -1], j))
      pred.append(gj[:, -1])
    return q_draft, q_next

  @functools.lru_cache(maxsize=None)
  def law(prompt, sp, gamma, tie_shift=0.0):
    p = [lawcheck.warp(x, sp, tie_shift)
         for x in lawcheck.next_token_logits(target, list(prompt), gamma + 2)]
    return lawcheck.acceptance_law(p, *q_laws(list(prompt), sp, gamma, tie_shift), gamma,
                                   by_first=True)

  def checked(prompt, sp, gamma):
    out = law(tuple(prompt), sp, gamma)
    if sp.top_p < 1:  # near-ties at the top-p boundary move no tested cell visibly
      for shift in (-lawcheck.TIE, lawcheck.TIE):
        assert np.max(np.abs(law(tuple(prompt), sp, gamma, shift) - out)) < 1e-3
    return out
  return checked


def head_exactness(v6_head, name, gamma):
  """(Bonferroni-adjusted p-value, all p-values): lawcheck's output law and
  the head's acceptance law, one ragged batch of ROWS rows per prompt."""
  target, drafter, law = v6_head
  ps = lawcheck.pvalues(target, target, lawcheck.SAMPLINGS[name], gamma, lawcheck.ROWS,
                        drafter=drafter, accept_law=law)
  return min(1.0, min(ps.values()) * len(ps)), ps


# plain sampling at gamma 3 (the predicted-feature chain twice in a step);
# top-p at gamma 2 (q warped as p is, a filtered residual)
HEAD_CONFIGS = [("T1", 3), ("top_p0.8", 2)]


@pytest.mark.parametrize("name,gamma", HEAD_CONFIGS)
def test_sampling_with_the_head_is_exact(v6_head, name, gamma):
  """Exact sampling with the head drafting: the output law is the target's
  (rejection sampling keeps it for any q), and the accepted counts follow
  the law of the drafts the head must propose given its features, which
  only the bookkeeping's bugs change. The windows hold full and partial
  first steps often."""
  _, _, law = v6_head
  for prompt in lawcheck.PROMPTS:
    accept = law(prompt, lawcheck.SAMPLINGS[name], gamma).sum(0)
    assert accept[gamma].sum() > 0.15 and accept[:gamma].sum() > 0.1, accept
  adjusted, ps = head_exactness(v6_head, name, gamma)
  assert adjusted > lawcheck.ALPHA, {k: v for k, v in ps.items()
                                     if v * len(ps) <= lawcheck.ALPHA}


# Each a one-expression bug in the drafter (lawcheck.mutant), run at the first
# configuration above with its seed; each must fail the acceptance law.
HEAD_MUTATIONS = {
    "pending features not updated on commit (stale)": (
        eagle.EagleDrafter, "commit", "Pending(feats=pad_pairs(c.features, width),",
        "Pending(feats=dstate.pending.feats,"),
    "the wrong output index taken (k + 1)": (
        eagle, "root_index", "jnp.clip(n - 2 - pending.start", "jnp.clip(n - 1 - pending.start"),
    "pending tokens not shifted (pair (f_i, x_i), not (f_i, x_{i+1}))": (
        eagle.EagleDrafter, "commit", "tokens=pad_pairs(c.emitted, width),",
        "tokens=pad_pairs(jnp.roll(c.emitted, 1, 1), width),"),
    "pending start one slot late (the drafted pair (g, d_1) stays)": (
        eagle.EagleDrafter, "commit", "start=c.n_prev - 1,", "start=c.n_prev,"),
}


@pytest.mark.parametrize("bug", list(HEAD_MUTATIONS))
def test_each_deliberate_head_bug_fails_the_same_test(v6_head, monkeypatch, bug):
  owner, name, old, new = HEAD_MUTATIONS[bug]
  jax.clear_caches()
  monkeypatch.setattr(owner, name, lawcheck.mutant(getattr(owner, name), old, new))
  try:
    adjusted, ps = head_exactness(v6_head, *HEAD_CONFIGS[0])
  finally:
    monkeypatch.undo()
    jax.clear_caches()
  worst = min(ps, key=ps.get)
  print(f"MUTATION | {bug} | adjusted p {adjusted:.3g} | worst: {worst} ({ps[worst]:.3g})")
  assert adjusted < lawcheck.ALPHA, ps


def test_eagle_specs_and_errors(tmp_path):
  from specjax.drafters import registry
  from specjax.errors import CheckpointError, ConfigError
  assert registry.parse("eagle") == eagle.EagleDrafter()
  d = registry.parse(f"eagle:{tmp_path}")
  assert registry.parse(d.spec) == d and hash(d) == hash(registry.parse(d.spec))
  with pytest.raises(CheckpointError, match="not found"):
    plan.SpecConfig(CFG, None, 2, drafter=d)
  eagle.save_head(tmp_path / "h", eagle.head_config(CFG), eagle.init_head(eagle.head_config(CFG)),
                  CFG, "tiny")
  with pytest.raises(ConfigError, match="does not fit"):  # a tiny head on a wider target
    plan.SpecConfig(get_preset("tiny-draft").replace(vocab_size=256, dim=128), None, 2,
                           drafter=f"eagle:{tmp_path / 'h'}")


def test_own_param_count_is_the_layer_and_fc_not_the_shared_vocabulary():
  """speculative.py prints it for an EAGLE draft: the head's config counts
  the target's embedding (which the head only reads), its own count does not."""
  hcfg, _, _ = eagle.load_eagle("stdlib-eagle")
  e = hcfg.dim
  want = hcfg.num_params() - hcfg.vocab_size * e - e + (2 * e * e + e)  # no final norm; the fc
  assert model.param_count(eagle.load_eagle("stdlib-eagle")[1]) == want == 856_832
  head = eagle.EagleDrafter("stdlib-eagle")
  assert head.own_params(head.draft_params({}, None)) == want


def test_a_bare_eagle_is_the_head_shipped_for_the_target():
  """--drafter=eagle names the shipped head that fits the loaded target;
  none fitting is one line that lists them."""
  from specjax.errors import ConfigError
  stdlib = eagle.load_eagle("stdlib-eagle")[2]["target_config"]
  target = get_preset("tiny").replace(**{k: stdlib[k] for k in ("dim", "vocab_size")},
                                       name="")
  assert plan.SpecConfig(target, None, 2, drafter="eagle").drafter.path == "stdlib-eagle"
  with pytest.raises(ConfigError, match=r"no shipped EAGLE head fits target the target "
                                        r"\(dim 64, vocab 256\); shipped: stdlib-eagle"):
    plan.SpecConfig(CFG.replace(name=""), None, 2, drafter="eagle")
