"""Speculative decoding at batch > 1: batched tokens, gamma chosen at run
time, the tail model, and the batch sweep end to end (the chooser itself:
tests/decode/test_autogamma.py)."""

import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import sweep_gamma
from specjax.decode import adaptive, autogamma, plan
from specjax.model import config
from specjax.decode import generation
from specjax.decode import speculative
from specjax.model import steps
from specjax.bench.sweep import engine, gamma, harness, points
from specjax.bench.sweep.config import SweepConfig
from specjax.metrics import theory
from specjax.metrics import timing
from specjax.errors import CacheOverflowError, ConfigError, SpecjaxError
from specjax.model.sampling import SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The runs share their compiled programs with the sweep below (same models,
# shapes, rule kind, auto set and chunk length): compiling is most of the time.
AUTO_SET = (1, 2)
EVERY = 3
N_PREDICT = 20
CAPACITY = 48
# ragged rows, two prefill buckets apart (lengths 3..13)
PROMPTS = [[5 + (7 * i + 3 * r) % 200 for i in range(n)] for r, n in enumerate((13, 3, 9, 6))]

# Synthetic costs (ms) where the best gamma falls as B grows: T_target(B, n) =
# 10 + (B / 2) (n - 1) (the verify turns compute-bound), T_draft(B, 1) = 1 at
# B <= 8 and 2 at 32, no accept cost.
def _synthetic(b: int) -> autogamma.BatchCosts:
  return autogamma.BatchCosts(b, {n: 10 + b / 2 * (n - 1) for n in (1, 2, 3, 5)},
                              1.0 if b <= 8 else 2.0)


@pytest.fixture(scope="module")
def pair(init_params):
  """The tiny target and a draft of its shape: its weights plus noise (15% of
  each tensor's std), so that about half the drafts are accepted."""
  tc = config.get_preset("tiny")
  params = init_params(tc, 3)
  leaves, tree = jax.tree_util.tree_flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(0), len(leaves))
  noisy = [x + 0.15 * jnp.std(x) * jax.random.normal(k, x.shape, x.dtype)
           for x, k in zip(leaves, keys)]
  return steps.Runner(tc, params), steps.Runner(tc, jax.tree_util.tree_unflatten(tree, noisy))


@pytest.fixture(scope="module")
def target_only(pair):
  """Greedy target-only tokens of each row, run alone (batch 1)."""
  t, _ = pair
  return [generation.generate(t, [p], N_PREDICT, capacity=CAPACITY).tokens[0] for p in PROMPTS]


def _plan(pair):
  t, d = pair
  return plan.resolve(t.cfg, d.cfg, gamma="auto", auto_set=AUTO_SET)


def _run(pair, cost, chooser):
  """adaptive.generate of the auto-gamma plan over PROMPTS."""
  t, d = pair
  return adaptive.generate(t, d, PROMPTS, N_PREDICT, _plan(pair), chooser, capacity=CAPACITY,
                           every=EVERY)


def _gammas(res) -> list[int]:
  return [autogamma.gamma_of(k) for k in res.chosen]


@pytest.fixture(scope="module")
def fixed_runs(pair):
  """The adaptive loop forcing each gamma of the set (compiles every chunk program)."""
  return {g: _run(pair, None, adaptive.Fixed([f"chain:{g}"])) for g in AUTO_SET}


def test_batched_speculative_equals_target_only_row_by_row(pair, target_only, fixed_runs):
  t, d = pair
  for g, res in fixed_runs.items():  # the chunked loop, one gamma throughout
    assert res.tokens == target_only, g
    assert set(_gammas(res)) == {g}
  # the whole device loop (spec_loop) on the same ragged batch
  res = speculative.generate(t, d, PROMPTS, N_PREDICT, 2, capacity=CAPACITY)
  assert res.tokens == target_only
  assert res.records.n_acc.tolist() == fixed_runs[2].records.n_acc.tolist()
  assert 0 < res.stats.n_accept < res.stats.n_drafted  # the draft is not the target


def test_auto_gamma_switches_emits_target_only_tokens_and_compiles_nothing(
    pair, target_only, fixed_runs):
  t, d = pair
  # gamma 2 is best above alpha ~0.8, gamma 1 below (checked by hand: at 0.95
  # 1.50 vs 1.39, at 0.67 1.12 vs 1.19)
  cost = autogamma.BatchCosts(len(PROMPTS), {1: 10.0, 2: 12.0, 3: 16.0}, 1.0)
  assert [autogamma.choose(cost, a, AUTO_SET) for a in (0.95, 0.67)] == [2, 1]
  p = _plan(pair)
  with timing.CompileWatch() as cw:
    # a prior of 0.95 starts at gamma 2; the draft's acceptance is lower, so
    # the estimate falls and the chooser moves down to 1
    auto = _run(pair, cost, autogamma.GammaChooser(cost, p, prior_alpha=0.95))
    sched = _run(pair, cost, adaptive.Fixed(["chain:2", "chain:1", "chain:1", "chain:2"]))
    cal = autogamma.calibrate(t, d, PROMPTS, N_PREDICT, cost, p, capacity=CAPACITY,
                              every=EVERY)
  assert cw.count == 0, dict(cw.names)
  assert sorted(cal.t_step) == sorted(AUTO_SET) and min(cal.t_step.values()) > 0
  assert autogamma.BatchCosts.from_dict(cal.to_dict()) == cal
  assert auto.tokens == target_only and sched.tokens == target_only
  used = _gammas(auto)
  assert used[0] == 2 and 1 in used, used
  # each choice's alpha is the estimate from every step before it
  # chunks of 1, 2, 4, .. EVERY steps: chunk c starts at step starts[c]
  starts = np.cumsum([0] + [min(EVERY, 2 ** c) for c in range(len(auto.estimates))])
  rec = auto.records
  for c, alpha in enumerate(auto.estimates):
    before = rec.step < starts[c]
    acc, rej = rec.n_acc[before].sum(), (rec.n_acc < rec.n_drafted)[before].sum()
    assert alpha == pytest.approx(autogamma.estimate_alpha(acc, rej, 0.95)), c
  assert auto.estimates[-1] < 0.8
  assert _gammas(sched)[:10] == [2, 1, 1, 1, 1, 1, 2, 2, 2, 2]
  # the records hold each step's own drafts: never more than its gamma
  live = auto.records
  per_step = np.asarray(used)[live.step]
  assert (live.n_drafted == per_step).all()
  # ... and its gamma: alpha counts each step against the gamma it ran
  assert live.gamma.tolist() == per_step.tolist()
  assert auto.stats.alpha == pytest.approx(
      theory.alpha_from_accepted_steps(auto.stats.n_accept, per_step), abs=1e-12)


def test_tail_model_against_monte_carlo():
  rng = np.random.default_rng(0)
  for alpha, gamma, b, n in [(0.8, 4, 8, 31), (0.5, 2, 1, 20), (0.6, 3, 32, 15)]:
    pmf = theory.geometric_accept_pmf(alpha, gamma)
    exact = theory.expected_batch_steps(pmf, n, b)
    # the engine's law, simulated directly: every row emits 1 + k per step
    # until it holds n tokens; the loop runs until the last row is done
    k = rng.choice(gamma + 1, p=pmf, size=(20000, b, n))
    steps_row = np.argmax(np.cumsum(k + 1, -1) >= n, -1) + 1
    sim = steps_row.max(-1)
    assert abs(sim.mean() - exact) < 4 * sim.std() / math.sqrt(sim.size), (alpha, gamma, b)
  # deterministic acceptance: every row takes ceil(n / (gamma + 1)) steps
  always = theory.accept_pmf_from_position_probs([1.0] * 3)
  assert theory.expected_batch_steps(always, 30, 16) == pytest.approx(math.ceil(30 / 4))
  # more rows, more steps
  pmf = theory.geometric_accept_pmf(0.7, 4)
  s = [theory.expected_batch_steps(pmf, 31, b) for b in (1, 2, 8, 32)]
  assert s == sorted(s) and s[-1] > s[0] + 2


def test_bad_input_is_one_clear_error(pair, tmp_path):
  t, d = pair
  for bad in ("", ",", "0,2", "1,x"):
    with pytest.raises(ConfigError, match="auto gamma set"):
      plan.parse_gamma_set(bad)
  # a row that does not fit: prompt 13 + 20 + max gamma 2 > 34 slots
  with pytest.raises(CacheOverflowError, match="gamma"):
    adaptive.generate(t, d, PROMPTS, N_PREDICT, _plan(pair), adaptive.Fixed(["chain:2"]),
                      capacity=34)
  with pytest.raises(ConfigError, match="batch 1"):  # the sweep's door checks the batch
    engine.Loop(t, d, CAPACITY, N_PREDICT, 0).auto_chain(
        PROMPTS, _synthetic(1), AUTO_SET, SamplingParams(), "real", "model", EVERY)
  # the script: an empty prompt line is one line on stderr, exit 1
  (tmp_path / "p.txt").write_text("1,2,3\n\n4,5\n")
  r = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "speculative.py"),
                      "--model=tiny", "--model_draft=tiny-draft",
                      f"--prompt_file={tmp_path / 'p.txt'}", "--n_predict=4"],
                     capture_output=True, text=True, timeout=120, cwd=ROOT,
                     env={**os.environ, "PYTHONPATH": ROOT})
  assert r.returncode == 1 and r.stderr.strip().count("\n") == 0, r.stderr
  assert "line 2 is empty" in r.stderr


def _batch_config(**kw) -> SweepConfig:
  """Batches 1 and 4, gammas 1 and 2, the real rule (greedy), auto gamma: the
  shapes of the runs above (capacity = ctx_size + 2 = 48)."""
  c = sweep_gamma.get_config("batch_quick")
  c.batches, c.gammas, c.accepts = (1, 4), AUTO_SET, ("real",)
  c.target = c.draft = "tiny"  # the shapes of `pair` (random weights: seed, seed + 1)
  c.prompt_tokens = ",".join(str(t) for t in range(7, 19))  # 12 tokens
  c.n_predict, c.ctx_size, c.reps, c.auto_every = N_PREDICT, CAPACITY - 2, 1, EVERY
  return SweepConfig.from_mapping(c).replace(**kw)


def run(cfg, workdir, **kw):
  return harness.run(gamma.RUNNER, cfg, str(workdir), progress=False, **kw)


def test_batch_sweep_end_to_end_and_resume(tmp_path, monkeypatch):
  cfg = _batch_config(auto_gamma=True)
  records = run(cfg, tmp_path)
  keys = sorted((r["batch"], str(r["gamma"])) for r in records)
  assert keys == [(1, "1"), (1, "2"), (1, "auto"), (4, "1"), (4, "2"), (4, "auto")]
  assert all(r["capacity"] == CAPACITY for r in records)
  for r in records:
    assert r["n_kept"] == r["batch"] * (cfg.n_predict - 1)  # every row emits n_predict
    assert r["speedup"] > 0 and r["steps_measured"] >= math.ceil((cfg.n_predict - 1) / 3)
  for r in (r for r in records if r["gamma"] != "auto"):
    assert r["predicted_tail"] > 0 and r["steps_predicted"] > 0
  for name in ("speedup_vs_batch.png", "best_gamma.png", "verify_surface.png",
               "verify_surface.csv", "summary.md", "speedup.png"):
    assert (tmp_path / name).stat().st_size > 0, name
  costs = json.loads((tmp_path / "costs.json").read_text())
  assert sorted(costs["batches"]) == ["1", "4"]
  assert sorted(costs["batches"]["4"]["t_target_s"], key=int) == ["1", "2", "3"]
  summary = (tmp_path / "summary.md").read_text()
  for line in ("## Batches: the batch x gamma surface", "### Crossover",
               "| real | 0 | 1 |", "### Auto gamma against the fixed gammas",
               "Auto beats every single fixed gamma", "### Best gamma per (B, alpha)"):
    assert line in summary, line
  # resume: keep 4 finished points, the other 2 are run, the 4 are not redone
  path = tmp_path / "results.jsonl"
  lines = path.read_text().splitlines()
  path.write_text("\n".join(lines[:4]) + "\n")
  ran = []
  real = gamma.run_group
  monkeypatch.setattr(gamma, "run_group",
                      lambda b, ps: ran.extend(p.key for p in ps) or real(b, ps))
  again = run(cfg, tmp_path, resume=True)
  assert len(again) == 6 and sorted(map(str, ran)) == sorted(
      str(points.point_key(json.loads(l))) for l in lines[4:])
  assert path.read_text().splitlines()[:4] == lines[:4]
  with pytest.raises(SpecjaxError, match="batches"):
    _batch_config(batches=(0, 2))


def test_batch_prompts_are_ragged_and_batch_one_is_unchanged():
  p = [list(range(1, 11))]
  assert points.batch_prompts(p, 1) == [p]
  rows = points.batch_prompts(p, 8)[0]
  assert len(rows) == 8 and rows[0] == p[0] and len({len(r) for r in rows}) == 5
  assert all(r == p[0][:len(r)] and r for r in rows)
