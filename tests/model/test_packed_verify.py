"""The packed verify (steps.packed_verify over a model/packed.py block)
against the rectangular verify (forward_step over [B, gamma_max + 1]) on the
same drafts: the logits of every real token, each row's cache below its new
length, nothing written past a row's block, the lengths, and a decode after
the verdict's rollback.

A ragged batch of 4 rows (0, 1, 5 and 3 drafts; cached lengths on both sides
of the tiny preset's 8-slot attention blocks) in a block with padding, and a
block of tails only (N = B, the decode's cost). The layout the test unpacks
with is its own (numpy), so a wrong layout shows in the logits. Each check is
shown able to fail: MUTATIONS are deliberate bugs, each of which must fail
(test_each_deliberate_bug_fails).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from packedcase import CAPACITY, CASES, GAMMA_MAX, LENGTHS, STALE
from specjax.errors import CacheOverflowError, ConfigError
from specjax.model import config
from specjax.model import kv_cache as kvc
from specjax.model import llama as model
from specjax.model import packed as pk
from specjax.model import steps

ATOL = 2e-5


def layout(counts, size):
  """The test's own layout: (row, offset) of each real token of the block."""
  return [(b, j) for b, c in enumerate(counts) for j in range(c)][:size]


def copy(cache):
  return jax.tree_util.tree_map(jnp.copy, cache)


@pytest.fixture(scope="module")
def setup():
  """A runner on the tiny preset (blocked attention), its cache prefilled at
  LENGTHS with STALE past them, a random block [B, gamma_max + 1], and a memo
  of the rectangular verify's results (no packed code in them)."""
  cfg = config.get_preset("tiny")
  assert cfg.dtype == "float32" and cfg.attn_block == 8 < CAPACITY
  runner = steps.Runner(cfg, model.init_params(cfg, seed=5))
  r = np.random.RandomState(0)
  prompts = [list(r.randint(0, cfg.vocab_size, n)) for n in LENGTHS]
  _, cache = runner.prefill(prompts, runner.new_cache(len(prompts), CAPACITY))
  past = (jnp.arange(CAPACITY)[None, :] >= cache.lengths[:, None])[:, None, :, None]
  stale = lambda a: jnp.where(past, STALE, a)
  cache = cache.replace(k=tuple(map(stale, cache.k)), v=tuple(map(stale, cache.v)))
  block = r.randint(0, cfg.vocab_size, (len(prompts), GAMMA_MAX + 1)).astype(np.int32)
  return runner, cache, block, {}


def rectangular(setup, runner=None):
  """The rectangular verify's (logits [B, T, V], cache), memoized per config."""
  runner0, cache, block, memo = setup
  runner = runner or runner0
  if runner.cfg not in memo:
    logits, out = runner.forward(block, copy(cache))
    memo[runner.cfg] = (np.asarray(logits), jax.tree_util.tree_map(np.asarray, out))
  return memo[runner.cfg]


def packed_run(setup, case, runner=None):
  runner0, cache, block, _ = setup
  counts, size = CASES[case]
  packed = pk.pack(jnp.asarray(block), jnp.asarray(counts), cache.lengths, size)
  return (runner or runner0).packed_verify(packed, copy(cache))


def logit_mismatches(setup, case, runner=None) -> list[str]:
  """Real tokens whose packed-verify logits differ from the rectangle's."""
  want = rectangular(setup, runner)[0]
  got = np.asarray(packed_run(setup, case, runner)[0])
  bad = []
  for i, (b, j) in enumerate(layout(*CASES[case])):
    err = np.abs(got[i] - want[b, j]).max()
    if not err <= ATOL:  # NaN included
      bad.append(f"token {i} (row {b}, offset {j}): {err:.2g}")
  return bad


def cache_mismatches(setup, case) -> list[str]:
  """Each row's cache after the packed verify: below lengths + count as the
  rectangle's, from there on untouched (STALE), lengths + count; then the
  verdict's rollback (keep the tail and all but one draft) and one decode:
  the same logits as after the rectangle's rollback."""
  runner, cache, block, _ = setup
  counts, _ = CASES[case]
  want_logits, want = rectangular(setup)
  _, got = packed_run(setup, case)
  new = np.asarray(LENGTHS) + np.asarray(counts)
  bad = [] if np.asarray(got.lengths).tolist() == new.tolist() else \
      [f"lengths {np.asarray(got.lengths).tolist()}, want {new.tolist()}"]
  for layer, (g, w) in enumerate(zip(got.k + got.v, want.k + want.v)):
    g = np.asarray(g)
    for b, n in enumerate(new):
      err = np.abs(g[b, :, :n] - w[b, :, :n]).max()
      if not err <= ATOL:
        bad.append(f"cache {layer} row {b} below its new length: {err:.2g}")
      if not (g[b, :, n:] == STALE).all():
        bad.append(f"cache {layer} row {b}: written past its block")
  keep = np.maximum(new - 1, np.asarray(LENGTHS) + 1)  # the verdict: tail + drafts kept
  nxt = jnp.asarray(block[:, :1])
  after = lambda c: np.asarray(runner.forward(nxt, kvc.rollback(c, keep))[0])
  rect_cache = jax.tree_util.tree_map(jnp.asarray, want)
  err = np.abs(after(got) - after(rect_cache)).max()
  if not err <= ATOL:
    bad.append(f"a decode after the rollback: {err:.2g}")
  return bad


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_the_rectangular_verify(setup, case):
  assert logit_mismatches(setup, case) == []


@pytest.mark.parametrize("case", list(CASES))
def test_caches_and_lengths_follow_each_rows_block(setup, case):
  assert cache_mismatches(setup, case) == []


@pytest.mark.parametrize("attention", ["masked", "fused"])
def test_other_attention_kinds_agree(setup, attention):
  runner = setup[0]
  cfg = runner.cfg.replace(attn_block=0) if attention == "masked" else \
      runner.cfg.replace(attention="fused")
  assert logit_mismatches(setup, "ragged", steps.Runner(cfg, runner.params)) == []


def test_hidden_states_equal_the_rectangles(setup):
  """With return_hidden (a drafter that needs the target's features), the
  final-normed hidden state of every real token, [N, E]."""
  runner, cache, block, _ = setup
  counts, size = CASES["ragged"]
  _, _, want = jax.jit(model.forward, static_argnames=("cfg", "return_hidden"))(
      runner.params, jnp.asarray(block), copy(cache), cfg=runner.cfg, return_hidden=True)
  packed = pk.pack(jnp.asarray(block), jnp.asarray(counts), cache.lengths, size)
  _, _, got = steps.packed_verify_step(runner.params, packed, copy(cache), cfg=runner.cfg,
                                       return_hidden=True)
  err = max(np.abs(np.asarray(got[i]) - np.asarray(want[b, j])).max()
            for i, (b, j) in enumerate(layout(counts, size)))
  assert err <= ATOL


def test_capacity_is_checked_before_the_write(setup):
  runner, cache, block, _ = setup
  counts, size = CASES["ragged"]
  packed = pk.pack(jnp.asarray(block), jnp.asarray(counts), cache.lengths, size)
  with pytest.raises(CacheOverflowError, match="needs 49 slots but the cache holds 48"):
    runner.packed_verify(packed, copy(cache), lengths=np.full(4, CAPACITY - packed.width + 1))


def test_pack_lays_rows_end_to_end():
  """Row 0 first, each row's tokens in order at lengths + offset, padding after."""
  counts, size = CASES["ragged"]
  tokens = np.arange(4 * (GAMMA_MAX + 1)).reshape(4, -1)
  p = pk.pack(jnp.asarray(tokens), jnp.asarray(counts), jnp.asarray(LENGTHS), size)
  want = layout(counts, size)
  n = len(want)
  assert np.asarray(p.tokens[:n]).tolist() == [int(tokens[b, j]) for b, j in want]
  assert np.asarray(p.segment[:n]).tolist() == [b for b, _ in want]
  assert np.asarray(p.pos[:n]).tolist() == [LENGTHS[b] + j for b, j in want]
  assert np.asarray(p.valid).tolist() == [True] * n + [False] * (size - n)
  assert np.asarray(p.counts()).tolist() == list(counts)
  assert p.width == GAMMA_MAX + 1
  with pytest.raises(ConfigError, match="needs at least B = 4"):
    pk.pack(jnp.asarray(tokens), jnp.asarray(counts), jnp.asarray(LENGTHS), 3)


# ------------------------------------------------------------ deliberate bugs


def _segment_off_by_one(orig):
  def pack(tokens, counts, lengths, size):  # each row's first token given the row before
    p = orig(tokens, counts, lengths, size)
    return p.replace(segment=jnp.concatenate([p.segment[:1], p.segment[:-1]]))
  return pack


def _position_from_the_wrong_row(orig):
  def pack(tokens, counts, lengths, size):  # positions from the next row's length
    return orig(tokens, counts, jnp.roll(jnp.asarray(lengths), -1), size)
  return pack


def _drafts_attend_across_rows(orig):
  def rows(self, lengths):  # a draft's query placed in the next row's view
    row, col = orig(self, lengths)
    return jnp.where(self.valid & (col > 0), (self.segment + 1) % self.batch, row), col
  return rows


def _writes_past_the_block(orig):
  def write(self, cache_arr, new):  # each row's last token also one slot further
    nxt = jnp.concatenate([self.segment[1:], jnp.asarray([-1], self.segment.dtype)])
    last = self.valid & ~(jnp.concatenate([self.valid[1:], jnp.asarray([False])])
                          & (nxt == self.segment))
    return orig(self.replace(pos=self.pos + 1, valid=last), orig(self, cache_arr, new), new)
  return write


MUTATIONS = {
    "a segment id off by one": (pk, "pack", _segment_off_by_one,
                                lambda s: logit_mismatches(s, "ragged")),
    "a position from the wrong row": (pk, "pack", _position_from_the_wrong_row,
                                      lambda s: logit_mismatches(s, "ragged")),
    "a draft that attends across rows": (pk.Packed, "rows", _drafts_attend_across_rows,
                                         lambda s: logit_mismatches(s, "ragged")),
    "a write one slot past a row's block": (pk.Packed, "write", _writes_past_the_block,
                                            lambda s: cache_mismatches(s, "ragged")),
}


@pytest.mark.parametrize("bug", list(MUTATIONS))
def test_each_deliberate_bug_fails(setup, monkeypatch, bug):
  module, name, make, check = MUTATIONS[bug]
  rectangular(setup)  # memoized before the mutation: no packed code in it
  jax.clear_caches()
  monkeypatch.setattr(module, name, make(getattr(module, name)))
  try:
    bad = check(setup)
  finally:
    monkeypatch.undo()
    jax.clear_caches()
  print(f"MUTATION | {bug} | {len(bad)} mismatches, e.g. {bad[:2]}")
  assert bad, f"{bug}: no mismatch found"
