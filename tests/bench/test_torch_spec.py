"""Batched speculative decoding in PyTorch (backends/torch_spec.py): the same
tokens as batch-1 target-only generation and as specjax, on the same weights."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.model import config
from specjax.decode import generation
from specjax.decode import speculative
from specjax.model import steps
from specjax.bench.backends import torch_spec as ts
from specjax.errors import CacheOverflowError, ConfigError

# Ragged: 5, 3, 8 and 1 tokens.
PROMPTS = [[5, 17, 42, 9, 100], [7, 7, 7], [200, 1, 64, 3, 9, 81, 27, 2], [11]]
N_PREDICT = 14


def _perturbed(params, scale: float, seed: int):
  """A draft that mostly agrees with the target: its weights plus noise."""
  leaves, tree = jax.tree_util.tree_flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  noisy = [x + scale * jnp.std(x) * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
  return jax.tree_util.tree_unflatten(tree, noisy)


@pytest.fixture(scope="module")
def pair(transformers, init_params):
  """(torch engine, eager; specjax target Runner, draft Runner): a target with
  peaked distributions (random init is flat) and a draft that agrees with it
  part of the time, so accepted lengths vary."""
  del transformers
  cfg = config.get_preset("tiny")
  params = dict(init_params(cfg, 1))
  params["lm_head"] = {"kernel": params["lm_head"]["kernel"] * 40.0}
  dparams = _perturbed(params, 0.5, 3)
  engine = ts.make_engine(cfg, params, cfg, dparams, compile=False, threads=1)
  return engine, steps.Runner(cfg, params), steps.Runner(cfg, dparams)


@pytest.fixture(scope="module")
def baseline(pair):
  engine, target, _ = pair
  return engine.generate_target(PROMPTS, N_PREDICT).tokens


def test_target_only_batched_equals_batch1_and_specjax(pair, baseline):
  engine, target, _ = pair
  assert [len(r) for r in baseline] == [N_PREDICT] * len(PROMPTS)
  for prompt, row in zip(PROMPTS, baseline):
    assert engine.generate_target([prompt], N_PREDICT).tokens[0] == row
  assert generation.generate(target, PROMPTS, N_PREDICT).tokens == baseline


@pytest.mark.parametrize("gamma", [1, 2, 4])
def test_speculative_greedy_equals_target_only_and_specjax(pair, baseline, gamma):
  engine, target, draft = pair
  got = engine.generate(PROMPTS, N_PREDICT, gamma)
  want = speculative.generate(target, draft, PROMPTS, N_PREDICT, gamma)
  assert got.tokens == baseline
  assert want.tokens == baseline
  # The same steps: accepted counts and catch-ups row by row, step by step.
  for f in ("n_acc", "kept", "caught_up", "step", "row"):
    np.testing.assert_array_equal(getattr(got.records, f), getattr(want.records, f), err_msg=f)
  assert 0 < got.stats.n_accept < got.stats.n_drafted  # partial acceptance: both paths ran


def test_draft_equal_to_target_accepts_everything(pair, baseline):
  engine, _, _ = pair
  got = ts.TorchSpec(engine.target, engine.target).generate(PROMPTS, N_PREDICT, 2)
  assert got.tokens == baseline
  assert got.stats.accept_rate == 1.0 and got.stats.n_catchup > 0


@pytest.mark.parametrize("gamma", [1, 2, 4])
def test_always_steps(pair, gamma):
  engine, _, _ = pair
  got = engine.generate(PROMPTS, N_PREDICT, gamma, rule="always")
  per_row = math.ceil((N_PREDICT - 1) / (gamma + 1))  # specjax's count (next test)
  assert got.n_loop == per_row
  assert got.stats.n_steps == per_row * len(PROMPTS)
  assert got.stats.n_kept == (N_PREDICT - 1) * len(PROMPTS)
  assert got.stats.n_catchup == (per_row - 1) * len(PROMPTS)


@pytest.mark.parametrize("rule", ["always", "fraction:0.5"])
def test_simulated_rules_match_specjax(pair, rule):
  """gamma 4 (one specjax compilation serves every simulated rule)."""
  engine, target, draft = pair
  got = engine.generate(PROMPTS, N_PREDICT, 4, rule=rule)
  want = speculative.generate(target, draft, PROMPTS, N_PREDICT, 4, rule=rule)
  assert got.tokens == want.tokens
  for f in ("n_acc", "kept", "caught_up", "step", "row"):
    np.testing.assert_array_equal(getattr(got.records, f), getattr(want.records, f), err_msg=f)
  if rule == "always":
    assert want.stats.n_steps == math.ceil((N_PREDICT - 1) / 5) * len(PROMPTS)
  else:
    assert set(got.records.n_acc.tolist()) == {2}  # ceil(0.5 * 4)


def test_bernoulli_rows_independent_seeded_and_extremes(pair, baseline):
  engine, _, _ = pair
  a = engine.generate(PROMPTS, N_PREDICT, 4, rule="bernoulli:0.5", seed=1)
  b = engine.generate(PROMPTS, N_PREDICT, 4, rule="bernoulli:0.5", seed=1)
  assert a.tokens == b.tokens
  np.testing.assert_array_equal(a.records.n_acc, b.records.n_acc)
  first = a.records.at_step(0)
  assert len(set(first.tolist())) > 1  # rows draw their own acceptances
  # P = 0 accepts nothing: every step emits the target's argmax, i.e. target-only.
  zero = engine.generate(PROMPTS, N_PREDICT, 4, rule="bernoulli:0")
  assert zero.tokens == baseline and zero.stats.n_accept == 0
  one = engine.generate(PROMPTS, N_PREDICT, 4, rule="bernoulli:1")
  assert one.tokens == engine.generate(PROMPTS, N_PREDICT, 4, rule="always").tokens


def test_bad_input(pair):
  engine, _, _ = pair
  cap = len(PROMPTS[2]) + N_PREDICT + 2  # exactly enough at gamma 2
  assert len(engine.generate(PROMPTS, N_PREDICT, 2, capacity=cap).tokens[2]) == N_PREDICT
  with pytest.raises(CacheOverflowError):
    engine.generate(PROMPTS, N_PREDICT, 2, capacity=cap - 1)
  with pytest.raises(CacheOverflowError):
    engine.generate_target(PROMPTS, N_PREDICT, capacity=len(PROMPTS[2]) + N_PREDICT - 1)
  with pytest.raises(CacheOverflowError):  # past the model's max_seq_len
    engine.generate([[1] * 100], 40, 2)
  for bad in ([[1, 2], []], [], [[1, 999]]):
    with pytest.raises(ConfigError):
      engine.generate(bad, N_PREDICT, 2)
    with pytest.raises(ConfigError):
      engine.generate_target(bad, N_PREDICT)
  with pytest.raises(ConfigError):
    engine.generate(PROMPTS, N_PREDICT, 0)
  with pytest.raises(ConfigError):
    engine.generate(PROMPTS, 0, 2)
  with pytest.raises(ConfigError):
    engine.generate(PROMPTS, N_PREDICT, 2, rule="bernoulli:2")


def test_a_write_past_the_capacity_is_refused(pair):
  engine, _, _ = pair
  cache = engine.target.new_cache(2, 8)
  cache.lengths.fill_(6)
  tokens = engine.torch.zeros((2, 3), dtype=engine.torch.int64)
  with pytest.raises(CacheOverflowError):
    engine.target.step(tokens, cache)
  assert cache.lengths.tolist() == [6, 6]


def test_compiled_equals_eager_and_timing(pair, baseline):
  """torch.compile'd steps (T = 1 and T = gamma + 1 = 2) emit the eager
  tokens; the timing API times without building graphs; the cost probe."""
  engine, _, _ = pair
  prompts, cap = PROMPTS[:2], 32  # one capacity: three graphs (draft 1, target 1, 2)
  comp = ts.TorchSpec(ts.TorchLlama(engine.target.cfg, model=engine.target.model),
                      ts.TorchLlama(engine.draft.cfg, model=engine.draft.model.model))
  got = comp.generate(prompts, N_PREDICT, 1, capacity=cap)
  assert comp.target.compile_note is None and comp.target.compiled
  assert got.tokens == baseline[:2]
  assert comp.generate_target(prompts, N_PREDICT, capacity=cap).tokens == baseline[:2]
  r = ts.time_point(comp, prompts, N_PREDICT, 1, "always", reps=2, capacity=cap)
  assert r["graphs_built"] == 0  # all warm
  assert r["batch"] == 2 and r["baseline_tps"] > 0 and r["spec_tps"] > 0
  assert r["n_loop"] == math.ceil((N_PREDICT - 1) / 2) and len(r["speedup_reps"]) == 2
  t = ts.TorchCostProbe(engine.target, 2, 32, 8, k=2).times([1, 2], reps=2)
  assert set(t) == {1, 2} and all(x > 0 for v in t.values() for x in v.times)


def test_bench_script_reports_both_engines_and_auto(transformers, tmp_path):
  """experiments/torch_spec_bench.py end to end on tiny models: both
  engines' points with identical tokens under `always`, an auto point, the
  crossover and auto tables, the plots; every point keeps its rows (prompt
  ids, tokens, baseline tokens), and under the real rule (greedy, float32)
  each row's speculative tokens are its target-only tokens, on both engines."""
  import os, subprocess, sys  # pylint: disable=import-outside-toplevel,multiple-imports
  del transformers
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  out = tmp_path / "out"
  proc = subprocess.run(
      [sys.executable, os.path.join(root, "experiments", "torch_spec_bench.py"),
       "--model=tiny", "--model_draft=tiny-draft", "--batch=2", "--gamma=1,2,auto", "--rules=always,real",
       "--n_predict=8", "--prompt_len=9", "--reps=1", "--nocompile", "--threads=1", "--k=1",
       f"--out_dir={out}", f"--jsonl_out={tmp_path / 'r.jsonl'}"],
      capture_output=True, text=True, timeout=600, cwd=root)
  assert proc.returncode == 0, proc.stderr[-3000:]
  import json  # pylint: disable=import-outside-toplevel
  recs = [json.loads(l) for l in (tmp_path / "r.jsonl").read_text().splitlines()]
  pts = [r for r in recs if r["kind"] == "point"]
  assert {(r["engine"], r["gamma"]) for r in pts} == {
      ("torch-eager", 1), ("torch-eager", 2), ("specjax", 1), ("specjax", 2), ("specjax", "auto")}
  always = [r for r in pts if r["accept_rule"] == "always"]
  assert all(r["tokens_equal"] for r in always if r["engine"] == "specjax" and r["gamma"] != "auto")
  auto = next(r for r in pts if r["gamma"] == "auto")
  assert sum(auto["gammas_used"].values()) == auto["n_loop"] > 0  # loop steps, not row-steps
  # the rows: the same two ragged prompts at every point, 8 tokens each
  prompts = [row["prompt_ids"] for row in pts[0]["rows"]]
  assert [len(p) for p in prompts] == [9, 7]
  for r in pts:
    assert [row["prompt_ids"] for row in r["rows"]] == prompts
    assert all(len(row["tokens"]) == len(row["baseline_tokens"]) == 8 for row in r["rows"])
  real = [r for r in pts if r["accept_rule"] == "real"]
  assert len(real) == 5
  for r in real:  # greedy: speculative = target-only, row by row
    assert [row["tokens"] for row in r["rows"]] == [row["baseline_tokens"] for row in r["rows"]]
  assert real[0]["rows"][0]["tokens"] != real[0]["rows"][1]["tokens"]  # rows not mixed up
  # every draft accepted: not the target's tokens (the rows are not the baseline copied)
  assert all(any(row["tokens"] != row["baseline_tokens"] for row in r["rows"]) for r in always)
  summary = (out / "summary.md").read_text()
  for s in ("## Crossover", "| always | 2 |", "## Auto gamma (specjax)", "auto / best fixed",
            "By speculative tokens/s alone"):
    assert s in summary, s
  for name in ("speedup_vs_batch.png", "verify_surface_specjax.png",
               "verify_surface_torch-eager.png"):
    assert (out / name).stat().st_size > 0, name
