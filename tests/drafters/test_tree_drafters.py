"""Token trees drafted by the n-gram and EAGLE drafters (issue 25):
greedy tree speculation equals greedy target-only output on a ragged batch,
a chain-shaped tree is the chain drafter, n-gram branches are the distinct
continuations of different matches and n (rank 0 the chain's proposal),
every node the head drafts is the head run as a chain along its path, the
head's cache after a tree run holds the teacher-forced pairs of the output,
on an EAGLE-2 dynamic tree every fed node is the head run as a chain along
its path and every kept node's children its top-k there, and sampled tree speculation follows the target's law (chi-square, as in
tests/decode/test_trees.py). MUTATIONS are deliberate bugs, each failing a
check."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.decode import generation
from specjax.decode import plan
from specjax.decode import speculative
from specjax.decode import tree_step
from specjax.drafters import base
from specjax.drafters import dynamic
from specjax.drafters import eagle
from specjax.drafters import ngram
from specjax.drafters import walkers
from specjax.errors import ConfigError
from specjax.model import config
from specjax.model import llama as model
from specjax.model import steps
from specjax.model import tree as trees
from specjax.model.sampling import SamplingParams
from specjax.train import eagle as eagle_train

import lawcheck

MEDUSA = trees.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]])
EXACT_TREE = trees.from_paths([[0], [1], [0, 0], [0, 1], [1, 0]])  # width 2, depth 2

# ---------------------------------------------------------------- fixtures

CFG3 = config.get_preset("tiny").replace(name="tiny3", n_layers=3)
NGRAM_PROMPTS = [[5, 17, 42, 9, 100, 5, 17], [7, 7, 7], [200, 1, 64, 3, 9, 81, 27, 2, 64, 3]]
N = 30


@pytest.fixture(scope="module")
def peaked(init_params):
  """tests/drafters/test_drafters.py's target: peaked logits, so greedy
  output repeats and the n-gram drafter finds matches; its greedy output."""
  params = dict(init_params(CFG3, 1))
  params["lm_head"] = {"kernel": params["lm_head"]["kernel"] * 40.0}
  target = steps.Runner(CFG3, params)
  return target, generation.generate(target, NGRAM_PROMPTS, N).tokens


def _v6(tmp_path_factory, prev_token: bool):
  """(target, drafter): lawcheck's V = 6 target made feature-sensitive and a
  head that drafts it, built as tests/drafters/test_eagle.py's v6_head (the
  target's own layer over fc = embedding + feature, attention sharpened), so
  that q moves with every feature and token the bookkeeping hands it;
  prev_token: the head also reads each pair's current token (fc + 2 x its
  embedding), so q moves with that token too."""
  cfg = config.ModelConfig(name="v6", vocab_size=lawcheck.V, dim=32, n_layers=1, n_heads=2,
                           n_kv_heads=1, ffn_dim=64, max_seq_len=32)
  params = dict(model.init_params(cfg, 11))
  params["embed"] = {"embedding": params["embed"]["embedding"] * 30}
  params["layers_0"] = jax.tree_util.tree_map(lambda x: 3 * x if x.ndim == 2 else x,
                                              params["layers_0"])
  target = lawcheck.sharpen(steps.Runner(cfg, params), 4.0)
  block = jax.tree_util.tree_map(lambda x: x, target.params["layers_0"])
  scale = {"wq": 2, "wk": 2, "wo": 4}
  block["attn"] = {k: {"kernel": v["kernel"] * scale.get(k, 1)} for k, v in block["attn"].items()}
  eye = jnp.eye(cfg.dim)
  kernel = [eye, eye] + ([2 * eye] if prev_token else [])
  hp = {"fc": {"kernel": jnp.concatenate(kernel, 0), "bias": jnp.zeros(cfg.dim)},
        "block": block}
  path = eagle.save_head(tmp_path_factory.mktemp("v6") / "v6-eagle", eagle.head_config(cfg),
                         hp, cfg, "v6")
  return target, eagle.EagleDrafter(str(path))


@pytest.fixture(scope="module")
def v6_head(tmp_path_factory):
  return _v6(tmp_path_factory, prev_token=False)


@pytest.fixture(scope="module")
def v6_prev(tmp_path_factory):
  """The v6 head that reads each pair's current token (eagle.reads_prev_token)."""
  out = _v6(tmp_path_factory, prev_token=True)
  assert eagle.reads_prev_token(out[1].draft_params(out[0].params, None)["head"])
  return out


def run_ngram(peaked_, tree, gamma=3, **kw):
  return speculative.generate(peaked_[0], None, NGRAM_PROMPTS, N, gamma, tree=tree,
                              drafter="ngram", **kw)


def run_eagle(v6, tree, gamma=3, prompts=lawcheck.PROMPTS, n=16, **kw):
  return speculative.generate(v6[0], None, prompts, n, gamma, tree=tree, drafter=v6[1], **kw)


# ---------------------------------------------------------------- greedy


def test_greedy_ngram_tree_equals_target_only(peaked):
  res = run_ngram(peaked, MEDUSA)
  assert res.tokens == peaked[1]
  assert res.stats.n_accept > 0


def test_greedy_eagle_tree_equals_target_only(v6_head):
  want = generation.generate(v6_head[0], lawcheck.PROMPTS, 16).tokens
  res = run_eagle(v6_head, MEDUSA)
  assert res.tokens == want
  assert res.stats.n_accept > 0


def test_eagle_chain_shaped_tree_is_the_chain(v6_head):
  chain, tree = run_eagle(v6_head, None), run_eagle(v6_head, trees.chain(3))
  assert chain.tokens == tree.tokens
  np.testing.assert_array_equal(chain.records.n_acc, tree.records.n_acc)
  assert chain.stats.n_accept > 0


def test_ngram_chain_shaped_tree_is_the_chain(peaked):
  """Depth one: the chain step for step. Deeper, the tree's rank-0 path is
  the chain's proposal wherever that is gamma long, and extends it where the
  history cut it short (ngram_rank0_mismatches, in the branches test)."""
  chain, tree = run_ngram(peaked, None, gamma=1), run_ngram(peaked, trees.chain(1))
  assert chain.tokens == tree.tokens == peaked[1]
  np.testing.assert_array_equal(chain.records.n_acc, tree.records.n_acc)
  np.testing.assert_array_equal(chain.records.n_drafted, tree.records.n_drafted)
  assert chain.stats.n_accept > 0 and (tree.records.n_drafted == 0).any()  # some steps: no match


# ---------------------------------------------------------------- n-gram branches


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5))
def _ngram_tree(hist, n, tree, k, n_min, n_max):
  return ngram.ngram_tree(hist, n, tree, k, n_min, n_max)


def ngram_tree(history, tree, n_min=1, n_max=3, width=32):
  """(tokens, drafted) of one history's tree (k = 2N candidates)."""
  hist = jnp.asarray([history + [0] * (width - len(history))], jnp.int32)
  toks, drafted = _ngram_tree(hist, jnp.asarray([len(history)]), tree,
                              ngram.CANDIDATES_PER_NODE * tree.n, n_min, n_max)
  return np.asarray(toks[0]).tolist(), np.asarray(drafted[0]).tolist()


_ngram_propose = jax.jit(ngram.ngram_propose, static_argnums=(2, 3, 4))


def chain_proposal(history, gamma, n_min=1, n_max=3, width=32):
  hist = jnp.asarray([history + [0] * (width - len(history))], jnp.int32)
  toks, n = _ngram_propose(hist, jnp.asarray([len(history)]), gamma, n_min, n_max)
  return np.asarray(toks[0, :int(n[0])]).tolist()


# [1, 2] was followed by 3 9 (at 2), 4 8 5 (at 6) and 4 6 0 (at 13, the
# latest: the chain's proposal); [2] alone by 7 (at 10)
BRANCHY = [1, 2, 3, 9, 1, 2, 4, 8, 5, 2, 7, 1, 2, 4, 6, 0, 1, 2]
BRANCHY_TREE = trees.from_paths([[0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [0, 0, 0]])


def ngram_branch_mismatches() -> list[str]:
  """Hand-built histories against the trie they must give."""
  bad = []
  got = ngram_tree(BRANCHY, BRANCHY_TREE)
  # root: 4 (the latest 2-gram match), 3 (an earlier one), 7 (the 1-gram
  # match), no fourth; below 4: 6 (the latest), 8 (the other 4), no third
  want = ([4, 3, 7, 0, 6, 8, 0, 9, 0], [True, True, True, False, True, True, False, True, True])
  if got != want:
    bad.append(f"branchy: {got}, want {want}")
  rank0 = [got[0][i] for i in (0, 4, 8)]
  if rank0 != chain_proposal(BRANCHY, 3):
    bad.append(f"branchy rank 0 {rank0}, chain {chain_proposal(BRANCHY, 3)}")
  # the latest [1] continues 3 1; the earlier one 2 1 3 1; nothing after 3 1
  got = ngram_tree([1, 2, 1, 3, 1], trees.kary(2, 2))
  want = ([3, 2, 1, 0, 1, 0], [True, True, True, False, True, False])
  if got != want:
    bad.append(f"[1, 2, 1, 3, 1]: {got}, want {want}")
  # n_min 2: a 1-gram match is no candidate; no match at all: nothing drafted
  for hist, n_min in (([1, 2, 1, 3, 1], 2), ([1, 2, 3, 4], 1)):
    got = ngram_tree(hist, trees.kary(2, 2), n_min=n_min)
    if got != ([0] * 6, [False] * 6):
      bad.append(f"{hist} n_min {n_min}: {got}")
  return bad


def ngram_rank0_mismatches(rows=60, gamma=3) -> list[str]:
  """Random histories over 4 tokens (many matches): the rank-0 path of a
  chain-shaped tree starts with the chain's proposal and equals it where
  that is gamma long; siblings of a wide tree differ."""
  bad, rng = [], np.random.default_rng(0)
  wide = trees.kary(3, 2)
  for r in range(rows):
    hist = rng.integers(0, 4, rng.integers(2, 30)).tolist()
    want = chain_proposal(hist, gamma)
    toks, drafted = ngram_tree(hist, trees.chain(gamma))
    got = [t for t, d in zip(toks, drafted) if d]
    if got[:len(want)] != want or (len(want) == gamma and got != want):
      bad.append(f"row {r} {hist}: rank 0 {got}, chain {want}")
    toks, drafted = ngram_tree(hist, wide)
    for kids in wide.child_table():
      sib = [toks[k - 1] for k in kids if k > 0 and drafted[k - 1]]
      if len(set(sib)) != len(sib):
        bad.append(f"row {r} {hist}: siblings {sib}")
  return bad


def test_ngram_branches_are_distinct_continuations():
  assert ngram_branch_mismatches() == []
  assert ngram_rank0_mismatches() == []


# ---------------------------------------------------------------- the head along each path


@functools.partial(jax.jit, static_argnames=("hcfg", "tcfg"))
def _head_chain(hparams, tparams, feats, tokens, first, *, hcfg, tcfg):
  """The head over pairs [R, L] from an empty cache (causal: padding past
  the real pairs changes nothing before it): (outputs, cache). A chain's
  pair i has current token x_i: first [R] (x_0), then the pairs' own tokens
  shifted (read by a head that reads_prev_token)."""
  prev = jnp.concatenate([first[:, None], tokens[:, :-1]], 1)
  return eagle.head_forward(hparams, tparams, feats, tokens,
                            eagle.new_cache(hcfg, tokens.shape[0], tokens.shape[1]), hcfg, tcfg,
                            prev_tokens=prev)


_features = jax.jit(eagle_train.target_features, static_argnums=1)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _head_probs(tparams, feats, tcfg, log=False):
  """(log-)softmax of the target's LM head over head outputs, jitted: one
  compile where eager ops compile one each (again after every mutation's
  cache clear)."""
  logits = model.head_logits(tparams, feats, tcfg)
  return jax.nn.log_softmax(logits[..., :tcfg.vocab_size]) if log else jax.nn.softmax(logits)

# level 2: two parents; depth 4, so a node is fed at depth 3 (RoPE n - 2 + 3)
HEAD_TREE = trees.from_paths([[0], [1], [0, 0], [1, 0], [0, 0, 0], [0, 0, 0, 0]])
WIDTH = 32


def draft_once(v6, st, sc, key=jax.random.PRNGKey(5)):
  """One more draft phase (sc's shape) from a run's final state: (drafted,
  the head's cache after it)."""
  drafter = v6[1]
  dparams = drafter.draft_params(v6[0].params, None)
  live = jnp.ones(st.n.shape, bool)
  d, dstate, _ = jax.jit(lambda ds: sc.step.propose(dparams, ds, None, st.tail, st.n, live, key,
                                                    sc))(st.dcache)
  return d, dstate.hcache


def head_mismatches(v6, tree=HEAD_TREE) -> list[str]:
  """A sampled tree run (T = 1, stochastic siblings: paths off rank 0 are
  accepted often), then one more draft phase from its final state, against
  a brute force: every drafted node's q is softmax of the head's logits at
  the node, the head run as a chain over the teacher-forced pairs of the
  output (the target's true features f_0..f_{n-2} with x_1..x_{n-1}), then
  the node's path (each pair its parent's predicted feature and its own
  token); and the head's cache after that draft phase holds the
  teacher-forced pairs' K/V at slots 0..n-2 (every step's commit fed the
  target's features along its accepted path)."""
  target, drafter = v6
  prompts = [p for p in lawcheck.PROMPTS for _ in range(4)]
  sp = SamplingParams(1.0)
  res = run_eagle(v6, tree, prompts=prompts, n=12, sp=sp, siblings="stochastic",
                  keep_state=True, seed=3)
  st = res.state
  sc = plan.SpecConfig(target.cfg, None, tree.max_depth, sp, drafter=drafter, tree=tree,
                       siblings="stochastic")
  hparams = drafter.draft_params(target.params, None)["head"]
  d, hcache = draft_once(v6, st, sc)
  hcfg, tcfg = sc.draft.replace(attn_block=0), target.cfg
  seqs = [p + out for p, out in zip(prompts, res.tokens)]  # x_0 .. x_{n-1}
  bad = [f"row {b}: n {int(st.n[b])}, want {len(x)}" for b, x in enumerate(seqs)
         if int(st.n[b]) != len(x)]
  if bad:
    return bad
  n = np.array([len(x) for x in seqs])
  padded = np.array([x + [0] * (WIDTH - len(x)) for x in seqs], np.int32)
  feats = np.array(_features(target.params, tcfg, jnp.asarray(padded))[1])  # f_0 ..
  feats[np.arange(WIDTH)[None] >= (n - 1)[:, None]] = 0  # pairs 0..n-2 only
  toks = np.concatenate([padded[:, 1:], np.zeros_like(padded[:, :1])], 1)  # x_1 ..
  depths, parents = tree.block_depths(), tree.block_parents()
  batch = len(seqs) * max(tree.level_widths())  # one shape for every head pass (one compile)
  head = lambda f, t, x0: _head_chain(hparams, target.params, _rows(f, batch), _rows(t, batch),
                                      _rows(x0, batch), hcfg=hcfg, tcfg=tcfg)
  g, ref = head(feats, toks, padded[:, 0])
  rows = np.arange(len(seqs))
  for name, got, want in (("k", hcache.k[0], ref.k[0]), ("v", hcache.v[0], ref.v[0])):
    got, want = np.asarray(got), np.asarray(want)  # on the host: no op compiled per length
    for b in rows:  # [B, K, S, D]
      err = float(np.max(np.abs(got[b, :, :n[b] - 1] - want[b, :, :n[b] - 1])))
      if not err <= 1e-4:
        bad.append(f"row {b}: head cache {name} off by {err:.2g}")
  node_feat = np.zeros((len(seqs), tree.block_size, feats.shape[-1]), np.float32)
  node_feat[:, 0] = np.asarray(g)[rows, n - 2]
  tokens = np.asarray(d.tokens)
  for depth in range(1, tree.max_depth):  # every row's nodes at this depth in one batch
    nodes = np.nonzero(depths == depth)[0]
    f = np.repeat(feats, len(nodes), 0)  # [rows x nodes, WIDTH, E]: (b, j) row-major
    t = np.repeat(toks, len(nodes), 0)
    for r, (b, j) in enumerate((b, j) for b in rows for j in nodes):
      path = [int(j)]
      while parents[path[0]] > 0:
        path.insert(0, int(parents[path[0]]))
      for i, a in enumerate(path):  # pair n - 1 + i: (its parent's feature, its token)
        f[r, n[b] - 1 + i] = node_feat[b, parents[a]]
        t[r, n[b] - 1 + i] = tokens[b, a - 1]
    out = np.asarray(head(f, t, np.repeat(padded[:, 0], len(nodes), 0))[0])
    for r, (b, j) in enumerate((b, j) for b in rows for j in nodes):
      node_feat[b, j] = out[r, n[b] - 2 + depth]
  want = np.asarray(_head_probs(target.params, jnp.asarray(node_feat), tcfg))
  fed = depths < tree.max_depth
  err = np.max(np.abs(np.asarray(d.q) - want)[:, fed], -1)  # [B, fed nodes]
  bad += [f"row {b} node {j}: q off by {err[b, i]:.2g}" for b, i in zip(*np.nonzero(err > 1e-4))
          for j in [np.nonzero(fed)[0][i]]]
  return bad


def _rows(x, batch):
  return jnp.asarray(np.concatenate([x, np.zeros((batch - len(x),) + x.shape[1:], x.dtype)]))


def test_head_drafts_every_node_as_a_chain_along_its_path(v6_head, v6_prev):
  assert head_mismatches(v6_head) == []
  assert head_mismatches(v6_prev) == []  # each pair's current token too


# ---------------------------------------------------------------- dynamic trees (EAGLE-2)

# (K, D, N): level 2 has two fed parents; a wide shallow one; one that keeps
# nearly every candidate (deep paths with runners-up)
DYNAMIC = {"2,3,5": trees.DynamicTree(2, 3, 5), "3,2,4": trees.DynamicTree(3, 2, 4),
           "2,4,12": trees.DynamicTree(2, 4, 12)}


# 2,3,5 runs greedy on the other heads (test_greedy_eagle_trees_of_a_prev_token_head_...,
# test_a_grafted_chain_keeps_more_per_step): a compile of the loop saved here
@pytest.mark.parametrize("name", ["3,2,4", "2,4,12"])
def test_greedy_eagle_dynamic_tree_equals_target_only(v6_head, name):
  tree = DYNAMIC[name]
  want = generation.generate(v6_head[0], lawcheck.PROMPTS, 16).tokens
  res = run_eagle(v6_head, tree, gamma=tree.max_depth)
  assert res.tokens == want
  assert res.stats.n_accept > 0


@pytest.mark.parametrize("head", ["v6_head", "v6_prev"])
def test_eagle_dynamic_tree_of_one_child_is_the_chain(request, head):
  """dynamic:1,D,D keeps the head's greedy chain: the chain step for step
  (for the head that reads each pair's current token too: the chain's
  draft phase hands it the same tokens as the brute-forced dynamic tree)."""
  v6 = request.getfixturevalue(head)
  chain, tree = run_eagle(v6, None), run_eagle(v6, trees.DynamicTree(1, 3, 3))
  assert chain.tokens == tree.tokens
  np.testing.assert_array_equal(chain.records.n_acc, tree.records.n_acc)
  assert chain.stats.n_accept > 0


DYN_TREE = trees.DynamicTree(2, 4, 9)  # 14 candidates, 7 fed (levels 1, 2, 3 two each)


def dynamic_head_mismatches(v6, tree=DYN_TREE) -> list[str]:
  """A sampled dynamic-tree run (T = 1: the rows' states differ), then one
  more draft phase from its final state, against a brute force
  (head_mismatches' chain along each node's path): every fed node's K/V in
  the head's scratch slot (n - 2 + its fed index) is the K/V the head run as
  a chain over the teacher-forced pairs and then the node's path writes at
  slot n - 2 + its depth (its parent's feature, its token, its RoPE
  position); every kept node's children, in BFS order, are the first of its
  parent's top-k by the head's logits at the parent on that chain; each
  level's kept nodes come best first by the chain's cumulative
  log-probability; and a kept node's parent was fed."""
  target, drafter = v6
  prompts = [p for p in lawcheck.PROMPTS for _ in range(4)]
  res = run_eagle(v6, tree, gamma=tree.max_depth, prompts=prompts, n=12, keep_state=True,
                  sp=SamplingParams(1.0), seed=3)
  st = res.state
  sc = plan.SpecConfig(target.cfg, None, tree.max_depth, SamplingParams(1.0),
                       drafter=drafter, tree=tree)
  hparams = drafter.draft_params(target.params, None)["head"]
  d, hcache = draft_once(v6, st, sc)
  hcfg, tcfg = sc.draft.replace(attn_block=0), target.cfg
  seqs = [p + out for p, out in zip(prompts, res.tokens)]
  n = np.array([len(x) for x in seqs])
  if not np.array_equal(np.asarray(st.n), n):
    return [f"lengths {np.asarray(st.n).tolist()}, want {n.tolist()}"]
  padded = np.array([x + [0] * (WIDTH - len(x)) for x in seqs], np.int32)
  feats = np.array(_features(target.params, tcfg, jnp.asarray(padded))[1])
  feats[np.arange(WIDTH)[None] >= (n - 1)[:, None]] = 0  # pairs 0..n-2 only
  toks = np.concatenate([padded[:, 1:], np.zeros_like(padded[:, :1])], 1)
  parents = np.asarray(d.parents) + 1  # block indices (0: the root)
  tokens, fed = np.asarray(d.tokens), np.asarray(d.fed)
  depth = np.sum(np.asarray(d.mask), -1) - 1  # [B, 1+N]
  b_rows = len(seqs)
  batch = b_rows * tree.n_nodes
  head = lambda f, t, x0: _head_chain(hparams, target.params, _rows(f, batch), _rows(t, batch),
                                      _rows(x0, batch), hcfg=hcfg, tcfg=tcfg)
  node_feat = np.zeros((b_rows, tree.block_size, feats.shape[-1]), np.float32)
  node_feat[:, 0] = np.asarray(head(feats, toks, padded[:, 0])[0])[np.arange(b_rows), n - 2]
  got_k, got_v = np.asarray(hcache.k[0]), np.asarray(hcache.v[0])  # [B, K, S, D]
  bad = []
  for lev in range(1, tree.max_depth):  # the features of nodes at depth lev
    at = [(b, j) for b in range(b_rows) for j in range(1, tree.block_size) if depth[b, j] == lev]
    if not at:
      break
    f, t = feats[[b for b, _ in at]].copy(), toks[[b for b, _ in at]].copy()
    for r, (b, j) in enumerate(at):
      path = [j]
      while parents[b, path[0] - 1] > 0:
        path.insert(0, int(parents[b, path[0] - 1]))
      for i, a in enumerate(path):  # pair n - 1 + i: (its parent's feature, its token)
        f[r, n[b] - 1 + i] = node_feat[b, parents[b, a - 1]]
        t[r, n[b] - 1 + i] = tokens[b, a - 1]
    out, ref = head(f, t, padded[[b for b, _ in at], 0])
    out, ref_k, ref_v = np.asarray(out), np.asarray(ref.k[0]), np.asarray(ref.v[0])
    for r, (b, j) in enumerate(at):
      node_feat[b, j] = out[r, n[b] - 2 + lev]
      if fed[b, j] >= 0:  # head slot n - 2 + fed index; the chain's n - 2 + depth
        s, c = n[b] - 2 + fed[b, j], n[b] - 2 + lev
        err = max(np.max(np.abs(got_k[b, :, s] - ref_k[r, :, c])),
                  np.max(np.abs(got_v[b, :, s] - ref_v[r, :, c])))
        if not err <= 1e-4:
          bad.append(f"row {b} node {j} (fed {fed[b, j]}): K/V off by {err:.2g}")
  logp = np.asarray(_head_probs(target.params, jnp.asarray(node_feat), tcfg, True))
  for b in range(b_rows):
    score = np.zeros(tree.block_size)
    for j in range(1, tree.block_size):
      p = parents[b, j - 1]
      score[j] = score[p] + logp[b, p, tokens[b, j - 1]]
      if p > 0 and fed[b, p] < 0:
        bad.append(f"row {b} node {j}: parent {p} never fed")
    for p in range(tree.block_size):
      kids = [j for j in range(1, tree.block_size) if parents[b, j - 1] == p]
      want = np.argsort(-logp[b, p], kind="stable")[:len(kids)].tolist()
      if [int(tokens[b, j - 1]) for j in kids] != want:
        bad.append(f"row {b} block {p}: children {[int(tokens[b, j - 1]) for j in kids]}, "
                   f"head's top {want}")
    for lev in range(1, tree.max_depth + 1):
      s = score[1:][depth[b, 1:] == lev]
      if np.any(np.diff(s) > 1e-4):
        bad.append(f"row {b} depth {lev}: scores {np.round(s, 3).tolist()} not best first")
  return bad


def test_eagle_dynamic_tree_is_the_heads_top_k_along_each_path(v6_head, v6_prev):
  assert dynamic_head_mismatches(v6_head) == []
  assert dynamic_head_mismatches(v6_prev) == []  # each pair's current token too


def test_greedy_eagle_trees_of_a_prev_token_head_equal_target_only(v6_prev):
  """The head that reads each pair's current token, on a chain, a static
  and a dynamic tree: greedy output is target-only's."""
  want = generation.generate(v6_prev[0], lawcheck.PROMPTS, 16).tokens
  for tree in (None, HEAD_TREE, DYNAMIC["2,3,5"]):
    res = run_eagle(v6_prev, tree, gamma=3 if tree is None else tree.max_depth)
    assert res.tokens == want and res.stats.n_accept > 0


# ---------------------------------------------------------------- a grafted prompt-lookup chain

GRAFT = trees.DynamicTree(2, 3, 5, ngram=4)  # deeper than the head's tree


def _graft_reference(par, tok, chain, n_chain):
  """graft_chain by hand: follow the drafted nodes while a child of the
  reached node has the chain's token, then append the rest below it."""
  n, length = len(par), len(chain)
  par, tok, drafted = list(par) + [-1] * length, list(tok) + [0] * length, [True] * n + [False] * length
  cur, merging = -1, True
  for j in range(min(n_chain, length)):
    kids = [i for i in range(n + j) if par[i] == cur and drafted[i] and tok[i] == chain[j]]
    if merging and kids:
      cur = kids[0]
      continue
    merging = False
    par[n + j], tok[n + j], drafted[n + j], cur = cur, chain[j], True, n + j
  return par, tok, drafted


def _random_tree(rng, n, vocab):
  """BFS-valid parents, distinct sibling tokens (as the head's top-k are)."""
  par, tok = [], []
  for i in range(n):
    p = int(rng.randint(-1, i))
    taken = {t for q, t in zip(par, tok) if q == p}
    if len(taken) == vocab:  # p is full; node i - 1 has no children yet
      p, taken = i - 1, set()
    par.append(p)
    tok.append(int(rng.choice([t for t in range(vocab) if t not in taken])))
  return par, tok


# (tree nodes, chain length) of the random cases, in turn: the smallest and
# largest of each and one between, one compile each (a shape drawn per case
# compiled ~20 programs, most of the test's time)
GRAFT_SHAPES = ((1, 1), (6, 4), (3, 2), (1, 4), (6, 1))


@functools.lru_cache(maxsize=None)
def _jitted(fn):
  return jax.jit(fn)


def graft_mismatches(v6=None, cases: int = 60) -> list[str]:
  """graft_chain against the reference on random trees and chains over 4
  tokens (so chains merge into the tree), each node's mask row its
  ancestors-or-self (undrafted slots: the root and themselves); then greedy
  speculation with the grafted tree equals target-only (v6 given)."""
  rng, bad = np.random.RandomState(0), []
  graft = _jitted(dynamic.graft_chain)  # looked up here: the mutations replace it
  for case in range(cases):
    n, length = GRAFT_SHAPES[case % len(GRAFT_SHAPES)]
    rows = [_random_tree(rng, n, 4) for _ in range(3)]
    chain = rng.randint(0, 4, (3, length))
    n_chain = rng.randint(0, length + 1, 3)
    par = jnp.asarray([r[0] for r in rows], jnp.int32)
    mask = np.zeros((3, n + 1, n + 1), bool)
    for b, (pb, _) in enumerate(rows):
      for i in range(n + 1):
        j = i
        while j > 0:
          mask[b, i, j] = True
          j = pb[j - 1] + 1
        mask[b, i, 0] = True
    d = base.DraftedTree(tokens=jnp.asarray([r[1] for r in rows], jnp.int32),
                         q=jnp.zeros((3, n + 1, 0)), caught_up=jnp.zeros((3,), bool),
                         parents=par, mask=jnp.asarray(mask), fed=jnp.zeros((3, n + 1), jnp.int32))
    g = graft(d, jnp.asarray(chain), jnp.asarray(n_chain))
    g = jax.tree_util.tree_map(np.asarray, g)  # indexed on the host: no op compiled per shape
    for b in range(3):
      want = _graft_reference(rows[b][0], rows[b][1], chain[b].tolist(), int(n_chain[b]))
      got = (g.parents[b].tolist(), g.tokens[b].tolist(), g.drafted[b].tolist())
      if got != want:
        bad.append(f"case {case} row {b}: {got} != {want}")
        continue
      for i in range(n + length):
        row = {0, i + 1}
        j = want[0][i] if want[2][i] else -1
        while j >= 0:
          row.add(j + 1)
          j = want[0][j]
        if set(np.nonzero(g.mask[b, i + 1])[0].tolist()) != row:
          bad.append(f"case {case} row {b} node {i}: mask row != {sorted(row)}")
  if v6 is not None:
    want = generation.generate(v6[0], lawcheck.PROMPTS, 16).tokens
    res = run_eagle(v6, GRAFT, gamma=GRAFT.max_depth)
    if res.tokens != want:
      bad.append(f"greedy with {GRAFT.spec}: {res.tokens} != target-only {want}")
  return bad


def graft_reference_mismatches(v6=None) -> list[str]:
  """The mutations' check: the reference comparison alone on 6 random trees
  (each graft mutation breaks it there; the greedy run would only add a
  compile)."""
  del v6
  return graft_mismatches(None, cases=6)


def test_a_grafted_chain_is_the_reference_graft_and_stays_greedy_exact(v6_head):
  assert graft_mismatches(v6_head) == []


def test_a_grafted_chain_keeps_more_per_step(v6_head, tmp_path):
  """The copy the chain adds is kept: with a random head (which guesses
  little) the target's repetitive greedy output is found by the lookup, so
  the grafted tree keeps more tokens per step than the tree alone, with the
  same output."""
  target = v6_head[0]
  hcfg = eagle.head_config(target.cfg)
  path = eagle.save_head(tmp_path / "random-eagle", hcfg, eagle.init_head(hcfg, 5), target.cfg,
                         "random")
  weak = (target, eagle.EagleDrafter(str(path)))
  plain = trees.DynamicTree(GRAFT.k, GRAFT.depth, GRAFT.n_nodes)
  a = run_eagle(weak, plain, gamma=plain.max_depth)
  b = run_eagle(weak, GRAFT, gamma=GRAFT.max_depth)
  assert a.tokens == b.tokens == generation.generate(target, lawcheck.PROMPTS, 16).tokens
  assert b.stats.tokens_per_step > a.stats.tokens_per_step + 0.5, (a.stats.tokens_per_step,
                                                                   b.stats.tokens_per_step)


def test_only_eagle_grafts_a_chain_with_one_line():
  msg = (r"^--tree=dynamic:2,3,5\+ngram:4 grafts a prompt-lookup chain onto an EAGLE head's "
         r"tree; drafter layerskip:1 cannot \(use --drafter=eagle\[:PATH\]\)$")
  with pytest.raises(ConfigError, match=msg):
    plan.SpecConfig(CFG3, None, GRAFT.max_depth, drafter="layerskip:1", tree=GRAFT)
  assert trees.parse("dynamic:2,3,5+ngram:4", 3) == GRAFT
  for bad in ("dynamic:2,3,5+ngram:0", "dynamic:2,3,5+ngram", "dynamic:2,3,5+lookup:4"):
    with pytest.raises(ConfigError, match=r"^--tree=dynamic:2,3,5\+"):
      trees.parse(bad, 3)


# ---------------------------------------------------------------- exactness

ROWS = 1500


def output_pvalues(target, drafter, sp, siblings, tree=EXACT_TREE, seed=0) -> dict[str, float]:
  """Pair laws of the first depth + 3 tokens against the target's own."""
  return lawcheck.output_pvalues(target, None, sp, tree.max_depth + 3, rows=ROWS, tree=tree,
                                 siblings=siblings, drafter=drafter, seed=seed)


adjusted = lawcheck.adjusted


@pytest.mark.parametrize("siblings", ["topk", "stochastic"])
def test_sampled_eagle_tree_follows_the_target(v6_head, siblings):
  ps = output_pvalues(v6_head[0], v6_head[1], SamplingParams(1.0), siblings)
  assert adjusted(ps) > lawcheck.ALPHA, {k: v for k, v in ps.items()
                                         if v * len(ps) <= lawcheck.ALPHA}


def test_sampled_eagle_tree_with_a_grafted_chain_follows_the_target(v6_head):
  """Top-k siblings and the chain's nodes, all deterministic, merged so that
  no node has two children of one token."""
  ps = output_pvalues(v6_head[0], v6_head[1], SamplingParams(1.0), "topk",
                      tree=trees.DynamicTree(2, 2, 3, ngram=3))
  assert adjusted(ps) > lawcheck.ALPHA, {k: v for k, v in ps.items()
                                         if v * len(ps) <= lawcheck.ALPHA}


def test_sampled_ngram_tree_follows_the_target(v6_head):
  """The deterministic drafter's top-k rule with undrafted nodes (a short
  history matches little)."""
  ps = output_pvalues(v6_head[0], "ngram:1-2", SamplingParams(1.0), "topk")
  assert adjusted(ps) > lawcheck.ALPHA, {k: v for k, v in ps.items()
                                         if v * len(ps) <= lawcheck.ALPHA}


def test_ngram_refuses_a_dynamic_tree_with_one_line(peaked):
  """Prompt lookup has no draft distribution to rank a dynamic tree with: the
  config check refuses it (one line), before anything runs; its static trees
  and the other drafters' dynamic trees pass."""
  dyn = trees.DynamicTree(2, 2, 3)
  msg = (r"^drafter ngram:1-4 drafts static trees only; dynamic:2,2,3 needs a drafter with a "
         r"draft distribution \(model, layerskip, eagle\)$")
  with pytest.raises(ConfigError, match=msg):
    plan.SpecConfig(CFG3, None, 2, drafter="ngram", tree=dyn)
  with pytest.raises(ConfigError, match=msg):
    run_ngram(peaked, dyn)
  plan.SpecConfig(CFG3, None, MEDUSA.max_depth, drafter="ngram", tree=MEDUSA)
  plan.SpecConfig(CFG3, None, 2, drafter="layerskip:1", tree=dyn)


# ---------------------------------------------------------------- deliberate bugs


def _path_ignored(orig):
  def path_features(feats, path):  # the block's first D + 1 features, whatever was kept
    return feats[:, :path.shape[1] + 1]
  return path_features


MUTATIONS = {
    "ngram siblings that duplicate rank 0 (no dedup)": (
        ngram, "ngram_tree", ("first = has & ~dup", "first = has"),
        lambda v6: ngram_branch_mismatches()),
    "eagle feeds a node the wrong parent's feature": (
        eagle.EagleDrafter, "feed", ("fst.feats, parent[:, :, None], 1)",
                                     "fst.feats, parent[:, ::-1, None], 1)"),
        head_mismatches),
    "a static tree's walker hands each node its grandparent": (
        walkers, "static_tree", ("jnp.asarray(parents[lo:hi])",
                                 "jnp.asarray(np.maximum(parents[np.maximum(parents[lo:hi], 0)], 0))"),
        head_mismatches),
    "eagle's commit ignores the path (block-order features)": (
        tree_step, "path_features", _path_ignored, head_mismatches),
    "a grafted chain's continuation hangs from the root, not the node it reached": (
        dynamic, "graft_chain", ("jnp.where(add, cur, -1))", "jnp.where(add, -1, -1))"),
        graft_reference_mismatches),
    "a grafted chain's node attends to the root only, not its ancestors": (
        dynamic, "graft_chain", ("row = mask[rows, cur + 1]", "row = mask[rows, 0 * cur]"),
        graft_reference_mismatches),
    "a grafted chain never merges into the tree (duplicate siblings)": (
        dynamic, "graft_chain", ("found = merging & real", "found = False & real"),
        graft_reference_mismatches),
    "eagle's dynamic tree feeds each level one head slot late": (
        eagle.EagleDrafter, "feed", ("rollback(fst.hcache, fst.base + lo)",
                                     "rollback(fst.hcache, fst.base + 1 + lo)"),
        dynamic_head_mismatches),
    "the head's RoPE one position late at fed depth >= 3": (
        eagle, "head_forward", ("+ model_lib.tree_depths(tree_mask)",
                                "+ (lambda d: d + (d >= 2))(model_lib.tree_depths(tree_mask))"),
        head_mismatches),  # HEAD_TREE feeds a node at depth 3
}


def chain_mismatches(v6, gamma: int = 3) -> list[str]:
  """A sampled chain run, then one more draft phase from its final state,
  against the brute force: draft j's q is softmax of the head's logits at
  pair n - 2 + j - 1 of the chain over the teacher-forced pairs (f_i,
  x_{i+1}), i = 0..n-2, then (g_{n-2}, d_1) .. (g_{n-4+j}, d_{j-1}); every
  pair's current token the one before it."""
  target, drafter = v6
  prompts = [p for p in lawcheck.PROMPTS for _ in range(4)]
  sp = SamplingParams(1.0)
  res = run_eagle(v6, None, gamma=gamma, prompts=prompts, n=12, sp=sp, keep_state=True, seed=3)
  st = res.state
  sc = plan.SpecConfig(target.cfg, None, gamma, sp, drafter=drafter)
  hparams = drafter.draft_params(target.params, None)["head"]
  d, _ = draft_once(v6, st, sc)
  hcfg, tcfg = sc.draft.replace(attn_block=0), target.cfg
  seqs = [p + out for p, out in zip(prompts, res.tokens)]
  n = np.array([len(x) for x in seqs])
  padded = np.array([x + [0] * (WIDTH - len(x)) for x in seqs], np.int32)
  feats = np.array(_features(target.params, tcfg, jnp.asarray(padded))[1])
  feats[np.arange(WIDTH)[None] >= (n - 1)[:, None]] = 0
  toks = np.concatenate([padded[:, 1:], np.zeros_like(padded[:, :1])], 1)
  rows, bad = np.arange(len(seqs)), []
  tokens, q = np.asarray(d.tokens), np.asarray(d.q)
  for j in range(gamma):
    g = np.asarray(_head_chain(hparams, target.params, jnp.asarray(feats), jnp.asarray(toks),
                               jnp.asarray(padded[:, 0]), hcfg=hcfg, tcfg=tcfg)[0])
    at = g[rows, n - 2 + j]
    want = np.asarray(_head_probs(target.params, jnp.asarray(at), tcfg))
    err = np.max(np.abs(q[:, j] - want[:, :q.shape[-1]]), -1)
    bad += [f"row {b} draft {j + 1}: q off by {err[b]:.2g}" for b in np.nonzero(err > 1e-4)[0]]
    feats[rows, n - 1 + j], toks[rows, n - 1 + j] = at, tokens[:, j]
  return bad


def test_head_drafts_a_chain_as_the_teacher_forced_head(v6_head, v6_prev):
  assert chain_mismatches(v6_head) == []
  assert chain_mismatches(v6_prev) == []  # each pair's current token too


# on the head that reads each pair's current token (v6_prev)
PREV_MUTATIONS = {
    "a fed node paired with its own token as the current one (chains and trees)": (
        eagle.EagleDrafter, "feed", ("prev_tokens=jnp.take_along_axis(fst.tokens, parent, 1)",
                                     "prev_tokens=tokens"),
        head_mismatches),
    "a dynamic tree's node paired with the root's token as the current one": (
        eagle.EagleDrafter, "feed", ("take_along_axis(fst.tokens, parent, 1)",
                                     "take_along_axis(fst.tokens, 0 * parent, 1)"),
        dynamic_head_mismatches),
    "commit takes the first pending pair's current token one pair late": (
        eagle.EagleDrafter, "commit", ("c.n_prev - 2 - old.start", "c.n_prev - 1 - old.start"),
        head_mismatches),
    "the chain's walker hands d_j the parent d_j (itself) instead of d_{j-1}": (
        walkers, "chain", ("jnp.broadcast_to(j - 1, tok.shape)", "jnp.broadcast_to(j, tok.shape)"),
        chain_mismatches),
    "the prompt's pairs read x_{i+1} as their current token": (
        eagle, "_prefill_head",  # jitted: its Python function mutated and jitted again
        lambda orig: lawcheck.mutant(orig.__wrapped__, "prev_tokens=tokens)", "prev_tokens=nxt)"),
        head_mismatches),
}


@pytest.mark.parametrize("bug", list(MUTATIONS) + list(PREV_MUTATIONS))
def test_each_deliberate_bug_fails(v6_head, v6_prev, monkeypatch, bug):
  module, name, change, check = {**MUTATIONS, **PREV_MUTATIONS}[bug]
  v6_head = v6_prev if bug in PREV_MUTATIONS else v6_head
  orig = getattr(module, name)
  bugged = lawcheck.mutant(orig, *change) if isinstance(change, tuple) else change(orig)
  jax.clear_caches()
  monkeypatch.setattr(module, name, bugged)
  try:
    bad = check(v6_head)
  finally:
    monkeypatch.undo()
    jax.clear_caches()
  print(f"MUTATION | {bug} | {bad[:3]}")
  assert bad, f"{bug}: not caught"
