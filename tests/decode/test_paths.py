"""Paths the other decode tests leave out (issue 24, review gap 5):

  EOS in a batch       rows that reach EOS at different steps stop there
                       (their output is the target-only greedy output up to
                       and including EOS), the others run on: both loops,
                       with the model, n-gram and EAGLE drafters;
  p_min at T > 0       the draft's early stop leaves the output law the
                       target's, and really stops drafts;
  auto gamma at T > 0  chunks of different gammas continue each other with
                       the target's law, and compile nothing after warm-up;
  blocked attention    the exactness check through attention over several
                       KV blocks (ModelConfig.attn_block), against laws from
                       the unblocked (one masked pass) model;
  the tail model       the engine's loop steps against
                       theory.expected_batch_steps.

Each test has a deliberate bug committed next to it (a one-line edit of the
engine's own source, `mutant`, patched in for one run) that fails it.
"""

import __future__
import inspect
import textwrap

import jax
import numpy as np
import pytest

import lawcheck
from lawcheck import pair  # noqa: F401  (the V = 6 target and its noisy draft)
from specjax.decode import acceptance
from specjax.decode import adaptive
from specjax.decode import autogamma
from specjax.decode import generation
from specjax.decode import plan
from specjax.decode import speculative
from specjax.drafters import eagle
from specjax.drafters import walkers
from specjax.metrics import theory
from specjax.model import config
from specjax.model import layers
from specjax.model import llama as model
from specjax.model import steps
from specjax.model.sampling import SamplingParams

V = lawcheck.V


def mutant(func, *edits: tuple[str, str]):
  """`func` with each (old, new) edit made once in its source: a deliberate
  bug, compiled in func's own module namespace (patch it in with
  monkeypatch, then clear jax's caches so that jitted callers retrace).
  An edit whose `old` text is not found exactly once fails loudly: the
  engine changed, and the mutation must follow it."""
  src = textwrap.dedent(inspect.getsource(func))
  for old, new in edits:
    assert src.count(old) == 1, f"{func.__qualname__}: {old!r} is not in its source once"
    src = src.replace(old, new)
  ns = dict(func.__globals__)
  exec(compile(src, f"<mutant of {func.__qualname__}>", "exec",  # pylint: disable=exec-used
               __future__.annotations.compiler_flag, dont_inherit=True), ns)
  return ns[func.__name__]


@pytest.fixture
def patched(monkeypatch):
  """patched(module, name, new): the engine with one function replaced, jax's
  compilation caches cleared before and after (the jitted loops retrace)."""
  def patch(module, name, new):
    jax.clear_caches()
    monkeypatch.setattr(module, name, new)
  yield patch
  monkeypatch.undo()
  jax.clear_caches()


def pvalues_of(tokens, which, reference, sp, lags=(1,)) -> dict[str, float]:
  """Chi-square p-values of the windows tokens [R, W] (rows of prompt i where
  which == i) against the target-only law of `reference`: the joint law of
  (t_j, t_{j + lag}) for every j and lag, by enumeration (lawcheck's
  logits and warpers)."""
  w = tokens.shape[1]
  out = {}
  for i, prompt in enumerate(lawcheck.PROMPTS):
    p = [lawcheck.warp(x, sp) for x in lawcheck.next_token_logits(reference, prompt, w - 1)]
    joint = p[0][0]  # P(t_0 .. t_j) over the V^(j+1) prefixes, lexicographic
    for j in range(1, w):
      joint = (joint[:, None] * p[j]).reshape(-1)
    joint = joint.reshape((V,) * w)
    t = tokens[which == i]
    for lag in lags:
      for j in range(w - lag):
        law = joint.sum(axis=tuple(a for a in range(w) if a not in (j, j + lag)))
        counts = np.bincount(t[:, j] * V + t[:, j + lag], minlength=V * V)
        out[f"prompt {i} t{j},t{j + lag}"] = lawcheck.chi2_pvalue(counts, law)
  return out


def adjusted(ps: dict[str, float]) -> float:
  """The Bonferroni-adjusted p-value of a family."""
  return min(1.0, min(ps.values()) * len(ps))


def tiled(rows: int):
  """lawcheck's prompts, `rows` rows each, and each row's prompt index."""
  prompts = [p for p in lawcheck.PROMPTS for _ in range(rows)]
  return prompts, np.repeat(np.arange(len(lawcheck.PROMPTS)), rows)

# ---------------------------------------------------------------- EOS in a batch

EOS_CFG = config.ModelConfig(name="eos", vocab_size=48, dim=32, n_layers=1, n_heads=2,
                             n_kv_heads=1, ffn_dim=64, max_seq_len=64, attn_block=8)
EOS_PROMPTS = [[5, 17, 42, 9, 10], [7, 7, 7], [20, 1, 44, 3, 9, 31, 27, 2], [11, 12]]
EOS_N = 24


def pick_eos(base: list[list[int]]) -> int:
  """A token that the greedy rows first emit at two different positions
  (neither the first token nor near the end) and that some row never emits."""
  for tok in sorted({t for row in base for t in row}):
    first = [row.index(tok) if tok in row else None for row in base]
    at = [f for f in first if f is not None]
    if (len(set(at)) >= 2 and None in first and min(at) >= 2
        and max(at) <= EOS_N - 4):
      return tok
  raise AssertionError(f"no token fits as EOS in {base}")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """A small model with sharp logits (its greedy rows fall into different
  cycles), a noisy copy as its draft, a random EAGLE head for it (in a
  temporary folder), and its greedy output."""
  cfg = EOS_CFG
  target = lawcheck.sharpen(steps.Runner(cfg, model.init_params(cfg, 1)), 12.0)
  hcfg = eagle.head_config(cfg)
  head = tmp_path_factory.mktemp("eagle") / "head"
  eagle.save_head(head, hcfg, eagle.init_head(hcfg, 4), cfg, "tiny")
  base = generation.generate(target, EOS_PROMPTS, EOS_N).tokens
  return target, lawcheck.perturbed(target, 0.5, 3), f"eagle:{head}", base


def eos_run(tiny_, drafter, loop):
  target, draft, head, base = tiny_
  eos = pick_eos(base)
  draft, spec = {"model": (draft, "model"), "ngram": (None, "ngram"),
                 "eagle": (None, head)}[drafter]
  res = speculative.generate(target, draft, EOS_PROMPTS, EOS_N, 3, eos_id=eos, loop=loop,
                             drafter=spec)
  return res, base, eos


def eos_mismatches(res, base, eos) -> list[str]:
  """What differs from: rows that emit EOS stop right after it, with the
  target-only tokens; the others emit all EOS_N; each row's records keep
  exactly its tokens, and some row that stopped at EOS rode along (was not
  live) in later steps of the loop."""
  bad = []
  stopped_at = [row.index(eos) + 1 if eos in row else None for row in base]
  for b, (row, n) in enumerate(zip(res.tokens, stopped_at)):
    want = base[b][:n] if n else base[b]
    if row != want:
      bad.append(f"row {b}: {row} != {want}")
    if res.records.kept[res.records.row == b].sum() != len(row) - 1:
      bad.append(f"row {b}: the records keep {res.records.kept[res.records.row == b].sum()} "
                 f"tokens after the first, the row has {len(row) - 1}")
  steps_ = res.records.steps_per_row()
  if not any(steps_[b] < steps_.max() for b, n in enumerate(stopped_at) if n):
    bad.append(f"no row that stopped at EOS stopped before the loop's end: steps {steps_}")
  return bad


# every drafter on the device loop; the host loop (the same keep_tokens for
# every drafter, its own compiled phases) with the draft model
@pytest.mark.parametrize("drafter,loop", [("model", "device"), ("ngram", "device"),
                                          ("eagle", "device"), ("model", "host")])
def test_eos_stops_each_row_of_a_batch_at_its_own_step(tiny, drafter, loop):
  res, base, eos = eos_run(tiny, drafter, loop)
  stopped = sorted({row.index(eos) for row in base if eos in row})
  assert len(stopped) >= 2  # two rows stop, at different steps; another runs on
  assert not eos_mismatches(res, base, eos), eos_mismatches(res, base, eos)
  if drafter != "eagle":  # a random head's drafts are never the greedy token here
    assert res.stats.n_accept > 0
  if drafter == "model":  # some row's EOS was an accepted draft: the step was cut there
    rec = res.records
    last = [np.nonzero(rec.row == b)[0][-1] for b, row in enumerate(base) if eos in row]
    assert any(rec.kept[i] < rec.n_acc[i] + 1 for i in last), (rec.kept[last], rec.n_acc[last])


EOS_MUTATIONS = {
    "a row that emitted EOS is not done": (
        "  done = done | (count >= n_predict) | (kept >= first_eos)",
        "  done = done | (count >= n_predict)"),
    "EOS in one row ends every row": (
        "  done = done | (count >= n_predict) | (kept >= first_eos)",
        "  done = done | (count >= n_predict) | jnp.any(kept >= first_eos)"),
}


@pytest.mark.parametrize("bug", list(EOS_MUTATIONS))
def test_each_eos_bug_fails_the_batch_check(tiny, patched, bug):
  patched(speculative, "keep_tokens", mutant(speculative.keep_tokens, EOS_MUTATIONS[bug]))
  assert eos_mismatches(*eos_run(tiny, "model", "device"))

# ---------------------------------------------------------------- p_min at T > 0

P_MIN = 0.25   # about the median of the V = 6 draft's top probability at T = 1
P_MIN_ROWS = 1000


def p_min_run(pair_, gamma=2):
  """Windows of gamma + 3 tokens at T = 1 with the draft's early stop."""
  target, draft = pair_
  prompts, which = tiled(P_MIN_ROWS)
  res = speculative.generate(target, draft, prompts, gamma + 3, gamma, sp=SamplingParams(1.0),
                             p_min=P_MIN, seed=4)
  return np.array(res.tokens), which, res


def test_p_min_keeps_the_target_law_when_sampling(pair):
  """The stop depends on the context only (the draft's top probability
  before it draws), so the output is the target's law; the drafts really
  stop early (rows draft 0, 1 or 2 of gamma = 2)."""
  tokens, which, res = p_min_run(pair)
  st = res.stats
  assert st.n_drafted < 0.8 * 2 * st.n_steps, (st.n_drafted, st.n_steps)
  assert 0 < st.n_accept
  hist = np.bincount(res.records.n_drafted, minlength=3)
  assert hist.min() > 0.05 * hist.sum(), hist  # every draft length happens
  ps = pvalues_of(tokens, which, pair[0], SamplingParams(1.0), lags=(1, 2))
  assert adjusted(ps) > lawcheck.ALPHA, {k: v for k, v in ps.items() if v * len(ps) <= 0.01}


def test_a_stop_that_reads_the_drawn_token_fails_the_law(pair, patched):
  """The deliberate bug: the stop tests the probability of the token the
  draft just drew, not its top probability: whether a position is drafted
  then depends on the draft's sample, and the law is biased (the chain
  walker's draw: walkers._draw)."""
  patched(walkers, "_draw", mutant(walkers._draw, (  # pylint: disable=protected-access
      "tok, top = sampling.sample(key, q), jnp.max(q, -1)",
      "tok = sampling.sample(key, q); top = jnp.take_along_axis(q, tok[:, None], -1)[:, 0]")))
  tokens, which, _ = p_min_run(pair)
  ps = pvalues_of(tokens, which, pair[0], SamplingParams(1.0), lags=(1, 2))
  print(f"MUTATION | p_min on the drawn token | adjusted p {adjusted(ps):.3g}")
  assert adjusted(ps) < lawcheck.ALPHA

# ---------------------------------------------------------------- auto gamma at T > 0

AUTO_GAMMAS = (1, 4)
AUTO_FIXED = [1, 4]  # chunks of 1, 2, 4 steps: gamma 1, then 4, then 1 again
AUTO_W = lawcheck.N_MAX + 1  # tokens per row: the longest window the laws enumerate
AUTO_ROWS = 1000
AUTO_SP = SamplingParams(1.0)


def auto_costs(batch: int) -> autogamma.BatchCosts:
  """Costs for the chooser's run: a flat verify and a cheap draft. The
  chooser is not under test here (what it picks for 3000 rows of 7 tokens
  is its business), only that what it picks was compiled."""
  return autogamma.BatchCosts(batch, {1: 1.0, 2: 1.0, 5: 1.0}, 0.01)


def auto_plan(target, draft) -> plan.Plan:
  return plan.resolve(target.cfg, draft.cfg, gamma="auto", auto_set=AUTO_GAMMAS, sp=AUTO_SP)


def auto_run(target, draft, prompts, fixed=AUTO_FIXED, **kw):
  """--gamma=auto over AUTO_GAMMAS: the gammas forced by `fixed` in turn, or
  (None) chosen by the GammaChooser on auto_costs."""
  p, cost = auto_plan(target, draft), auto_costs(len(prompts))
  autogamma.check_batch(cost, len(prompts))
  chooser = (adaptive.Fixed([f"chain:{g}" for g in fixed]) if fixed else
             autogamma.GammaChooser(cost, p))
  return adaptive.generate(target, draft, prompts, AUTO_W, p, chooser, seed=9, **kw)


def auto_pvalues(pair_, runs) -> dict[str, float]:
  """Every pair (t_i, t_j) of the window, for each run's rows."""
  _, which = tiled(AUTO_ROWS)
  ps = {}
  for name, res in runs.items():
    tokens = np.array(res.tokens)
    ps.update({f"{name}, {k}": v for k, v in pvalues_of(
        tokens, which, pair_[0], AUTO_SP, lags=range(1, AUTO_W)).items()})
  return ps


@pytest.fixture(scope="module")
def auto_warm(pair):
  """adaptive.warm_up for the runs below (every gamma's chunk program; the
  self-draft runs have the same shapes)."""
  prompts, _ = tiled(AUTO_ROWS)
  target, draft = pair
  adaptive.warm_up(target, draft, prompts, AUTO_W, auto_plan(target, draft))
  return prompts


def test_auto_gamma_keeps_the_target_law_and_compiles_nothing_after_warm_up(pair, auto_warm):
  """Gamma switches between chunks (1 -> 4 -> 1, forced) and as the chooser
  picks: every pair of tokens of the window follows the target's law, with
  the noisy draft and with the target as its own draft (every step fully
  accepted: each switch follows a step that left the draft behind), and
  nothing compiles after warm-up.

  The compile check's deliberate bug, checked by hand (not committed: a
  recompile costs ~15 s): adaptive.warm_up over the last candidate only
  (its loop's one line) makes the forced run compile chain:1's chunk
  program (3.5 s, rechecked on the adaptive loop).
  The law's is committed below."""
  target, draft = pair
  runs = {"noisy draft": auto_run(target, draft, auto_warm),
          "self draft": auto_run(target, target, auto_warm),
          "chooser": auto_run(target, draft, auto_warm, fixed=None)}
  assert [autogamma.gamma_of(k) for k in runs["noisy draft"].chosen[:3]] == [1, 4, 4]
  assert runs["self draft"].records.n_acc.max() == 4
  for name, res in runs.items():
    assert res.compile_s == 0, (name, res.compile_s)
  ps = auto_pvalues(pair, runs)
  assert adjusted(ps) > lawcheck.ALPHA, {k: v for k, v in ps.items() if v * len(ps) <= 0.01}


def test_chunks_that_reuse_step_keys_fail_the_law(pair, patched):
  """The deliberate bug: each chunk numbers its steps from 0 again for
  their keys (the device loop, one chunk, is unaffected)."""
  patched(speculative, "_run_steps", mutant(
      speculative._run_steps,  # pylint: disable=protected-access
      ("  def cond(c):", "  i_start = i\n\n  def cond(c):"),
      ("_steps(key, i, tparams", "_steps(key, i - i_start, tparams")))
  prompts, _ = tiled(AUTO_ROWS)
  target, draft = pair
  ps = auto_pvalues(pair, {"noisy draft": auto_run(target, draft, prompts),
                           "self draft": auto_run(target, target, prompts)})
  print(f"MUTATION | chunk keys restart | adjusted p {adjusted(ps):.3g}")
  assert adjusted(ps) < lawcheck.ALPHA

# ---------------------------------------------------------------- blocked attention

BLOCK = 4  # KV slots per attention block: the cache (16 slots) holds 4
BLOCK_SETTING = ("T0.7", 2)
BLOCK_ROWS = 4000  # rows per prompt: the pair depends weakly on far context


def blocked(m: steps.Runner) -> steps.Runner:
  """The same weights with attention over blocks of BLOCK slots."""
  return steps.Runner(m.cfg.replace(attn_block=BLOCK), m.params)


def blocked_pvalues(pair_) -> dict[str, float]:
  """lawcheck's p-values (every pair of consecutive tokens, the acceptance)
  of runs through blocked attention, against the laws of the unblocked
  models (attention in one masked pass: lawcheck's reference forward over a
  cache of at most 11 slots never blocks)."""
  target, draft = pair_
  sp, gamma = lawcheck.SAMPLINGS[BLOCK_SETTING[0]], BLOCK_SETTING[1]
  ps = {}
  for name, d in (("noisy draft", draft), ("self draft", target)):
    tokens, ks, which = lawcheck.sample(blocked(target), blocked(d), sp, gamma, BLOCK_ROWS)
    for i, prompt in enumerate(lawcheck.PROMPTS):
      laws = lawcheck.exact_laws(target, d, prompt, sp, gamma)
      t, k = tokens[which == i], ks[which == i]
      for j, law in enumerate(laws.pairs):
        counts = np.bincount(t[:, j] * V + t[:, j + 1], minlength=V * V)
        ps[f"{name}, prompt {i} pair t{j},t{j + 1}"] = lawcheck.chi2_pvalue(counts, law)
      counts = np.bincount(k[:, 0] * 2 + (k[:, 1] > 0), minlength=2 * (gamma + 1))
      ps[f"{name}, prompt {i} acceptance"] = lawcheck.chi2_pvalue(counts, laws.accept)
  return ps


def test_sampling_through_several_attention_blocks_is_exact(pair):
  """Every row's verify reaches the second block in its first step (the
  shortest prompt has 2 tokens, gamma 2: slots 2..4), the longest prompt's
  rows the third (slots up to 12); the cache has more than one block, so
  the blocked path runs (layers.Attention)."""
  gamma = BLOCK_SETTING[1]
  cap = generation.plan_capacity(blocked(pair[0]).cfg, max(map(len, lawcheck.PROMPTS)),
                                 gamma + 3, extra=gamma)
  assert cap > BLOCK and min(map(len, lawcheck.PROMPTS)) + gamma >= BLOCK, cap
  ps = blocked_pvalues(pair)
  assert adjusted(ps) > lawcheck.ALPHA, {k: v for k, v in ps.items() if v * len(ps) <= 0.01}


def test_blocks_counted_from_the_shortest_row_fail_the_law(pair, patched):
  """The deliberate bug: the blocks visited follow the shortest row of the
  ragged batch, not the longest: the longer rows miss their last block."""
  patched(layers, "attend_blocked", mutant(layers.attend_blocked, (
      "n_blocks = (jnp.max(positions) + block) // block",
      "n_blocks = (jnp.min(positions) + block) // block")))
  ps = blocked_pvalues(pair)
  print(f"MUTATION | blocks from the shortest row | adjusted p {adjusted(ps):.3g}")
  assert adjusted(ps) < lawcheck.ALPHA

# ---------------------------------------------------------------- the tail model

TAIL_RULE, TAIL_GAMMA, TAIL_N, TAIL_RUNS = "bernoulli:0.7", 2, 16, 400
TAIL_PROMPTS = lawcheck.PROMPTS + [[5, 5]]  # B = 4


def loop_steps(target, runs: int = TAIL_RUNS) -> np.ndarray:
  """The loop steps of `runs` runs (seeds) of B = 4 rows: the steps the
  batch ran, until its slowest row was done."""
  out = []
  for seed in range(runs):
    res = speculative.generate(target, target, TAIL_PROMPTS, TAIL_N, TAIL_GAMMA,
                               rule=TAIL_RULE, seed=seed)
    out.append(int(res.records.step.max()) + 1)
  return np.array(out)


def tail_mismatch(steps_: np.ndarray) -> list[str]:
  """The engine's loop steps against theory's tail model for B = 4 rows of
  n_predict - 1 tokens after the first (the first comes from the prefill):
  the mean within 4 standard errors of expected_batch_steps, and the
  histogram against P(max <= s) = P(S <= s)^B (chi-square, p > 1e-4)."""
  rule = acceptance.parse_rule(TAIL_RULE)
  pmf = theory.accept_pmf_from_position_probs(acceptance.position_probs(rule, TAIL_GAMMA))
  b, n = len(TAIL_PROMPTS), TAIL_N - 1
  want = theory.expected_batch_steps(pmf, n, b)
  tol = 4 * steps_.std() / np.sqrt(len(steps_))
  bad = []
  if abs(steps_.mean() - want) > tol:
    bad.append(f"mean loop steps {steps_.mean():.3f}, predicted {want:.3f} +- {tol:.3f}")
  law = np.diff(theory.steps_cdf(pmf, n) ** b, prepend=0.0)  # P(max = s), s = 0..n
  p = lawcheck.chi2_pvalue(np.bincount(steps_, minlength=n + 1), law)
  if p < lawcheck.ALPHA:
    bad.append(f"loop steps histogram {np.bincount(steps_).tolist()}: p = {p:.3g}")
  return bad


def test_loop_steps_follow_the_tail_model(pair):
  """400 runs at B = 4, gamma 2, bernoulli:0.7, 15 tokens after the first:
  measured mean 8.315 loop steps, sd 0.91, against 8.314 predicted; the
  predictions at B = 1 (7.20) and B = 3 (8.10) lie outside the tolerance
  (0.18): the test sees the tail."""
  steps_ = loop_steps(pair[0])
  assert not tail_mismatch(steps_), tail_mismatch(steps_)
  rule = acceptance.parse_rule(TAIL_RULE)
  pmf = theory.accept_pmf_from_position_probs(acceptance.position_probs(rule, TAIL_GAMMA))
  tol = 4 * steps_.std() / np.sqrt(len(steps_))
  for b in (1, 3):
    assert abs(steps_.mean() - theory.expected_batch_steps(pmf, TAIL_N - 1, b)) > tol, b


def test_a_loop_that_stops_with_its_first_row_fails_the_tail_model(pair, patched):
  """The deliberate bug: the loop ends when any row is done, not all."""
  patched(speculative, "_run_steps", mutant(
      speculative._run_steps,  # pylint: disable=protected-access
      ("return (i < stop) & ~jnp.all(done)", "return (i < stop) & ~jnp.any(done)")))
  assert tail_mismatch(loop_steps(pair[0], 100))
