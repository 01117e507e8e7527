"""Per-row draft lengths (--gamma=auto:rows, decode/rows_step.py) are exact:
greedy equals target-only per row on a ragged batch with EOS whose rows
accept differently (n-gram: one row repeats, the others do not), and at
T = 1 the output follows the target's law (tests/lawcheck.py's chi-square,
a noisy draft model, lengths that differ by row and step). Each row's alpha
is its own acceptance (replayed from the records). MUTATIONS are deliberate
bugs, each of which must fail (test_each_deliberate_bug_fails)."""

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import cli
from specjax.decode import autorows
from specjax.decode import chain_step
from specjax.decode import generation
from specjax.decode import plan
from specjax.decode import rows_step
from specjax.decode import rows_theory
from specjax.decode import speculative
from specjax.drafters import eagle
from specjax.errors import ConfigError
from specjax.metrics import theory
from specjax.metrics.stats import Records
from specjax.model import config
from specjax.model import llama as model
from specjax.model import steps
from specjax.model.sampling import SamplingParams

import lawcheck
from lawcheck import ALPHA, adjusted, pair, sharpen  # noqa: F401

LAW_PROMPTS = lawcheck.PROMPTS[:2]  # two of lawcheck's ragged prompts (a law compiles per prompt)

# row 0 settles into a repeat (n-gram accepts most), rows 1 and 2 do not
PROMPTS = [[5, 17, 42, 9, 100], [7, 7, 7, 7, 7, 7], [200, 1, 64, 3, 9, 81, 27, 2]]
N_PREDICT = 30
GREEDY = "auto:rows,max=4,budget=6"  # 3 drafts for 3 rows: lengths must be chosen
GREEDY_SP = SamplingParams()  # temperature 0
LAW_ROWS = 800  # rows per prompt at T = 1 (one batch of 1600)
SAMPLED = f"auto:rows,max=2,budget={2 * 2 * LAW_ROWS}"  # half the rows' drafts


@pytest.fixture(scope="module")
def tiny():
  cfg = config.get_preset("tiny")
  return sharpen(steps.Runner(cfg, model.init_params(cfg, 1)), 40.0)


def to_eos(tokens: list[int], eos: int) -> list[int]:
  """Target-only greedy output with an EOS: the output without, up to its first EOS."""
  return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


def greedy_spec(tiny, eos: int):
  return speculative.generate(tiny, None, PROMPTS, N_PREDICT, GREEDY, drafter="ngram",
                              eos_id=eos, keep_state=True)


@pytest.fixture(scope="module")
def greedy(tiny):
  """(eos, target-only tokens, the per-row run); the EOS token ends row 1
  early and row 2 later (rows finish apart)."""
  base = generation.generate(tiny, PROMPTS, N_PREDICT).tokens
  eos = base[1][12]
  return eos, [to_eos(t, eos) for t in base], greedy_spec(tiny, eos)


def replayed_alpha(res, before=None) -> np.ndarray:
  """Each row's RowAlpha counts replayed from its own records (n_drafted: the
  length given; free: a free test, counted as one draft given), as
  rows_step.RowAlpha.observe accumulates them; `before` (a list) gets the
  alpha each entry's lengths were allotted from."""
  rec, out = res.records, []
  for b in range(len(res.tokens)):
    acc = rej = 0.0
    at = rec.row == b
    for k, given, free in zip(rec.n_acc[at], rec.n_drafted[at], rec.free[at]):
      if before is not None:
        before.append((b, (acc + rows_step.PRIOR_ALPHA * rows_step.PRIOR_WEIGHT)
                       / (acc + rej + rows_step.PRIOR_WEIGHT)))
      if free >= 0:
        k, given = free, 1
      if given > 0:  # a step that gave the row nothing leaves its counts
        acc, rej = rows_step.DECAY * acc + k, rows_step.DECAY * rej + float(k < given)
    out.append((acc, rej))
  return np.asarray(out)


def alpha_error(res) -> float:
  """The largest gap between the loop's RowAlpha and the replayed counts."""
  got = np.stack([np.asarray(res.state.rows.n_accept), np.asarray(res.state.rows.n_reject)], 1)
  return float(np.max(np.abs(got - replayed_alpha(res))))


def untested_steps_alpha(observe=rows_step.RowAlpha.observe) -> list[float]:
  """Row 0's alpha after a step given 4 drafts that kept none, then after
  three steps given nothing (row 1 live throughout, given 2 and keeping 2)."""
  rows, out = rows_step.RowAlpha.start(2), []
  live = jnp.ones(2, bool)
  for given in (4, 0, 0, 0):
    rows = observe(rows, jnp.asarray([0, 2]), jnp.asarray([given, 2]), live)
    out.append(float(rows.alpha()[0]))
  return out


def test_a_row_given_nothing_keeps_its_alpha():
  got = untested_steps_alpha()
  # by hand: (0 + 0.7 x 2) / (0 + 1 + 2) = 0.467, and so it stays
  assert got == pytest.approx([1.4 / 3] * 4)


def _drifting_observe(self, n_acc, given, live):
  """Every live step decays the counts (the rule before): an untested row
  drifts back to the prior."""
  acc = rows_step.DECAY * self.n_accept + n_acc.astype(jnp.float32)
  rej = rows_step.DECAY * self.n_reject + (n_acc < given).astype(jnp.float32)
  return rows_step.RowAlpha(n_accept=jnp.where(live, acc, self.n_accept),
                            n_reject=jnp.where(live, rej, self.n_reject))


def test_an_untested_row_drifting_to_the_prior_fails():
  assert untested_steps_alpha(_drifting_observe) != pytest.approx([1.4 / 3] * 4)


def test_greedy_rows_equal_target_only_per_row(greedy):
  _, base, res = greedy
  assert res.tokens == base
  lengths = [len(t) for t in res.tokens]
  assert len(set(lengths)) > 1 and min(lengths) < N_PREDICT  # EOS cut rows apart
  rec = res.records
  assert rec.n_drafted.max() > 1 and (rec.n_acc <= rec.n_drafted).all()
  per_step = [rec.at_step(s, "n_drafted") for s in range(rec.step.max() + 1)]
  assert any(len(set(x.tolist())) > 1 for x in per_step)  # rows given different lengths
  assert all(x.sum() <= 6 - len(x) for x in per_step)      # within the budget
  rate = [rec.n_acc[rec.row == b].sum() / max(rec.n_drafted[rec.row == b].sum(), 1)
          for b in range(3)]
  assert rate[0] > 0.9 and min(rate[1:]) < 0.8, rate  # the rows accept differently


def test_each_row_alpha_is_its_own_acceptance(greedy):
  res = greedy[2]
  assert alpha_error(res) < 1e-4
  assert np.ptp(np.asarray(res.state.rows.alpha())) > 0.1  # the rows' estimates differ
  free = res.records.free
  assert set(free.tolist()) == {-1, 0, 1}  # rows given nothing were tested for free, both ways
  assert (res.records.n_drafted[free >= 0] == 0).all()


def _free_tests_ignored(self, rows, live):
  """The estimate counts the drafts given only (the rule before free tests)."""
  return rows.observe(self.n_acc, self.given, live)


def test_free_tests_left_out_of_the_estimate_fail(tiny, greedy, monkeypatch):
  monkeypatch.setattr(rows_step.RowsJudged, "observe", _free_tests_ignored)
  jax.clear_caches()
  try:
    assert alpha_error(greedy_spec(tiny, greedy[0])) > 0.1
  finally:
    monkeypatch.undo()
    jax.clear_caches()


def free_tests(sc, test=rows_step.free_test):
  """rows_step.free_test on 4 rows: given 0 of 2 proposed (the target's token
  d_1; d_2), given 0 of 0, given 1 of 3: (free, hit where free)."""
  drafted = types.SimpleNamespace(proposed=jnp.array([2, 2, 0, 3]),
                                  tokens=jnp.array([[5, 6], [5, 6], [5, 6], [7, 8]]))
  emitted = jnp.array([[5, 0, 0], [6, 0, 0], [5, 0, 0], [7, 1, 1]])
  code = test(drafted, emitted, jnp.array([0, 0, 0, 1]), sc)
  return (code >= 0).tolist(), (code == 1).tolist()


def _second_draft_tested(drafted, emitted, given, sc):
  """The target's token held against d_2."""
  tested = (given == 0) & (drafted.proposed > 0) & rows_step.point_mass(sc)
  return jnp.where(tested, (emitted[:, 0] == drafted.tokens[:, 1]).astype(jnp.int32), -1)


def point_mass_sc(deterministic: bool, greedy: bool, simulated: bool = False):
  return types.SimpleNamespace(simulated=simulated, sp=types.SimpleNamespace(greedy=greedy),
                               drafter=types.SimpleNamespace(deterministic=deterministic))


def test_a_free_test_is_the_targets_token_against_d1_of_a_point_mass():
  want = ([True, True, False, False], [True, False, False, False])
  assert free_tests(point_mass_sc(True, False)) == want   # a lookup at any temperature
  assert free_tests(point_mass_sc(False, True)) == want   # a network at T = 0
  nothing = ([False] * 4, [False] * 4)
  assert free_tests(point_mass_sc(False, False)) == nothing  # a sampled draft: P(hit) is not
  assert free_tests(point_mass_sc(True, True, simulated=True)) == nothing  # its acceptance


def test_a_free_test_of_the_second_draft_fails():
  got = free_tests(point_mass_sc(True, False), _second_draft_tested)
  assert got != ([True, True, False, False], [True, False, False, False])


def test_records_keep_the_lengths_and_the_alpha_they_came_from(greedy):
  rec = greedy[2].records
  assert (rec.proposed >= rec.n_drafted).all() and (rec.proposed > rec.n_drafted).any()
  assert (rec.gamma == rec.n_drafted).all()  # the statistics' alpha counts what was given
  before = []
  replayed_alpha(greedy[2], before)
  want = np.asarray([a for _, a in sorted(before, key=lambda x: x[0])])
  got = np.concatenate([rec.alpha[rec.row == b] for b in range(3)])
  np.testing.assert_allclose(got, want, rtol=1e-5)


def test_the_theory_beside_the_measurement(greedy):
  rec = greedy[2].records
  th = rows_theory.compare(rec, 6, 4, 3)
  steps = int(rec.step.max()) + 1
  assert th.steps == steps and th.measured == pytest.approx((rec.n_acc + 1).sum() / steps)
  # the lengths given are one allocation the oracle could choose (same budget,
  # same proposals), and each row's fitted alpha reproduces what it accepted
  assert th.oracle >= th.measured - 1e-6 and th.oracle >= th.uniform - 1e-6
  assert th.predicted == pytest.approx(
      float(np.sum(theory.expected_tokens_per_step(rec.alpha.astype(float), rec.n_drafted)))
      / steps)
  # by hand: one step, budget 4; row 0 given 2 of 2 proposed, accepting 1 (so its
  # alpha a solves a + a^2 = 1), row 1 given 0 of 1 (alpha 0)
  one = Records(n_acc=np.array([1, 0]), n_drafted=np.array([2, 0]), kept=np.array([2, 1]),
                caught_up=np.zeros(2, int), step=np.zeros(2, int), row=np.arange(2),
                proposed=np.array([2, 1]), alpha=np.array([0.7, 0.7], np.float32))
  th = rows_theory.compare(one, 4, 2, 2)
  golden = (5 ** 0.5 - 1) / 2
  assert th.alpha == pytest.approx((golden, 0.0), abs=1e-6)
  assert th.oracle == pytest.approx(1 + 1 + 1)  # both drafts to row 0: 1 + a + a^2, and 1
  assert th.uniform == pytest.approx(1 + golden + 1)  # one each (row 1's gains nothing)
  assert th.predicted == pytest.approx(1 + 0.7 + 0.49 + 1) and th.measured == 3


def test_the_step_table_is_the_records_step_by_step(greedy):
  rec = greedy[2].records
  table = rows_theory.step_table(rec, 6)
  assert [t["step"] for t in table] == list(range(int(rec.step.max()) + 1))
  assert all(t["budget"] == 6 for t in table)
  for t in table:
    at = rec.step == t["step"]
    assert [r["row"] for r in t["rows"]] == rec.row[at].tolist()
    for key, field in (("given", "n_drafted"), ("accepted", "n_acc"), ("kept", "kept"),
                       ("proposed", "proposed"), ("free", "free")):
      assert [r[key] for r in t["rows"]] == getattr(rec, field)[at].tolist()
    assert [r["alpha"] for r in t["rows"]] == pytest.approx(rec.alpha[at].tolist(), abs=1e-4)
    assert [r["weight"] for r in t["rows"]] == pytest.approx(rec.weight[at].tolist(), abs=1e-4)
  assert sum(r["given"] for t in table for r in t["rows"]) == rec.n_drafted.sum()
  # budget=auto: each step its own N
  per_step = rows_theory.step_table(rec, np.arange(len(table)) + 3)
  assert [t["budget"] for t in per_step] == [s + 3 for s in range(len(table))]


def sampled(pair_):
  """(p-values of the first 4 token pairs against the target's law, the run)."""
  target, draft = pair_
  prompts = [p for p in LAW_PROMPTS for _ in range(LAW_ROWS)]
  res = speculative.generate(target, draft, prompts, 5, SAMPLED, sp=SamplingParams(1.0), seed=4)
  return lawcheck.row_pair_pvalues(target, res.tokens, LAW_PROMPTS, LAW_ROWS), res


def test_sampling_at_t1_follows_the_target(pair):
  ps, res = sampled(pair)
  assert adjusted(ps) > ALPHA, ps
  rec = res.records
  given = np.bincount(rec.n_drafted, minlength=3)
  assert (given > 100).all(), given  # rows given 0, 1 and 2 drafts
  assert len(set(rec.at_step(1, "n_drafted").tolist())) == 3  # after the first step too


@pytest.fixture(scope="module")
def head(pair, tmp_path_factory):
  """An EAGLE head on lawcheck's target that guesses well (its block is the
  target's, fc adds the embedding and the feature): its drafts read the
  verify's features, so a feature out of place changes what it accepts."""
  target = pair[0]
  hcfg, eye = eagle.head_config(target.cfg), jnp.eye(target.cfg.dim)
  hp = {"fc": {"kernel": jnp.concatenate([eye, eye], 0), "bias": jnp.zeros(target.cfg.dim)},
        "block": target.params["layers_0"]}
  return "eagle:" + str(eagle.save_head(tmp_path_factory.mktemp("rows") / "h", hcfg, hp,
                                        target.cfg, "v6"))


FULL_G = 3


@pytest.fixture(scope="module")
def chain(pair, head):
  """The chain at gamma FULL_G with the head (what a full budget must equal)."""
  return speculative.generate(pair[0], None, LAW_PROMPTS, 12, FULL_G, drafter=head)


def full_budget_mismatches(pair, head, chain) -> list[str]:
  """At a budget of every row's gamma_max + 1 tokens, per-row lengths are the
  chain: the same tokens and the same accepted counts, step by step."""
  rows = speculative.generate(pair[0], None, LAW_PROMPTS, 12,
                              f"auto:rows,max={FULL_G},budget={len(LAW_PROMPTS) * (FULL_G + 1)}",
                              drafter=head)
  bad = [] if rows.tokens == chain.tokens else ["tokens"]
  if rows.records.n_acc.tolist() != chain.records.n_acc.tolist():
    bad.append(f"n_acc {rows.records.n_acc.tolist()} != {chain.records.n_acc.tolist()}")
  return bad


def test_a_full_budget_is_the_chain_with_an_eagle_head(pair, head, chain):
  assert 0 < chain.stats.n_accept < chain.stats.n_drafted  # the head's guesses matter
  assert not full_budget_mismatches(pair, head, chain)


def test_bad_spellings_are_one_line():
  assert plan.parse_rows("auto:rows") == (plan.ROWS_MAX, 0)
  assert plan.parse_rows("Auto:Rows, max=3, budget=12") == (3, 12)
  assert plan.parse_rows("auto") is None and cli.parse_gamma("auto:rows,max=2") == \
      "auto:rows,max=2"
  for bad in ["auto:rows,max=0", "auto:rows,max=65", "auto:rows,budget=0", "auto:rows,x=1",
              "auto:rows,max", "auto:rows,budget=-3", "auto:rows,max=2.5"]:
    with pytest.raises(ConfigError, match="expected auto:rows"):
      plan.parse_rows(bad)
  with pytest.raises(ConfigError, match="auto:rows"):
    cli.parse_gamma("auto:row")
  with pytest.raises(ConfigError, match="--tree=chain"):
    plan.parse_flags(gamma="auto:rows", tree="kary:2,2")
  with pytest.raises(ConfigError, match="list of gammas"):
    cli.parse_gammas(["2", "auto:rows"])


# ---------------------------------------------------------------- nothing to verify


def verify_lengths(tiny, gamma, n_drafted) -> tuple[list[int], np.ndarray]:
  """(the cache's lengths after one n-gram step's verify, p at the last
  token [B, V]) for drafts of n_drafted tokens on two prefilled rows: the
  chain's at gamma 4, or per-row lengths' (budget 6) for "auto:rows"."""
  per_row = gamma == "auto:rows"
  sc = plan.SpecConfig(target=tiny.cfg, draft=None, gamma=4, drafter="ngram",
                       per_row=per_row, budget=6 if per_row else 0)
  prompts = [[5, 17, 42, 9], [7, 7, 7, 7, 7, 7]]
  _, cache = tiny.prefill([p[:-1] for p in prompts], tiny.new_cache(2, 32))
  tail = jnp.asarray([p[-2:] for p in prompts], jnp.int32)
  drafted = rows_step.Drafted(tokens=jnp.full((2, 4), 3, jnp.int32), q=jnp.zeros((2, 4, 0)),
                              n_drafted=jnp.asarray(n_drafted, jnp.int32),
                              caught_up=jnp.zeros(2, bool))
  p, cache, _ = jax.jit(sc.step.verify, static_argnums=4)(tiny.params, cache, tail, drafted, sc)
  return np.asarray(cache.lengths).tolist(), np.asarray(p[:, 0])


@pytest.mark.parametrize("gamma", [4, "auto:rows"])
def test_a_step_with_nothing_drafted_is_a_decode_step(tiny, gamma):
  """No row drafted: the target decodes the last token alone (the cache
  grows by 1, not gamma + 1 or the budget), with the same distribution
  there as the verify's; one row drafted: the verify runs."""
  none, p_none = verify_lengths(tiny, gamma, [0, 0])
  some, p_some = verify_lengths(tiny, gamma, [0, 2])
  assert none == [4, 6]
  assert some == ([8, 10] if gamma == 4 else [4, 8])  # the rectangle, or each row's block
  np.testing.assert_allclose(p_none, p_some, atol=1e-5)


def cache_copies(tiny, per_row: bool) -> int:
  """Cache-sized copies in a compiled verify, the cache donated as the loop
  donates it: the per-row step's (budget 6) or the n-gram chain's, whose
  step with no draft is a decode (chain_step.skipping_verify)."""
  sc = plan.SpecConfig(target=tiny.cfg, draft=None, gamma=4, drafter="ngram", per_row=per_row,
                       budget=6 if per_row else 0)
  _, cache = tiny.prefill([[5, 17, 42], [7, 7, 7, 7, 7]], tiny.new_cache(2, 32))
  tail = jnp.asarray([[42, 9], [7, 7]], jnp.int32)
  drafted = rows_step.Drafted(tokens=jnp.full((2, 4), 3, jnp.int32), q=jnp.zeros((2, 4, 0)),
                              n_drafted=jnp.asarray([0, 2], jnp.int32),
                              caught_up=jnp.zeros(2, bool))
  text = jax.jit(sc.step.verify, static_argnums=4, donate_argnums=1).lower(
      tiny.params, cache, tail, drafted, sc).compile().as_text()
  shape = "f32[" + ",".join(map(str, cache.k[0].shape)) + "]"
  return len(re.findall(re.escape(shape) + r"\S* copy\(", text))


@pytest.mark.parametrize("per_row", [True, False], ids=["per-row", "chain"])
def test_no_verify_copies_the_cache(tiny, per_row):
  assert cache_copies(tiny, per_row) == 0


def _as_cond(pred, yes, no, cache):
  """The decode-or-verify choice as a lax.cond (chain_step.either's bug):
  XLA:CPU then copies the cache three times a step."""
  return jax.lax.cond(pred, yes, no, cache)


def _decode_branch(orig):
  """The per-row verify put back inside the chains' choice of a decode."""
  del orig
  def verify_phase(tparams, tcache, tail, drafted, sc):
    full = lambda cache: rows_step.packed_phase(tparams, cache, tail, drafted, sc)
    return chain_step.skipping_verify(full, drafted.n_drafted, tparams, tcache, tail,
                                      sc.gamma + 1, sc)
  return verify_phase


@pytest.mark.parametrize("per_row", [True, False], ids=["per-row", "chain"])
def test_a_conditional_around_the_verify_fails(tiny, monkeypatch, per_row):
  monkeypatch.setattr(chain_step, "either", _as_cond)
  if per_row:
    monkeypatch.setattr(rows_step, "verify_phase", _decode_branch(rows_step.verify_phase))
  jax.clear_caches()  # the step's trace without the bug may be cached
  try:
    assert cache_copies(tiny, per_row) > 0
  finally:
    monkeypatch.undo()
    jax.clear_caches()
    jax.clear_caches()


# ---------------------------------------------------------------- mutations


def _lengths_from_draft_values(orig):
  """A row's length read off this step's drafts: 0 when the first draft is token 0."""
  def allot(drafted, rows, live, sc):
    d = orig(drafted, rows, live, sc)
    return d.replace(n_drafted=jnp.where(drafted.tokens[:, 0] == 0, 0, d.n_drafted))
  return allot


def _alpha_from_another_row(orig):
  """Row b's counts updated with row b + 1's acceptance."""
  def observe(self, n_acc, given, live):
    return orig(self, jnp.roll(n_acc, -1), jnp.roll(given, -1), live)
  return observe


def _judge_not_capped(orig):
  """The judge reads every proposed position, past the row's block."""
  def judge(key, accept_probs, p, drafted, tail, n, live, sc):
    full = drafted.replace(n_drafted=jnp.full_like(drafted.n_drafted, sc.gamma))
    return orig(key, accept_probs, p, full, tail, n, live, sc)
  return judge


def _features_of_the_next_row(orig):
  """The verify's features handed to the head one row off."""
  def verify(tparams, tcache, tail, drafted, sc):
    p, tcache, feats = orig(tparams, tcache, tail, drafted, sc)
    return p, tcache, None if feats is None else jnp.roll(feats, -1, axis=0)
  return verify


def _verify_always(orig):
  """The verify run even when no row drafted."""
  del orig
  return lambda n_drafted: jnp.bool_(True)


def _verify_only_when_every_row_drafted(orig):
  """The decode step taken whenever one row drafted nothing."""
  del orig
  return lambda n_drafted: jnp.all(n_drafted > 0)


MUTATIONS = {
    "the verify run when nothing was drafted": (
        chain_step.ChainStep, "worth_verifying", _verify_always, staticmethod,
        lambda pair_, tiny, greedy, head, chain: verify_lengths(tiny, 4, [0, 0])[0] != [4, 6]),
    "the verify skipped when one row drafted nothing": (
        chain_step.ChainStep, "worth_verifying", _verify_only_when_every_row_drafted,
        staticmethod,
        lambda pair_, tiny, greedy, head, chain: speculative.generate(
            tiny, None, PROMPTS, N_PREDICT, 4, GREEDY_SP, drafter="ngram",
            eos_id=greedy[0]).tokens != greedy[1]),  # the chain's skip (per-row steps take none)
    "lengths from this step's draft values": (
        rows_step.RowsStep, "allot", _lengths_from_draft_values, staticmethod,
        lambda pair_, tiny, greedy, head, chain: adjusted(sampled(pair_)[0]) < ALPHA),
    "a row's alpha from another row's acceptance": (
        rows_step.RowAlpha, "observe", _alpha_from_another_row, lambda f: f,
        lambda pair_, tiny, greedy, head, chain: alpha_error(greedy_spec(tiny, greedy[0])) > 1e-4),
    "the judge not capped at the row's length": (
        rows_step.RowsStep, "judge", _judge_not_capped, staticmethod,
        lambda pair_, tiny, greedy, head, chain: greedy_spec(tiny, greedy[0]).tokens != greedy[1]),
    "an EAGLE head fed the next row's features": (
        rows_step.RowsStep, "verify", _features_of_the_next_row, staticmethod,
        lambda pair_, tiny, greedy, head, chain: bool(full_budget_mismatches(pair_, head, chain))),
}


@pytest.mark.parametrize("bug", list(MUTATIONS))
def test_each_deliberate_bug_fails(pair, tiny, greedy, head, chain, monkeypatch, bug):
  owner, name, make, wrap, fails = MUTATIONS[bug]
  jax.clear_caches()
  monkeypatch.setattr(owner, name, wrap(make(getattr(owner, name))))
  try:
    assert fails(pair, tiny, greedy, head, chain), bug
  finally:
    monkeypatch.undo()
    jax.clear_caches()


# ---------------------------------------------------------------- budget=auto


def chunk(rows, proposed, alpha, kept=(1, 1, 1)) -> dict[str, np.ndarray]:
  """A chunk of two steps as adaptive.generate hands it to a chooser: the
  last (step 7) as given, the one before with every row at alpha 0.5; no row
  was given a draft, so the chunk says nothing of the model's calibration;
  row r kept kept[r] tokens at each step."""
  n = len(rows)
  cat = lambda before, last: np.concatenate([np.asarray(before), np.asarray(last)])
  each = np.asarray(kept)[np.asarray(rows)]
  return {"step": np.repeat([6, 7], n), "row": cat(rows, rows),
          "proposed": cat(proposed, proposed),
          "alpha": cat(np.full(n, 0.5), alpha).astype(np.float32), "weight": np.zeros(2 * n),
          "n_acc": np.zeros(2 * n, int),
          "n_drafted": np.zeros(2 * n, int), "kept": cat(each, each)}


def budget_choices() -> list[int]:
  """The budgets chosen after a chunk of 3 rows, T(N) = 1 + 0.05 N, the
  furthest row behind needing 10 more tokens."""
  pl = plan.parse_flags(drafter="ngram", gamma="auto:rows,max=4,budget=auto").resolve(
      config.get_preset("tiny"), None, batch=3)
  times = {k: 1.0 + 0.05 * c.budget for k, c in pl.configs.items()}
  out = []
  for rows, proposed, alpha, kept in [
      ([0, 1, 2], [4, 4, 4], [0.95] * 3, (1, 1, 1)),         # every row accepts: verify everything
      ([0, 1, 2], [4, 4, 4], [0.05] * 3, (1, 1, 1)),         # none does: tails only
      ([2, 0, 1], [4, 4, 4], [0.05, 0.95, 0.05], (1, 4, 4)),  # row 0 does and is behind
      ([2, 0, 1], [4, 4, 4], [0.05, 0.95, 0.05], (1, 1, 1)),  # .. level: the others decide
      ([2, 0, 1], [4, 0, 4], [0.05, 0.95, 0.05], (1, 4, 4))]:  # .. behind, but proposed nothing
    chooser = autorows.BudgetChooser(times, pl)
    chooser.start(3)
    chooser.observe("any", chunk(rows, proposed, alpha, kept))
    out.append(pl.configs[chooser.choose(10, 3)].budget)
  return out


def test_the_budget_chooser_finishes_the_rows_soonest_at_the_measured_step_time():
  pl = plan.parse_flags(drafter="ngram", gamma="auto:rows,max=4,budget=auto").resolve(
      config.get_preset("tiny"), None, batch=3)
  assert pl.auto == plan.ROWS and [c.budget for c in pl.configs.values()] == [3, 5, 6, 9, 15]
  # by hand, the third chunk: row 0 needs 10 tokens, rows 1 and 2 need 10 - 6 = 4; the
  # rate is 18 needed / (T(N) x the slowest row's steps). N 3: 18 / (1.15 x 10) = 1.57;
  # 5 (row 0 2 drafts, E 2.85): 18 / (1.25 x 4) = 3.60; 6 (3, E 3.71): 18 / (1.3 x
  # 4) = 3.46; 9 (row 0 4, the others 1 each, E 1.05): 18 / (1.45 x 3.81) = 3.26; 15:
  # 18 / (1.75 x 3.80) = 2.71. The fourth, every row needing 10: rows 1 and 2 (E 1 at
  # N 3, 1.05 at most) are the last done, so N 3: 30 / (1.15 x 10) = 2.61 against N 5:
  # 30 / (1.25 x 10) = 2.40.
  assert budget_choices() == [15, 3, 5, 3, 3]


def _needs_ignored(orig):
  """Every row taken to need the same: the most tokens a second, not the
  soonest end (the chooser before the batch's last row counted)."""
  def need(self, remaining):
    return np.where(self.live, float(remaining), 0.0)
  return need


def _times_ignored(orig):
  """The chooser weighs the rows' steps, not the seconds they take."""
  def predicted(self, remaining=1):
    return {k: v * self.times[k] for k, v in orig(self, remaining).items()}
  return predicted


def _first_step_of_the_chunk(orig):
  """The rows read as they were at the chunk's first step, not its last."""
  def observe(self, name, records):
    first = records["step"] == records["step"].min()
    return orig(self, name, {k: v[first] for k, v in records.items()})
  return observe


def intermittent_choice() -> int:
  """The budget chosen after a chunk of 4 steps at alpha 0.95 whose rows
  proposed 4 drafts at the first 3 steps and nothing at the last (n-gram's
  lookup matching at some steps), T(N) = 1 + 0.05 N."""
  pl = plan.parse_flags(drafter="ngram", gamma="auto:rows,max=4,budget=auto").resolve(
      config.get_preset("tiny"), None, batch=3)
  times = {k: 1.0 + 0.05 * c.budget for k, c in pl.configs.items()}
  step = np.repeat([4, 5, 6, 7], 3)
  records = {"step": step, "row": np.tile([0, 1, 2], 4), "proposed": np.where(step < 7, 4, 0),
             "alpha": np.full(12, 0.95, np.float32), "weight": np.zeros(12),
             "n_acc": np.zeros(12, int),
             "n_drafted": np.zeros(12, int), "kept": np.ones(12, int)}
  chooser = autorows.BudgetChooser(times, pl)
  chooser.start(3)
  chooser.observe("any", records)
  return pl.configs[chooser.choose(10, 3)].budget


def test_the_budget_chooser_weighs_the_chunks_proposals_not_its_last_step():
  # by hand: N 15: (3/4 x 3 x 4.52 + 1/4 x 3) / 1.75 = 6.24 tokens/s; N 9 (2 drafts a
  # row): (3/4 x 3 x 2.85 + 3/4) / 1.45 = 4.94; N 3: 3 / 1.15 = 2.61
  assert intermittent_choice() == 15


def _last_steps_proposals(orig):
  """What the rows proposed at the chunk's last step only (the chooser before
  this test: a last step without a lookup match gave the chunk tails only)."""
  def chunk_proposals(records, batch):
    last = records["step"] == records["step"].max()
    return orig({k: v[last] for k, v in records.items()}, batch)
  return chunk_proposals


def test_the_last_steps_proposals_only_fails(monkeypatch):
  monkeypatch.setattr(autorows, "chunk_proposals", _last_steps_proposals(autorows.chunk_proposals))
  assert intermittent_choice() != 15


def test_the_calibrated_step_times_never_fall_with_the_budget(monkeypatch):
  pl = plan.parse_flags(drafter="ngram", gamma="auto:rows,max=4,budget=auto").resolve(
      config.get_preset("tiny"), None, batch=3)
  noisy = dict(zip(pl.configs, [0.056, 0.058, 0.055, 0.067, 0.066]))  # N 3, 5, 6, 9, 15
  monkeypatch.setattr(autorows.adaptive, "step_times", lambda *a, **k: dict(reversed(noisy.items())))
  got = autorows.calibrate(None, None, [], 1, pl)
  assert [got[k] for k in pl.configs] == [0.056, 0.058, 0.058, 0.067, 0.067]


def test_noisy_times_taken_as_measured_fail(monkeypatch):
  monkeypatch.setattr(autorows, "monotone", lambda times, plan: dict(times))
  with pytest.raises(AssertionError):
    test_the_calibrated_step_times_never_fall_with_the_budget(monkeypatch)


def calibrated_choice(accepted: int) -> tuple[int, float]:
  """The budget chosen, and the factor, after four chunks in which 3 rows at
  alpha 0.95 were each given 4 drafts and accepted `accepted` of them,
  T(N) = 1 + 0.05 N."""
  pl = plan.parse_flags(drafter="ngram", gamma="auto:rows,max=4,budget=auto").resolve(
      config.get_preset("tiny"), None, batch=3)
  times = {k: 1.0 + 0.05 * c.budget for k, c in pl.configs.items()}
  chooser = autorows.BudgetChooser(times, pl)
  chooser.start(3)
  for s in range(4):
    chooser.observe("any", {"step": np.full(3, s), "row": np.arange(3),
                            "proposed": np.full(3, 4), "alpha": np.full(3, 0.95, np.float32),
                            "weight": np.zeros(3),
                            "n_acc": np.full(3, accepted), "n_drafted": np.full(3, 4),
                            "kept": np.full(3, accepted + 1)})
  return pl.configs[chooser.choose(10, 3)].budget, chooser.factors[-1]


def test_the_budget_chooser_scales_the_drafts_by_what_they_kept():
  # by hand: 12 row-steps given 4 drafts at 0.95 expect 12 x 3.524 = 42.29 accepted.
  # None kept: factor 2 / 44.29 = 0.045; N 3: 3 / 1.15 = 2.61, N 5: (3 + 0.045 x 1.9)
  # / 1.25 = 2.47, so the tails alone. All kept: factor 50 / 44.29 = 1.13, every draft.
  got, factor = calibrated_choice(0)
  assert got == 3 and factor == pytest.approx(2 / 44.29, rel=1e-3)
  got, factor = calibrated_choice(4)
  assert got == 15 and factor == pytest.approx(50 / 44.29, rel=1e-3)


def test_the_model_taken_as_calibrated_fails(monkeypatch):
  monkeypatch.setattr(autorows.BudgetChooser, "factor", lambda self: 1.0)
  assert calibrated_choice(0)[0] != 3


def cautious_choice(cautious: bool, alpha=None, weight: float = 0.0, batch: int = 16) -> int:
  """The budget chosen for `batch` rows at T(N) = 1 + 0.05 N, each needing 10
  tokens: at the prior (alpha None), or after a step where every row read
  `alpha` with `weight` of evidence behind it."""
  pl = plan.parse_flags(drafter="ngram", gamma="auto:rows,max=4,budget=auto").resolve(
      config.get_preset("tiny"), None, batch=batch)
  times = {k: 1.0 + 0.05 * c.budget for k, c in pl.configs.items()}
  chooser = autorows.BudgetChooser(times, pl, cautious=cautious)
  chooser.start(batch)
  if alpha is not None:
    n = np.arange(batch)
    chooser.observe("any", {"step": np.zeros(batch, int), "row": n, "proposed": np.full(batch, 4),
                            "alpha": np.full(batch, alpha, np.float32),
                            "weight": np.full(batch, weight, np.float32),
                            "n_acc": 0 * n, "n_drafted": 0 * n, "kept": 0 * n + 1})
  return pl.configs[chooser.choose(10, batch)].budget


def test_the_cautious_chooser_bets_on_no_row_it_has_not_seen():
  # 16 rows at the prior (0.7, no evidence): at the mean every row gains from drafts
  # (N 32); over the posteriors the slowest of 16 rows is likely one that accepts
  # little, so the tails alone. Seen accepting (0.95 over 20 tests), drafts pay again.
  assert cautious_choice(False) == 32 and cautious_choice(True) == 16
  assert cautious_choice(True, 0.95, 20.0) >= 48
  assert cautious_choice(True, 0.95, 0.0) < cautious_choice(True, 0.95, 20.0)
  assert cautious_choice(True, 0.95, 20.0, batch=1) == 5  # one row: its mean decides


def _no_evidence(orig):
  """Every row's posterior taken at the prior's weight, whatever it has shown."""
  def draws(alpha, weight, n, seed=0):
    return orig(alpha, np.zeros_like(np.asarray(weight)), n, seed)
  return draws


def test_a_posterior_that_ignores_the_evidence_fails(monkeypatch):
  monkeypatch.setattr(autorows, "posterior_draws", _no_evidence(autorows.posterior_draws))
  assert cautious_choice(True, 0.95, 20.0) < 48


def _at_the_mean(alpha, weight, n, seed=0):
  """Every draw the running alpha itself: caution that bets on the prior."""
  del weight, seed
  return np.broadcast_to(np.asarray(alpha, float), (n, np.size(alpha)))


def test_a_cautious_chooser_at_the_mean_fails(monkeypatch):
  monkeypatch.setattr(autorows, "posterior_draws", _at_the_mean)
  assert cautious_choice(True) != 16


def _lookups_only(sc) -> bool:
  """Only a lookup's proposal taken as a point mass (a network's at T = 0 left out)."""
  return not sc.simulated and sc.drafter.deterministic


def test_a_network_at_t0_left_untested_fails(monkeypatch):
  monkeypatch.setattr(rows_step, "point_mass", _lookups_only)
  assert free_tests(point_mass_sc(False, True)) != ([True, True, False, False],
                                                    [True, False, False, False])


def test_budget_auto_is_cautious_where_a_row_is_seen_for_free():
  for drafter, sp, want in (("ngram", SamplingParams(temperature=1.0), True),
                            ("model", SamplingParams(), True),
                            ("model", SamplingParams(temperature=1.0), False)):
    pl = plan.parse_flags(drafter=drafter, gamma="auto:rows,max=4,budget=auto", sp=sp).resolve(
        config.get_preset("tiny"), config.get_preset("tiny-draft"), batch=2)
    assert autorows.chooser({k: 1.0 for k in pl.configs}, pl).cautious == want


@pytest.mark.parametrize("bug", ["times ignored", "the chunk's first step", "needs ignored"])
def test_each_deliberate_chooser_bug_fails(monkeypatch, bug):
  name, make = {"times ignored": ("predicted", _times_ignored),
                "the chunk's first step": ("observe", _first_step_of_the_chunk),
                "needs ignored": ("need", _needs_ignored)}[bug]
  monkeypatch.setattr(autorows.BudgetChooser, name,
                      make(getattr(autorows.BudgetChooser, name)))
  assert budget_choices() != [15, 3, 5, 3, 3]
