"""A token tree's verify (steps.tree_verify: model.forward with a tree mask)
and its topology-aware commit (kv_cache.commit_path), against brute force:
every root-to-node path's logits equal running that path alone as a chain,
and the cache after a commit equals a full forward over the output.

On a ragged batch (one row at length 0, the others on both sides of the
tiny preset's 8-slot attention blocks), with blocked and masked attention,
a static tree (one mask for every row) and dynamic ones (a mask per row).
Each check is shown able to fail: MUTATIONS are deliberate bugs, each of
which must fail its check (test_each_deliberate_bug_fails).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.model import config
from specjax.model import kv_cache as kvc
from specjax.model import layers
from specjax.model import llama as model
from specjax.model import steps
from specjax.errors import ConfigError

CAPACITY = 48
PROMPT_LENS = (3, 5, 11, 17)
LENGTHS = (0, 5, 11, 17)  # row 0 rolled back to an empty cache
ATOL = 2e-5

# A static tree of 9 nodes (BFS order), width 3, depth 3: parent[i] is the
# node index of node i's parent, -1 for a child of the root.
STATIC = (-1, -1, -1, 0, 0, 1, 3, 4, 5)
# A tree per row, 9 nodes each: the static tree, a chain, a star, a binary tree.
DYNAMIC = (STATIC, (-1, 0, 1, 2, 3, 4, 5, 6, 7), (-1,) * 9, (-1, -1, 0, 0, 1, 1, 2, 3, 4))


def tree_mask(parents) -> np.ndarray:
  """[T, T] bool: mask[a, b] = block index b is a or an ancestor of a."""
  t = len(parents) + 1
  mask = np.eye(t, dtype=bool)
  mask[:, 0] = True
  for i, p in enumerate(parents):
    mask[i + 1] |= mask[p + 1]
  return mask


def root_paths(parents) -> list[list[int]]:
  """The block indices from the root (0) to every leaf."""
  leaves = set(range(len(parents))) - set(parents)
  out = []
  for leaf in sorted(leaves):
    path, i = [], leaf
    while i >= 0:
      path.append(i + 1)
      i = parents[i]
    out.append([0] + path[::-1])
  return out


chain_forward = jax.jit(model.forward, static_argnames=("cfg",))  # no donation


def copy(cache):
  return jax.tree_util.tree_map(jnp.copy, cache)


@pytest.fixture(scope="module", params=["blocked", "masked"])
def setup(request):
  """A runner (blocked or masked attention, the same weights), its cache
  prefilled at LENGTHS, and a random verify block per row."""
  cfg = config.get_preset("tiny")
  assert cfg.dtype == "float32" and cfg.attn_block == 8 < CAPACITY
  if request.param == "masked":
    cfg = cfg.replace(attn_block=0)
  runner = steps.Runner(cfg, model.init_params(cfg, seed=5))
  r = np.random.RandomState(0)
  prompts = [list(r.randint(0, cfg.vocab_size, n)) for n in PROMPT_LENS]
  _, cache = runner.prefill(prompts, runner.new_cache(len(prompts), CAPACITY))
  cache = kvc.rollback(cache, jnp.asarray(LENGTHS, jnp.int32))
  block = r.randint(0, cfg.vocab_size, (len(prompts), len(STATIC) + 1)).astype(np.int32)
  prompts = [p[:n] for p, n in zip(prompts, LENGTHS)]
  return runner, cache, prompts, block, {}  # the last: brute-force results, computed once


def path_logits(runner, cache, block, trees) -> np.ndarray:
  """Brute force: [B, T, V] logits of each block index from its root path
  run alone as a chain (every path of every row in one padded forward)."""
  rows, seqs = [], []
  for b, parents in enumerate(trees):
    for path in root_paths(parents):
      rows.append(b)
      seqs.append(path)
  width = max(map(len, seqs))
  toks = np.zeros((len(seqs), width), np.int32)  # padding after a path: causal, unseen
  for n, (b, path) in enumerate(zip(rows, seqs)):
    toks[n, :len(path)] = block[b, path]
  rows_cache = jax.tree_util.tree_map(lambda x: x[np.asarray(rows)], cache)
  logits = np.asarray(chain_forward(runner.params, jnp.asarray(toks), rows_cache,
                                    cfg=runner.cfg)[0])
  want = np.full(block.shape + (logits.shape[-1],), np.nan, np.float32)
  for n, (b, path) in enumerate(zip(rows, seqs)):
    want[b, path] = logits[n, :len(path)]
  assert not np.isnan(want).any(), "every block index lies on a root path"
  return want


def path_mismatches(setup, dynamic: bool) -> list[str]:
  """Block indices whose tree-verify logits differ from their path's chain."""
  runner, cache, _, block, memo = setup
  trees = DYNAMIC if dynamic else (STATIC,) * len(LENGTHS)
  mask = np.stack([tree_mask(p) for p in trees]) if dynamic else tree_mask(STATIC)
  got, out = runner.tree_verify(block, mask, copy(cache))
  np.testing.assert_array_equal(out.lengths, LENGTHS)  # the block is in scratch slots
  if ("paths", dynamic) not in memo:  # no tree code in it: mutations leave it alone
    memo["paths", dynamic] = path_logits(runner, cache, block, trees)
  want = memo["paths", dynamic]
  err = np.abs(np.asarray(got) - want).max(-1)  # [B, T]
  return [f"row {b} block {j}: {err[b, j]:.2g}" for b, j in zip(*np.nonzero(~(err <= ATOL)))]


# The accepted path per row (block indices, padded with junk) and its length:
# row 0 the depth-3 path to node 6, row 1 nothing at all (-1: not even the
# root), row 2 the root only, row 3 two nodes of the path to node 8.
ACCEPTED = np.array([[1, 4, 7], [0, 99, -3], [9, 9, 9], [2, 6, 0]], np.int32)
N_ACCEPTED = np.array([3, -1, 0, 2], np.int32)


def commit_mismatches(setup) -> list[str]:
  """Where the cache after tree_verify + commit_path differs from a full
  forward over prompt + root + accepted path."""
  runner, cache, prompts, block, memo = setup
  _, out = runner.tree_verify(block, tree_mask(STATIC), copy(cache))
  out = kvc.commit_path(out, jnp.asarray(ACCEPTED), jnp.asarray(N_ACCEPTED))
  seqs = [p + ([int(block[b, 0])] if n >= 0 else []) + list(block[b, ACCEPTED[b, :max(n, 0)]])
          for b, (p, n) in enumerate(zip(prompts, N_ACCEPTED))]
  if "full" not in memo:
    toks = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
    for b, s in enumerate(seqs):
      toks[b, :len(s)] = s
    memo["full"] = chain_forward(runner.params, jnp.asarray(toks),
                                 kvc.init_cache(runner.cfg, len(seqs), CAPACITY),
                                 cfg=runner.cfg)[1]
  ref = memo["full"]
  bad = [f"lengths {list(np.asarray(out.lengths))}"] if \
      list(np.asarray(out.lengths)) != [len(s) for s in seqs] else []
  for name, got_l, ref_l in (("k", out.k, ref.k), ("v", out.v, ref.v)):
    for layer, (g, w) in enumerate(zip(got_l, ref_l)):
      for b, s in enumerate(seqs):
        err = np.abs(np.asarray(g[b, :, :len(s)]) - np.asarray(w[b, :, :len(s)])).max(initial=0)
        if not err <= ATOL:  # NaN included
          bad.append(f"{name} layer {layer} row {b}: {err:.2g}")
  return bad


def test_static_tree_paths_equal_their_chains(setup):
  assert path_mismatches(setup, dynamic=False) == []


def test_dynamic_trees_paths_equal_their_chains(setup):
  assert path_mismatches(setup, dynamic=True) == []


def test_commit_equals_full_forward_over_the_output(setup):
  assert commit_mismatches(setup) == []


def test_chain_mask_is_todays_verify(setup):
  """A chain's mask (lower-triangular) and positions give the plain verify's
  logits and K/V (forward_step over the same T tokens)."""
  runner, cache, _, block, _ = setup
  chain = tree_mask(tuple(range(-1, len(STATIC) - 1)))
  assert (chain == np.tril(np.ones_like(chain))).all()
  got, tree_cache = runner.tree_verify(block, chain, copy(cache))
  want, plain_cache = runner.forward(block, copy(cache))
  np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
  np.testing.assert_array_equal(plain_cache.lengths, tree_cache.lengths + block.shape[1])
  for g, w in zip(tree_cache.k + tree_cache.v, plain_cache.k + plain_cache.v):
    np.testing.assert_allclose(g, w, atol=ATOL, rtol=0)


def level_mismatches(setup) -> list[str]:
  """A tree drafted level by level (a forward per level, mask [T_level, W]:
  the level's rows of the tree mask, the block so far as columns, the
  earlier levels read back from their scratch slots) against one verify of
  the whole block: the logits of every block index and the block's K/V."""
  runner, cache, _, block, _ = setup
  mask = tree_mask(STATIC)
  depths = mask.sum(1) - 1
  want, want_cache = runner.tree_verify(block, mask, copy(cache))
  c, got = copy(cache), np.zeros(np.shape(want), np.float32)
  base = c.lengths
  for d in range(depths.max() + 1):
    lo, hi = int(np.argmax(depths == d)), int(np.nonzero(depths == d)[0][-1]) + 1
    c = kvc.rollback(c, base + lo)  # this level is written at base + lo ..
    logits, c = chain_forward(runner.params, jnp.asarray(block[:, lo:hi]), c, cfg=runner.cfg,
                              tree_mask=mask[lo:hi, :hi])
    got[:, lo:hi] = np.asarray(logits)
  bad = [f"block {j}: {e:.2g}" for j, e in
         enumerate(np.abs(got - np.asarray(want)).max((0, 2))) if not e <= ATOL]
  t = block.shape[1]
  for layer, (g, w) in enumerate(zip(c.k + c.v, want_cache.k + want_cache.v)):
    for b, n in enumerate(LENGTHS):
      err = np.abs(np.asarray(g[b, :, :n + t]) - np.asarray(w[b, :, :n + t])).max()
      if not err <= ATOL:
        bad.append(f"cache {layer} row {b}: {err:.2g}")
  return bad


def test_levels_drafted_one_forward_each_equal_one_verify(setup):
  assert level_mismatches(setup) == []


def test_tree_mask_of_the_wrong_shape_says_so(setup):
  runner, cache, _, block, _ = setup
  with pytest.raises(ConfigError, match=r"tree mask \[10, 10\] or \[B, 10, 10\], got shape \(9, 9\)"):
    runner.tree_verify(block, tree_mask(STATIC[:-1]), copy(cache))


def test_commit_path_moves_slots():
  """commit_path on hand-made values: each accepted node's slot moves to
  lengths + 1 + k, nothing else below the new length changes."""
  cfg = config.get_preset("tiny")
  cache = kvc.init_cache(cfg, 2, 16)
  slot_ids = jnp.broadcast_to(jnp.arange(16, dtype=jnp.float32)[None, None, :, None],
                              cache.k[0].shape)
  cache = cache.replace(k=(slot_ids,) * cfg.n_layers, v=(slot_ids + 100,) * cfg.n_layers,
                        lengths=jnp.asarray([2, 5], jnp.int32))
  out = kvc.commit_path(cache, jnp.asarray([[2, 5], [3, 0]]), jnp.asarray([2, 1]))
  np.testing.assert_array_equal(out.lengths, [5, 7])
  np.testing.assert_array_equal(out.k[1][0, 0, :5, 0], [0, 1, 2, 4, 7])
  np.testing.assert_array_equal(out.k[1][1, 0, :7, 0], [0, 1, 2, 3, 4, 5, 8])
  np.testing.assert_array_equal(out.v[0][1, 1, :7, 0], [100, 101, 102, 103, 104, 105, 108])


# ------------------------------------------------------------ deliberate bugs


def _rope_at_slot(orig):
  def tree_depths(mask):  # the block index (the slot) instead of the depth
    depths = orig(mask)
    return jnp.broadcast_to(jnp.arange(depths.shape[-1]), depths.shape)
  return tree_depths


def _siblings_see_each_other(orig):
  def tree_block(kk, vv, mask, lengths, k_cache, v_cache):  # a causal (chain) mask
    t = kk.shape[1]
    return orig(kk, vv, np.tril(np.ones((t, t), bool)), lengths, k_cache, v_cache)
  return tree_block


def _row_zeros_tree_for_all(orig):
  def tree_block(kk, vv, mask, lengths, k_cache, v_cache):  # a per-row mask read as one tree
    mask = jnp.asarray(mask)
    return orig(kk, vv, mask[0] if mask.ndim == 3 else mask, lengths, k_cache, v_cache)
  return tree_block


def _earlier_levels_unseen(orig):
  def tree_block(kk, vv, mask, lengths, k_cache, v_cache):  # only the level's own columns
    t = kk.shape[1]
    return orig(kk, vv, jnp.asarray(mask)[..., -t:], lengths, k_cache, v_cache)
  return tree_block


def _commit_off_by_one(orig):
  def commit_path(cache, path, n_accepted):  # source slot one before the node's
    return orig(cache, jnp.asarray(path) - 1, n_accepted)
  return commit_path


MUTATIONS = {
    "RoPE at the slot, not length + depth": (model, "tree_depths", _rope_at_slot,
                                             lambda s: path_mismatches(s, False)),
    "siblings see each other (a lower-triangular mask)": (
        layers, "tree_block", _siblings_see_each_other, lambda s: path_mismatches(s, False)),
    "row 0's tree for every row": (layers, "tree_block", _row_zeros_tree_for_all,
                                   lambda s: path_mismatches(s, True)),
    "commit copies the wrong path (block index - 1)": (kvc, "commit_path", _commit_off_by_one,
                                                       commit_mismatches),
    "a level does not see the earlier levels' scratch slots": (
        layers, "tree_block", _earlier_levels_unseen, level_mismatches),
}


@pytest.mark.parametrize("bug", list(MUTATIONS))
def test_each_deliberate_bug_fails(setup, monkeypatch, bug):
  module, name, make, check = MUTATIONS[bug]
  if setup[0].cfg.attn_block == 0:
    pytest.skip("the mutations run on the blocked path (what decoding uses)")
  jax.clear_caches()
  monkeypatch.setattr(module, name, make(getattr(module, name)))
  try:
    bad = check(setup)
  finally:
    monkeypatch.undo()
    jax.clear_caches()
  print(f"MUTATION | {bug} | {len(bad)} mismatches, e.g. {bad[:2]}")
  assert bad, f"{bug}: no mismatch found"
