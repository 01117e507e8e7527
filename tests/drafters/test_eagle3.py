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
from specjax.drafters import vocab
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


def make_exit_head(target: steps.Runner, ids, layers, path) -> str:
  """A head that drafts well without training: `fuse` picks the third
  layer's output, fc passes it on (plus a little of the token's embedding),
  a random layer adds a little, and the target's final norm and LM head rows
  for `ids` read it: an early exit of the target, so that drafts are often
  accepted."""
  cfg, e = target.cfg, target.cfg.dim
  hcfg = eagle3.head_config(cfg)
  hp = eagle3.init_head3(hcfg, len(ids), 5)
  eye = jnp.eye(e)
  hp["fuse"] = {"kernel": jnp.concatenate([jnp.zeros((2 * e, e)), eye], 0)}
  hp["fc"] = {"kernel": hp["fc"]["kernel"].at[e:].set(eye), "bias": hp["fc"]["bias"]}
  hp["norm"] = {"scale": target.params["final_norm"]["scale"]}
  hp["lm_head"] = {"table": vocab.head_table(target.params, ids)}
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


def test_int8_weights_are_per_channel_and_the_targets_lm_head_is_not_stored(tmp_path):
  """int8: every kernel within half a step of its channel's scale, the rest
  bfloat16; a head that reads the target's LM head stores no table, and
  its drafter's params carry the target's rows of its set."""
  target = make_target(64, 1)
  hcfg = eagle3.head_config(target.cfg)
  hp = eagle3.init_head3(hcfg, len(IDS64), 3, lm_head=eagle3.LM_HEAD_TARGET)
  assert "lm_head" not in hp and eagle3.lm_head_kind(hp) == eagle3.LM_HEAD_TARGET
  eagle3.save_head3(tmp_path / "h", hcfg, hp, LAYERS, IDS64, target.cfg, "v64", dtype="int8")
  head = eagle3.load_head3(tmp_path / "h")
  assert head.meta["lm_head"] == "target" and "lm_head" not in head.params
  for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(hp)[0],
                          jax.tree_util.tree_leaves(head.params)):
    step = np.abs(np.asarray(x)).max(0) / 127 if x.ndim == 2 else np.abs(np.asarray(x)) * 2 ** -8
    assert np.all(np.abs(np.asarray(y) - np.asarray(x)) <= step / 2 + 1e-7), path
  dp = eagle3.Eagle3Drafter(str(tmp_path / "h")).draft_params(target.params, None)
  np.testing.assert_array_equal(dp["head"]["lm_head"]["table"],
                                vocab.head_table(target.params, IDS64))
  with pytest.raises(ConfigError, match="expected one of float32, bfloat16, int8"):
    eagle3.save_head3(tmp_path / "g", hcfg, hp, LAYERS, IDS64, target.cfg, "v64", dtype="fp8")


def test_a_head_of_another_format_is_one_line(tmp_path):
  target = make_target(64, 1)
  path = make_head(target, IDS64, LAYERS, tmp_path / "h")
  meta = eagle3.wd.read_json(tmp_path / "h" / eagle3.CONFIG_FILE)
  eagle3.wd.write_json(tmp_path / "h" / eagle3.CONFIG_FILE, {**meta, "format": "specjax-eagle-3"})
  with pytest.raises(CheckpointError, match=r"format 'specjax-eagle-3', expected .*retrain"):
    eagle3.load_head3(path)


def test_a_head_that_does_not_fit_is_one_line(tmp_path):
  """A head for another width, or reading a layer the target lacks, is
  refused by SpecConfig (one line); a bare eagle3 with no shipped head too."""
  target = make_target(64, 1)
  path = make_head(target, IDS64, LAYERS, tmp_path / "h")
  wide = target.cfg.replace(dim=64, n_heads=4)
  with pytest.raises(ConfigError, match=r"^EAGLE-3 head v64-eagle3 \(dim 32, vocab 64\) does "
                                        r"not fit target v64 \(dim 64, vocab 64\)$"):
    plan.SpecConfig(wide, None, 2, drafter=f"eagle3:{path}")
  with pytest.raises(ConfigError, match=r"reads layers \[0, 1, 2\]; target v64 has 2$"):
    plan.SpecConfig(target.cfg.replace(n_layers=2), None, 2, drafter=f"eagle3:{path}")
  with pytest.raises(CheckpointError, match="not found"):
    plan.SpecConfig(target.cfg, None, 2, drafter=f"eagle3:{tmp_path / 'none'}")
  shipped = ", ".join(eagle3.SHIPPED_EAGLE3) or "none yet"
  with pytest.raises(ConfigError, match=r"^no shipped EAGLE-3 head fits target v64 \(dim 32, "
                                        rf"vocab 64\); shipped: {shipped}"):
    plan.SpecConfig(target.cfg, None, 2, drafter="eagle3")
  with pytest.raises(ConfigError, match="is not accepted"):
    registry.parse(f"eagle3:{path}:vocab=full")
  d = registry.parse(f"eagle3:{path}")
  assert d == eagle3.Eagle3Drafter(path) and registry.parse(d.spec) == d


# ---------------------------------------------------------------- greedy


PROMPTS64 = [[5, 17, 42, 9], [7, 7, 7, 1, 2, 60, 33, 8, 1], [40, 1]]
DYN = trees.DynamicTree(2, 3, 6)
SHAPES = {"chain": None, "static": trees.from_paths([[0], [1], [0, 0], [1, 0], [0, 0, 0]]),
          "dynamic": DYN}


@pytest.fixture(scope="module")
def v64(tmp_path_factory):
  """(target, drafter): the V = 64 target and an early-exit head over 40 of
  its ids (make_exit_head)."""
  target = make_target(64, 1)
  ids = np.sort(np.random.default_rng(0).choice(64, 40, replace=False)).astype(np.int32)
  path = make_exit_head(target, ids, LAYERS, tmp_path_factory.mktemp("v64") / "v64-eagle3")
  return target, eagle3.Eagle3Drafter(path)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_with_the_head_equals_greedy_target_only(v64, shape):
  target, drafter = v64
  tree = SHAPES[shape]
  res = speculative.generate(target, None, PROMPTS64, 20, 3 if tree is None else tree.max_depth,
                             tree=tree, drafter=drafter)
  assert res.tokens == generation.generate(target, PROMPTS64, 20).tokens
  assert res.stats.n_accept > 0  # the acceptance paths ran


def test_a_head_reading_the_targets_lm_head_drafts_as_one_storing_it(v64, tmp_path,
                                                                    monkeypatch):
  """The early-exit head saved without its table (it is the target's rows)
  accepts exactly what the head storing them does; the deliberate bug, the
  rows gathered one id late, must not."""
  target, drafter = v64
  head = drafter.head()
  bare = {k: v for k, v in head.params.items() if k != "lm_head"}
  path = eagle3.save_head3(tmp_path / "t", head.cfg, bare, head.layers, head.ids, target.cfg,
                           "v64")
  run = lambda d: speculative.generate(target, None, PROMPTS64, 20, 3, drafter=d).stats
  want = run(drafter)
  assert run(eagle3.Eagle3Drafter(str(path))).accept_hist == want.accept_hist
  real = eagle3.with_lm_head
  monkeypatch.setattr(eagle3, "with_lm_head",
                      lambda hp, tp, ids: real(hp, tp, jnp.minimum(jnp.asarray(ids) + 1, 63)))
  assert run(eagle3.Eagle3Drafter(str(path))).accept_hist != want.accept_hist


# ---------------------------------------------------------------- the drafts, teacher-forced


@pytest.fixture(scope="module")
def sharp64(tmp_path_factory):
  """(target, drafter): the V = 64 target and a random sharp head (make_head)
  over 40 of its ids."""
  target = make_target(64, 1)
  ids = np.sort(np.random.default_rng(1).choice(64, 40, replace=False)).astype(np.int32)
  path = make_head(target, ids, LAYERS, tmp_path_factory.mktemp("sharp64") / "sharp-eagle3")
  return target, eagle3.Eagle3Drafter(path)


TF_LEN = 32  # every teacher-forced pass at one shape (causal: the padding changes nothing before it)


@functools.partial(jax.jit, static_argnames=("tcfg", "layers"))
def _fused_target_features(tparams, hparams, seq, tcfg, layers):
  cache = kvc.init_cache(tcfg, 1, seq.shape[1])
  feats3 = model.forward(tparams, seq, cache, tcfg, return_hidden=True, hidden_layers=layers)[2]
  return eagle3.fuse(hparams, feats3)


@functools.partial(jax.jit, static_argnames=("hcfg", "tcfg"))
def _head_pass(hparams, tparams, feats, toks, ids, hcfg, tcfg):
  """pairs [1, TF_LEN] -> (outputs [1, TF_LEN, E], q over target ids [1, TF_LEN, V])."""
  out = eagle3.head_forward3(hparams, tparams, feats, toks,
                             eagle3.new_cache(hcfg, 1, toks.shape[1]), hcfg, tcfg)[0]
  logits = vocab.expand(eagle3.head_logits3(hparams, out), ids, tcfg.padded_vocab)
  return out, jax.nn.softmax(logits)


def teacher_forced_q(target, head, seq, drafts):
  """The head's q of each draft [gamma, V] from passes without a cache's
  bookkeeping: pairs (fused f_i, x_{i+1}), i = 0..n-2, give the first draft's
  q at output n-2; draft j + 1's come from the same pairs followed by
  (h_{n-2+i}, d_i), i = 1..j, the head's own outputs standing in for the
  features."""
  tcfg, hcfg = target.cfg.replace(attn_block=0), head.cfg.replace(attn_block=0)
  n = len(seq)
  pad = lambda x: jnp.asarray([list(x) + [0] * (TF_LEN - len(x))], jnp.int32)
  feats = np.array(_fused_target_features(target.params, head.params, pad(seq), tcfg,
                                          head.layers))
  feats[:, n - 1:] = 0  # pairs 0..n-2 only: f_{n-1} is not known yet (on the host: no
  toks, qs = list(seq[1:]), []  # op compiled per length)
  for j, d in enumerate([None] + list(drafts[:-1])):
    if d is not None:
      feats[:, n - 2 + j] = out[:, n - 3 + j]  # h of the pair before
      toks.append(d)
    out, q = _head_pass(head.params, target.params, jnp.asarray(feats), pad(toks),
                        jnp.asarray(head.ids), hcfg, tcfg)
    out = np.asarray(out)
    qs.append(np.asarray(q[0, n - 2 + j]))
  return np.stack(qs)


@functools.partial(jax.jit, static_argnames="sc")
def _propose(dparams, dcache, tail, n, key, sc):
  """One draft phase of every row, jitted: one compile where the eager
  drafter compiled each op (again after every mutation's cache clear)."""
  return sc.drafter.propose(dparams, dcache, None, tail, n, jnp.ones(n.shape, bool), key, sc)[0]


def teacher_forced_mismatches(v, gamma: int = 4) -> list[str]:
  """Runs a greedy gamma-chain, then one sampled draft phase from its final
  state, and lists the rows whose q differ from teacher_forced_q."""
  target, drafter = v
  res = speculative.generate(target, None, PROMPTS64, 12, gamma, keep_state=True,
                             drafter=drafter)
  st = res.state
  sc = plan.SpecConfig(target.cfg, None, gamma, SamplingParams(1.0), drafter=drafter)
  dparams = sc.drafter.draft_params(target.params, None)
  d = _propose(dparams, st.dcache, st.tail, st.n, jax.random.PRNGKey(5), sc=sc)
  head, bad = eagle3.load_head3(drafter.path), []
  for b, p in enumerate(PROMPTS64):
    seq = p + res.tokens[b]
    assert int(st.n[b]) == len(seq)
    want = teacher_forced_q(target, head, seq, np.asarray(d.tokens[b]).tolist())
    err = np.max(np.abs(np.asarray(d.q[b]) - want), -1)
    bad += [f"row {b} draft {j + 1}: |q - q_tf| {e:.2g}" for j, e in enumerate(err) if e > 1e-4]
  return bad


def test_drafts_equal_the_teacher_forced_head(sharp64):
  """Every draft of a chain is the teacher-forced head's: the first from the
  fused target features (the refresh pairs them with the right tokens and
  takes the right output), the next from the head's own outputs at the
  right slots, over the right set."""
  assert teacher_forced_mismatches(sharp64) == []


def _as_property(mutated):
  return mutated if isinstance(mutated, property) else property(mutated)


# Each a one-expression bug (lawcheck.mutant) that must fail the
# teacher-forced check (the ids' one, run by hand against the sampled chain
# law below, failed it too: adjusted p 1.9e-92, at f1ed9f1+).
MUTATIONS = {
    "a child fed the fused target feature, not the head's own output": (
        eagle3, "refresh3", "eagle.root_of(out, pending", "eagle.root_of(fused, pending"),
    "the wrong layers' features (each one layer up)": (
        eagle3.Eagle3Drafter, "feature_layers", "return tuple(self.head().layers)",
        "return tuple(i + 1 for i in self.head().layers)"),
    "the reduced ids off by one in the head's LM head": (
        eagle3.Eagle3Drafter, "logits", 'dparams["ids"],', 'dparams["ids"] + 1,'),
    "every child reads the root's output, not its parent's": (
        eagle3.Eagle3Drafter, "feed", "parent[:, :, None], 1)", "0 * parent[:, :, None], 1)"),
}


def mutated(monkeypatch, bug):
  owner, name, old, new = MUTATIONS[bug]
  orig = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
  if isinstance(orig, property):
    monkeypatch.setattr(owner, name, _as_property(lawcheck.mutant(orig.fget, old, new)))
  else:
    monkeypatch.setattr(owner, name, lawcheck.mutant(orig, old, new))


@pytest.mark.parametrize("bug", list(MUTATIONS))
def test_each_deliberate_bug_fails_the_teacher_forced_check(sharp64, monkeypatch, bug):
  jax.clear_caches()
  mutated(monkeypatch, bug)
  try:
    bad = teacher_forced_mismatches(sharp64)
  finally:
    monkeypatch.undo()
    jax.clear_caches()
  print(f"MUTATION | {bug} | {len(bad)} mismatches, first: {bad[:1]}")
  assert bad


# ---------------------------------------------------------------- exact sampling (V = 6)


IDS6 = np.array([0, 2, 3, 5], np.int32)  # leaves out 1 and 4, where the target has mass
EXACT_TREE = trees.from_paths([[0], [1], [0, 0], [0, 1], [1, 0]])  # width 2, depth 2


@pytest.fixture(scope="module")
def v6(tmp_path_factory):
  """(target, drafter, law): lawcheck's V = 6 world with a 4-layer target, a
  sharp random head over IDS6, and law(prompt, sp, gamma), the exact
  acceptance law of its chain drafts jointly with t_0 (head3_acceptance_law)."""
  target = make_target(lawcheck.V, 11)
  path = make_head(target, IDS6, LAYERS, tmp_path_factory.mktemp("v6") / "v6-eagle3", seed=4)
  return target, eagle3.Eagle3Drafter(path), head3_acceptance_law(target,
                                                                    eagle3.load_head3(path))


def head3_acceptance_law(target, head):
  """law(prompt, sp, gamma) -> the law of (t_0, k1, 1[k2 > 0]) [V, gamma+1, 2]
  (lawcheck.acceptance_law) under EAGLE-3 drafting, its q from teacher-forced
  passes without a cache over every continuation of the prompt at once (as
  test_eagle.head_acceptance_law for EAGLE-1): the second step's first draft
  after x_0..x_{n-1} from the fused pairs 0..n-2, output n-2; the first
  step's d_j after the prompt (P tokens) and t_0 d_1..d_{j-1} from the fused
  pairs 0..P-1, then (h_{P-2+i}, d_i), i = 1..j-1, output P+j-2."""
  tcfg, hcfg, v = target.cfg.replace(attn_block=0), head.cfg.replace(attn_block=0), lawcheck.V

  @jax.jit
  def fused(tokens):
    cache = kvc.init_cache(tcfg, tokens.shape[0], tokens.shape[1])
    return eagle3.fuse(head.params, model.forward(target.params, tokens, cache, tcfg,
                                                  return_hidden=True,
                                                  hidden_layers=head.layers)[2])

  @jax.jit
  def head_logits(feats, tokens):  # pairs 0..T-1 -> (h [R, T, E], logits over target ids)
    cache = eagle3.new_cache(hcfg, tokens.shape[0], tokens.shape[1])
    h = eagle3.head_forward3(head.params, target.params, feats, tokens, cache, hcfg, tcfg)[0]
    return h, vocab.expand(eagle3.head_logits3(head.params, h), head.ids, tcfg.padded_vocab)

  def q_laws(prompt, sp, gamma):
    big_p, m = len(prompt), gamma + 2
    seqs = np.array(list(itertools.product(range(v), repeat=m)), np.int32)
    x = jnp.asarray(np.concatenate([np.tile(prompt, (len(seqs), 1)), seqs], 1))
    f = fused(x)                                       # f_0 .. f_{P+m-1}
    h, logits = head_logits(f[:, :-1], x[:, 1:])       # h_0 .. h_{P+m-2}
    law = lambda a, j: lawcheck.warp(np.asarray(a)[::v ** (m - j)], sp)
    q_next = [None, None] + [law(logits[:, big_p + j - 2], j) for j in range(2, m + 1)]
    q_draft, own = [None, law(logits[:, big_p - 1], 1)], [h[:, big_p - 1]]
    for j in range(2, gamma + 1):
      feats = jnp.concatenate([f[:, :big_p], jnp.stack(own, 1)], 1)
      hj, lj = head_logits(feats, x[:, 1:big_p + j])
      q_draft.append(law(lj[:, -1], j))
      own.append(hj[:, -1])
    return q_draft, q_next

  @functools.lru_cache(maxsize=None)
  def law(prompt, sp, gamma):
    p = [lawcheck.warp(x, sp) for x in lawcheck.next_token_logits(target, list(prompt), gamma + 2)]
    return lawcheck.acceptance_law(p, *q_laws(list(prompt), sp, gamma), gamma, by_first=True)
  return lambda prompt, sp, gamma: law(tuple(prompt), sp, gamma)


def test_the_reduced_set_leaves_out_ids_the_target_samples(v6):
  """The test below is only a test of the residual if the target puts mass
  where the head cannot draft."""
  target = v6[0]
  out = set(range(lawcheck.V)) - set(IDS6.tolist())
  mass = [lawcheck.warp(lawcheck.next_token_logits(target, p, 1)[1], SamplingParams(1.0))
          [:, sorted(out)].sum(-1).max() for p in lawcheck.PROMPTS]
  assert min(mass) > 0.05, mass


def test_sampled_chain_follows_the_target_and_the_heads_law(v6):
  """At T = 1, gamma 3: the output law is the target's (the residual covers
  the ids outside the set) and the accepted counts follow the law of the
  drafts the head must propose given its features."""
  target, drafter, law = v6
  ps = lawcheck.pvalues(target, target, SamplingParams(1.0), 3, lawcheck.ROWS, drafter=drafter,
                        accept_law=law)
  assert min(1.0, min(ps.values()) * len(ps)) > lawcheck.ALPHA, ps


def tree_pvalues(target, drafter, siblings, tree=EXACT_TREE) -> dict[str, float]:
  """Pair laws of the first depth + 3 tokens against the target's own."""
  return lawcheck.output_pvalues(target, None, SamplingParams(1.0), tree.max_depth + 3, tree=tree,
                                 siblings=siblings, drafter=drafter)


@pytest.mark.parametrize("siblings", ["topk", "stochastic"])
def test_sampled_static_tree_follows_the_target(v6, siblings):
  ps = tree_pvalues(v6[0], v6[1], siblings)
  assert min(1.0, min(ps.values()) * len(ps)) > lawcheck.ALPHA, ps
