"""The packed verify in PyTorch (backends/torch_packed.py: flattened tokens,
a block-diagonal mask over the rows' caches) against the PyTorch
rectangular verify (TorchLlama over [B, gamma_max + 1]) and against XLA's
steps.packed_verify, on the same weights and the same ragged drafts: the
logits of every real token, each row's cache below its new length, nothing
written past a row's block, the lengths.

A ragged batch of 4 rows (0, 1, 5 and 3 drafts) in a block with 2 padding
entries, and a block of tails only (N = B). The layout the test unpacks with
is its own, so a wrong layout shows in the logits. Both attentions: the
dense block-diagonal mask and its diagonal blocks row by row. MUTATIONS are
deliberate bugs (on the dense mask), each of which must fail
(test_each_deliberate_bug_fails).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.bench.backends import torch_packed as tp
from specjax.bench.backends.torch_llama import TorchLlama
from specjax.bench.studies import packed_verify_cost as pvc
from packedcase import CAPACITY, CASES, GAMMA_MAX, LENGTHS, STALE
from specjax.errors import CacheOverflowError, ConfigError
from specjax.model import config
from specjax.model import kv_cache as kvc
from specjax.model import packed as pk
from specjax.model import steps

TOL = 2e-4   # test_tree_verify_cost.py's torch-vs-XLA tolerance


def layout(counts):
  """The test's own layout: (row, offset) of each real token of the block."""
  return [(b, j) for b, c in enumerate(counts) for j in range(c)]


@pytest.fixture(scope="module")
def setup(transformers, init_params):
  """(TorchLlama eager, its prefilled cache with STALE past the lengths, the
  block [B, gamma_max + 1], the rectangle's (logits, cache), XLA's packed
  logits of the ragged block on a copy of the same cache): everything the
  checks compare against, computed once before any mutation."""
  del transformers
  cfg = config.get_preset("tiny")
  params = init_params(cfg, 1)  # test_tree_verify_cost.py's: one init in the suite
  tm = TorchLlama(cfg, params, compile=False, threads=1)
  torch = tm.torch
  r = np.random.RandomState(0)
  prompts = [list(r.randint(0, cfg.vocab_size, n)) for n in LENGTHS]
  block = r.randint(0, cfg.vocab_size, (len(prompts), GAMMA_MAX + 1))
  cache = tm.new_cache(len(prompts), CAPACITY)
  tm.prefill(prompts, cache)
  for c in cache.k + cache.v:
    c.masked_fill_((torch.arange(CAPACITY)[None, :] >= cache.lengths[:, None])[:, None, :, None],
                   STALE)
  rect_cache = copy(cache)
  rect = tm.logits(torch.from_numpy(block), rect_cache).numpy()
  xcache = kvc.KVCache(k=tuple(jnp.asarray(c.numpy()) for c in cache.k),  # the same cache
                       v=tuple(jnp.asarray(c.numpy()) for c in cache.v),
                       lengths=jnp.asarray(LENGTHS, jnp.int32))
  counts, size = CASES["ragged"]  # XLA on the ragged block only: one compile
  xla = np.asarray(steps.Runner(cfg, params).packed_verify(
      pk.pack(jnp.asarray(block, jnp.int32), jnp.asarray(counts), xcache.lengths, size),
      xcache)[0])
  return tm, cache, torch.from_numpy(block), rect, rect_cache, xla


def copy(cache):
  return type(cache)([c.clone() for c in cache.k], [c.clone() for c in cache.v],
                     cache.lengths.clone())


def packed_run(setup, case, attention="mask"):
  tm, cache, block, *_ = setup
  counts, size = CASES[case]
  cache = copy(cache)
  packed = tp.flatten(block, counts, cache.lengths, size)
  return tp.TorchPackedVerify(tm, attention).logits(packed, cache).numpy(), cache


def logit_mismatches(setup, case, attention="mask") -> list[str]:
  """Real tokens whose logits differ from the torch rectangle's or (the
  ragged block) XLA's packed verify's."""
  rect, xla = setup[3], setup[5]
  got = packed_run(setup, case, attention)[0]
  bad = []
  for i, (b, j) in enumerate(layout(CASES[case][0])):
    wants = [("rect", rect[b, j])] + ([("xla", xla[i])] if case == "ragged" else [])
    for name, want in wants:
      if not np.allclose(got[i], want, atol=TOL, rtol=TOL):  # NaN fails too
        bad.append(f"token {i} (row {b}, offset {j}) vs {name}: "
                   f"{np.abs(got[i] - want).max():.2g}")
  return bad


def cache_mismatches(setup, case, attention="mask") -> list[str]:
  """Each row's cache after the packed verify: below lengths + count as the
  rectangle's, from there on untouched (STALE); the lengths lengths + count."""
  want = setup[4]
  counts, _ = CASES[case]
  _, got = packed_run(setup, case, attention)
  new = np.asarray(LENGTHS) + np.asarray(counts)
  bad = [] if got.lengths.tolist() == new.tolist() else \
      [f"lengths {got.lengths.tolist()}, want {new.tolist()}"]
  for layer, (g, w) in enumerate(zip(got.k + got.v, want.k + want.v)):
    g, w = g.numpy(), w.numpy()
    for b, n in enumerate(new):
      if not np.allclose(g[b, :, :n], w[b, :, :n], atol=TOL, rtol=TOL):
        bad.append(f"cache {layer} row {b} below its new length")
      if not (g[b, :, n:] == STALE).all():
        bad.append(f"cache {layer} row {b}: written past its block")
  return bad


@pytest.mark.parametrize("attention", list(tp.ATTENTION))
@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_the_rectangle_and_xla(setup, case, attention):
  assert logit_mismatches(setup, case, attention) == []


@pytest.mark.parametrize("attention", list(tp.ATTENTION))
@pytest.mark.parametrize("case", list(CASES))
def test_caches_and_lengths_follow_each_rows_block(setup, case, attention):
  assert cache_mismatches(setup, case, attention) == []


def test_the_timed_call_is_the_argmax(setup):
  tm, cache, block, *_ = setup
  counts, size = CASES["ragged"]
  want, _ = packed_run(setup, "ragged")
  got = tp.TorchPackedVerify(tm).step(tp.flatten(block, counts, cache.lengths, size),
                                      copy(cache))
  n = sum(counts)
  assert got[:n].tolist() == want[:n].argmax(-1).tolist()


def test_bad_layouts_and_overflow_are_one_line_errors(setup):
  tm, cache, block, *_ = setup
  for counts, size in (((0, 2, 6, 4), 15), ((1, 2, 7, 4), 15), ((1, 2, 6, 4), 12)):
    with pytest.raises(ConfigError, match="a packed block of"):
      tp.flatten(block, counts, cache.lengths, size)
  full = copy(cache)
  full.lengths.fill_(CAPACITY - 2)
  with pytest.raises(ConfigError, match="attention 'flash': one of"):
    tp.TorchPackedVerify(tm, "flash")
  with pytest.raises(CacheOverflowError, match="row 2's block of 6 token"):
    tp.TorchPackedVerify(tm).step(tp.flatten(block, CASES["ragged"][0], full.lengths,
                                                     CASES["ragged"][1]), full)
  assert full.lengths.tolist() == [CAPACITY - 2] * 4  # refused before any write


def test_the_cost_studys_torch_columns(setup):
  """packed_verify_cost's torch runs, timed and recorded (XLA's left out here:
  its compiles are the study's own business)."""
  tm = setup[0]
  r = np.random.RandomState(1)
  block = r.randint(0, tm.cfg.vocab_size, (2, 3))
  runs = pvc.torch_runs(tm, r.randint(0, tm.cfg.vocab_size, (2, 6)).tolist(), block, [2, 4, 5],
                        16)
  assert sorted(runs) == sorted([("torch rect", t) for t in (1, 2, 3)] +
                                [(f"torch {a}", n) for a in tp.ATTENTION for n in (2, 4, 5)])
  med = pvc.median_times(runs, reps=1)
  assert all(t > 0 for t in med.values())
  four = pvc.record(med, 2, 4, 2, 6, 1)
  assert four["t_rect_same_torch_s"] == med["torch rect", 2]
  assert four["ratio_same_torch_rows"] == med["torch rows", 4] / med["torch rect", 2]
  assert four["ratio_full_torch"] == med["torch mask", 4] / med["torch rect", 3]
  assert four["t_packed_s"] is None and four["torch_over_xla"] is None
  five = pvc.record(med, 2, 5, 2, 6, 1)
  assert five["t_rect_same_torch_s"] is None and five["ratio_same_torch"] is None
  assert pvc.summary(four).startswith("B 2 N   4: torch mask")


# ------------------------------------------------------------ deliberate bugs


def _segment_off_by_one(orig):
  def flatten(tokens, counts, lengths, size):  # each row's first token given the row before
    p = orig(tokens, counts, lengths, size)
    p.segment = tp.import_torch().cat([p.segment[:1], p.segment[:-1]])
    return p
  return flatten


def _position_from_the_wrong_row(orig):
  def flatten(tokens, counts, lengths, size):  # positions from the next row's length
    return orig(tokens, counts, lengths.roll(-1), size)
  return flatten


def _attends_across_rows(orig):
  def block_mask(packed, capacity):  # each token also reads the next row's slots
    nxt = tp.TorchPacked(packed.tokens, (packed.segment + 1) % packed.batch, packed.pos,
                         packed.n_real, packed.batch)
    return orig(packed, capacity) | orig(nxt, capacity)
  return block_mask


def _padding_written(orig):
  def flatten(tokens, counts, lengths, size):  # padding counted as real: written at slot 0
    p = orig(tokens, counts, lengths, size)
    p.n_real = size
    return p
  return flatten


def _rows_read_the_next_row(orig):
  def attend_rows(q, kc, vc, bias, n_kv_heads, packed):  # row b attends to row b + 1's slots
    return orig(q, kc.roll(-1, 0), vc.roll(-1, 0), bias, n_kv_heads, packed)
  return attend_rows


def patch(name, make):
  return lambda mp: mp.setattr(tp, name, make(getattr(tp, name)))


MUTATIONS = {  # bug: (apply it, the check it must fail, the attention it runs)
    "a segment id off by one": (patch("flatten", _segment_off_by_one), logit_mismatches,
                                "mask"),
    "a position from the wrong row": (patch("flatten", _position_from_the_wrong_row),
                                      logit_mismatches, "mask"),
    "a token that attends across rows": (patch("block_mask", _attends_across_rows),
                                         logit_mismatches, "mask"),
    "padding written into the cache": (patch("flatten", _padding_written), cache_mismatches,
                                       "mask"),
    "rows attending to the next row's cache": (
        lambda mp: mp.setitem(tp.ATTENTION, "rows", _rows_read_the_next_row(tp.attend_rows)),
        logit_mismatches, "rows"),
}


@pytest.mark.parametrize("bug", list(MUTATIONS))
def test_each_deliberate_bug_fails(setup, monkeypatch, bug):
  apply, check, attention = MUTATIONS[bug]
  apply(monkeypatch)
  bad = check(setup, "ragged", attention)
  monkeypatch.undo()
  print(f"MUTATION | {bug} | {len(bad)} mismatches, e.g. {bad[:2]}")
  assert bad, f"{bug}: no mismatch found"
