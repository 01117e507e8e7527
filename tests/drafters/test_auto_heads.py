"""The EAGLE heads (drafters/eagle.py, eagle3.py) under --gamma=auto and
--tree=auto: their pending pairs are as wide as the run's widest candidate
(SpecConfig.carried, eagle.pad_pairs), so chunks of different gammas and
trees continue one state. Greedy auto runs that switch candidates equal
target-only; the drafts after such a run equal the teacher-forced head's;
a fixed run drafts the same with the wider pending; the padding written at
the wrong end (a committed mutation) fails."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.decode import acceptance
from specjax.decode import adaptive
from specjax.decode import generation
from specjax.decode import plan
from specjax.decode import speculative
from specjax.drafters import eagle
from specjax.drafters import walkers
from specjax.model import llama as model
from specjax.model import tree as trees
from specjax.model.sampling import SamplingParams
from specjax.train import eagle as eagle_train

import lawcheck
import test_eagle
import test_eagle3

shipped, v64, sharp64 = test_eagle.shipped, test_eagle3.v64, test_eagle3.sharp64  # fixtures

N = 20
GAMMAS = (1, 2, 4)
SCHEDULE = ["chain:1", "chain:4", "chain:2", "chain:4", "chain:1"]  # every width, both ways
TREES = {"chain:1": trees.chain(1), "kary:2,2": trees.kary(2, 2),
         "static-5": trees.from_paths([[0], [1], [0, 0], [1, 0], [0, 0, 0]], "static-5")}
REAL = acceptance.parse_rule("real")
TREE_SCHEDULE = ["static-5", "chain:1", "kary:2,2", "static-5", "chain:1"]


def auto_run(target, prompts, drafter, n_predict=N, tree=False, schedule=None, **kw):
  """A greedy auto run (gamma over GAMMAS, or tree over TREES) forced
  through a schedule that switches widths (adaptive.Fixed, 2 steps a chunk)."""
  flags = (dict(auto_trees=TREES, gamma=4) if tree else dict(gamma="auto", auto_set=GAMMAS))
  p = plan.resolve(target.cfg, None, drafter=drafter, **flags)
  sched = schedule or (TREE_SCHEDULE if tree else SCHEDULE)
  return p, adaptive.generate(target, None, prompts, n_predict, p, adaptive.Fixed(sched),
                              every=2, **kw)


def test_auto_plans_carry_the_widest_step():
  """Every candidate of an auto run carries the deepest's gamma + 1; a fixed
  run its own (its compiled programs unchanged); a carry narrower than the
  step is refused."""
  cfg = test_eagle.CFG
  p = plan.resolve(cfg, cfg, gamma="auto", auto_set=GAMMAS)
  assert {k: c.carried for k, c in p.configs.items()} == dict.fromkeys(p.configs, 5)
  p = plan.resolve(cfg, cfg, auto_trees=TREES, gamma=4)
  assert {c.carried for c in p.configs.values()} == {4}  # static-5 is 3 deep
  fixed = plan.resolve(cfg, cfg, gamma=2).sc
  assert fixed.carried == 3 and fixed == plan.SpecConfig(cfg, cfg, 2)
  with pytest.raises(plan.ConfigError, match="carry 2 is narrower"):
    plan.SpecConfig(cfg, cfg, 2, carry=2)


# ---------------------------------------------------------------- EAGLE-3


@pytest.mark.parametrize("tree", [False, True], ids=["gamma", "tree"])
def test_eagle3_greedy_auto_equals_target_only(v64, tree):
  target, drafter = v64
  _, res = auto_run(target, test_eagle3.PROMPTS64, drafter, tree=tree)
  assert res.tokens == generation.generate(target, test_eagle3.PROMPTS64, N).tokens
  assert len(set(res.chosen)) == 3 and res.stats.n_accept > 0


@functools.partial(jax.jit, static_argnames="sc")
def _propose(dparams, dcache, tail, n, key, sc):
  """One draft phase of every row, jitted: one compile where the eager
  drafter compiled each op (again after the mutation's cache clear)."""
  return sc.drafter.propose(dparams, dcache, None, tail, n, jnp.ones(n.shape, bool), key, sc)[0]


def eagle3_mismatches(v, fixed_carry: int = 0, rows: bool = False) -> list[str]:
  """After a greedy auto run over SCHEDULE (or, with fixed_carry, a fixed
  gamma-2 run carrying that width; with rows, rows_run), one sampled
  gamma-4 draft phase from the final state: the rows whose q differ from
  the teacher-forced head's."""
  target, drafter = v
  prompts = test_eagle3.PROMPTS64
  if rows:
    p, res = rows_run(target, prompts, drafter, n_predict=12, keep_state=True)
    sc = dataclasses.replace(p.configs[rows_names(len(prompts))[0]], sp=SamplingParams(1.0))
  elif fixed_carry:
    sc = plan.SpecConfig(target.cfg, None, 2, drafter=drafter, carry=fixed_carry)
    res = speculative.run(target, None, prompts, 12, plan.Plan({"chain:2": sc}, REAL),
                          keep_state=True)
    sc = dataclasses.replace(sc, gamma=4, sp=SamplingParams(1.0))
  else:
    p, res = auto_run(target, prompts, drafter, n_predict=12, keep_state=True)
    sc = dataclasses.replace(p.configs["chain:4"], sp=SamplingParams(1.0))
  st = res.state
  dparams = sc.drafter.draft_params(target.params, None)
  d = _propose(dparams, st.dcache, st.tail, st.n, jax.random.PRNGKey(5), sc=sc)
  head, bad = test_eagle3.eagle3.load_head3(drafter.path), []
  for b, pr in enumerate(prompts):
    seq = pr + res.tokens[b]
    assert int(st.n[b]) == len(seq)
    want = test_eagle3.teacher_forced_q(target, head, seq, np.asarray(d.tokens[b]).tolist())
    err = np.max(np.abs(np.asarray(d.q[b]) - want), -1)
    bad += [f"row {b} draft {j + 1}: |q - q_tf| {e:.2g}" for j, e in enumerate(err) if e > 1e-4]
  return bad


def test_eagle3_drafts_after_switching_widths_are_the_teacher_forced_heads(sharp64):
  assert eagle3_mismatches(sharp64) == []


def test_eagle3_fixed_run_unchanged_by_a_wider_pending(sharp64, v64):
  """A fixed gamma-2 run carrying 6 pairs drafts the teacher-forced head's
  q, and accepts at every step what the run carrying its own 3 does."""
  assert eagle3_mismatches(sharp64, fixed_carry=6) == []
  target, drafter = v64
  runs = [speculative.run(target, None, test_eagle3.PROMPTS64, N, plan.Plan(
      {"chain:2": plan.SpecConfig(target.cfg, None, 2, drafter=drafter, carry=c)}, REAL))
          for c in (0, 6)]
  assert runs[0].tokens == runs[1].tokens
  np.testing.assert_array_equal(runs[0].records.n_acc, runs[1].records.n_acc)
  assert runs[0].stats.n_accept > 0


# ---------------------------------------------------------------- EAGLE-1 (the shipped head)


@pytest.mark.parametrize("tree", [False, True], ids=["gamma", "tree"])
def test_eagle_greedy_auto_equals_target_only(shipped, tree):
  target, prompts = shipped
  _, res = auto_run(target, prompts, "eagle", tree=tree)
  assert res.tokens == generation.generate(target, prompts, N).tokens
  assert len(set(res.chosen)) == 3 and res.stats.n_accept > 0


TF_LEN = 80  # every teacher-forced pass at one shape (causal: the padding changes nothing before it)


@functools.partial(jax.jit, static_argnames="cfg")
def _eagle_tf_q(tparams, hparams, seq, feats, cfg):
  """A teacher-forced head pass over pairs (feats [1, TF_LEN, E], seq's next
  tokens) -> q over the vocabulary at every pair [1, TF_LEN, V]."""
  hcfg = eagle.head_config(cfg).replace(attn_block=0)
  g, _ = eagle.head_forward(hparams, tparams, feats, seq, eagle.new_cache(hcfg, 1, TF_LEN),
                            hcfg, cfg)
  return g, jax.nn.softmax(model.head_logits(tparams, g, cfg))


def test_eagle_fixed_run_unchanged_by_a_wider_pending(shipped):
  """A fixed gamma-2 run of the shipped head carrying 6 pairs accepts at
  every step what the run carrying its own 3 does."""
  target, prompts = shipped
  runs = [speculative.run(target, None, prompts, N, plan.Plan(
      {"chain:2": plan.SpecConfig(target.cfg, None, 2, drafter="eagle", carry=c)}, REAL))
          for c in (0, 6)]
  assert runs[0].tokens == runs[1].tokens and runs[0].stats.n_accept > 0
  np.testing.assert_array_equal(runs[0].records.n_acc, runs[1].records.n_acc)


def eagle_mismatches(shipped_pair, rows: bool = False) -> list[str]:
  """After a greedy auto run over SCHEDULE (with rows, rows_run), one
  sampled gamma-4 draft phase from its final state: the rows whose first
  two q differ from a teacher-forced head pass over the sequence
  (test_eagle's check)."""
  target, prompts = shipped_pair
  p, res = (rows_run if rows else auto_run)(target, prompts, "eagle", keep_state=True)
  st = res.state
  name = rows_names(len(prompts))[0] if rows else "chain:4"
  sc = dataclasses.replace(p.configs[name], sp=SamplingParams(1.0))
  dparams = sc.drafter.draft_params(target.params, None)
  d = _propose(dparams, st.dcache, st.tail, st.n, jax.random.PRNGKey(5), sc=sc)
  pad = lambda x: jnp.asarray([list(x) + [0] * (TF_LEN - len(x))], jnp.int32)
  bad = []
  for b, pr in enumerate(prompts):
    seq = pr + res.tokens[b]
    n = len(seq)
    assert int(st.n[b]) == n
    feats = np.array(_target_features(target.params, pad(seq), target.cfg))
    feats[:, n - 1:] = 0  # f_0..f_{n-2}; on the host: no op compiled per length
    toks = seq[1:]
    for j in range(2):  # draft j + 1: pairs 0..n-2, then (g_{n-2}, d_1)
      g, q = _eagle_tf_q(target.params, dparams["head"], pad(toks), jnp.asarray(feats),
                         target.cfg)
      err = float(np.max(np.abs(np.asarray(d.q[b, j]) - np.asarray(q[0, n - 2 + j]))))
      bad += [f"row {b} draft {j + 1}: |q - q_tf| {err:.2g}"] if err > 1e-4 else []
      feats[:, n - 1] = np.asarray(g[:, n - 2])
      toks = toks + [int(d.tokens[b, 0])]
  return bad


@functools.partial(jax.jit, static_argnames="cfg")
def _target_features(tparams, seq, cfg):
  return eagle_train.target_features(tparams, cfg, seq)[1]


def test_eagle_drafts_after_switching_widths_are_the_teacher_forced_heads(shipped):
  assert eagle_mismatches(shipped) == []


# ---------------------------------------------------------------- per-row lengths' tails alone


def rows_names(batch: int) -> tuple[str, str]:
  """budget=auto's largest candidate (every row's 4 drafts) and its tails alone (N = B)."""
  return f"rows:4,N={5 * batch}", f"rows:4,N={batch}"


def rows_run(target, prompts, drafter, n_predict=N, **kw):
  """A greedy budget=auto run forced through chunks that draft (the largest
  budget) and chunks of the tails alone, whose steps refresh one pending
  pair (SpecConfig.refresh_pairs) from a settled state (Drafter.settle)."""
  p = plan.parse_flags(drafter=drafter, gamma="auto:rows,max=4,budget=auto").resolve(
      target.cfg, None, batch=len(prompts))
  full, tails = rows_names(len(prompts))
  return p, adaptive.generate(target, None, prompts, n_predict, p,
                              adaptive.Fixed([full, full, tails]), every=2, **kw)


def settles(res, batch: int) -> int:
  """Row-steps that start a tails-only chunk live, after a step where the
  row kept drafts: where a settle matters."""
  r, (_, tails) = res.records, rows_names(batch)
  kept = {(int(s), int(b)) for s, b, a in zip(r.step, r.row, r.n_acc) if a > 0}
  return sum(res.chosen[s] == tails and res.chosen[s - 1] != tails and (s - 1, b) in kept
             for s, b in zip(r.step.tolist(), r.row.tolist()) if s > 0)


def rows_records(target, prompts, drafter) -> tuple[list, list, list]:
  _, res = rows_run(target, prompts, drafter)
  assert res.tokens == generation.generate(target, prompts, N).tokens
  assert settles(res, len(prompts)) > 0
  return res.records.n_acc.tolist(), res.records.free.tolist(), res.chosen


def never_tails_only(self, batch):
  """The step as it was: none known tails-only when traced, so every step
  refreshes the whole carried width and scans the skipped draws."""
  del self, batch
  return False


def root_after_the_junk(tok, q, active, fst, sc):
  """The deliberate bug: walkers.root_alone with d_1 laid after the padding."""
  junk = sc.gamma - 1
  return (jnp.pad(tok[:, None], ((0, 0), (junk, 0))),
          jnp.pad(q[:, None], ((0, 0), (junk, 0), (0, 0))), active.astype(jnp.int32), fst)


def as_it_was(target, prompts, drafter, monkeypatch):
  """rows_records with no step known tails-only (never_tails_only)."""
  monkeypatch.setattr(plan.SpecConfig, "tails_only", never_tails_only)
  jax.clear_caches()
  try:
    return rows_records(target, prompts, drafter)
  finally:
    monkeypatch.undo()
    jax.clear_caches()


def head_case(head, shipped_pair, v):
  return (*shipped_pair, "eagle") if head == "eagle" else (v[0], test_eagle3.PROMPTS64, v[1])


@pytest.mark.parametrize("head", ["eagle", "eagle3"])
def test_tails_alone_refresh_one_pair_and_draft_as_the_whole_width(shipped, v64,
                                                                   monkeypatch, head):
  """Greedy per-row runs that switch between drafting and the tails alone
  equal target-only, and the tails-only steps' free tests (each row's d_1
  against the target's token) are those of the step as it was (every pair
  refreshed, the skipped draws scanned)."""
  target, prompts, drafter = head_case(head, shipped, v64)
  n_acc, free, chosen = rows_records(target, prompts, drafter)
  assert plan.SpecConfig.tails_only is not never_tails_only
  assert len(set(chosen)) == 2 and sum(f >= 0 for f in np.ravel(free)) >= 6
  assert as_it_was(target, prompts, drafter, monkeypatch) == (n_acc, free, chosen)


def test_the_root_laid_after_the_junk_fails(v64, monkeypatch):
  """A tails-only step's d_1 out of place (root_after_the_junk) changes its
  free tests; greedy output stays exact, so only this comparison sees it."""
  target, prompts, drafter = head_case("eagle3", None, v64)
  want = as_it_was(target, prompts, drafter, monkeypatch)
  monkeypatch.setattr(walkers, "root_alone", root_after_the_junk)
  jax.clear_caches()
  try:
    got = rows_records(target, prompts, drafter)
  finally:
    monkeypatch.undo()
    jax.clear_caches()
  assert got[1] != want[1]


@pytest.mark.parametrize("head", ["eagle", "eagle3"])
def test_drafts_after_the_tails_alone_are_the_teacher_forced_heads(shipped, v64, head):
  """v64's early-exit head keeps drafts (sharp64's random one keeps none),
  so the tails-only chunks start after pending pairs to settle."""
  assert tails_mismatches(head, shipped, v64) == []


def tails_mismatches(head, shipped_pair, v) -> list[str]:
  return eagle_mismatches(shipped_pair, rows=True) if head == "eagle" else \
      eagle3_mismatches(v, rows=True)


# ---------------------------------------------------------------- the deliberate bugs

WRONG_END = ("(0, width - a.shape[1])", "(width - a.shape[1], 0)")


@pytest.mark.parametrize("head", ["eagle", "eagle3"])
def test_padding_at_the_wrong_end_fails(shipped, sharp64, monkeypatch, head):
  """The pending pairs padded before the real ones (the root's index then
  unshifted) draft from the wrong pairs after a narrower step."""
  jax.clear_caches()
  monkeypatch.setattr(eagle, "pad_pairs", lawcheck.mutant(eagle.pad_pairs, *WRONG_END))
  try:
    bad = eagle_mismatches(shipped) if head == "eagle" else eagle3_mismatches(sharp64)
  finally:
    monkeypatch.undo()
    jax.clear_caches()
  print(f"MUTATION | {head}: padding at the wrong end | {len(bad)} mismatches: {bad[:1]}")
  assert bad


def unsettled(self, dparams, dstate, n, sc):
  """The deliberate bug: a tails-only chunk entered with the last drafting
  step's pending pairs, of which its one-pair refresh feeds only the first."""
  del self, dparams, n, sc
  return dstate


@pytest.mark.parametrize("head", ["eagle", "eagle3"])
def test_a_tails_only_chunk_entered_unsettled_fails(shipped, v64, monkeypatch, head):
  jax.clear_caches()
  for cls in (eagle.EagleDrafter, test_eagle3.eagle3.Eagle3Drafter):
    monkeypatch.setattr(cls, "settle", unsettled)
  try:
    bad = tails_mismatches(head, shipped, v64)
  finally:
    monkeypatch.undo()
    jax.clear_caches()
  worst = max(bad, key=lambda x: float(x.split()[-1]), default=None)
  print(f"MUTATION | {head}: tails-only chunk unsettled | {len(bad)} mismatches, worst: {worst}")
  assert bad
