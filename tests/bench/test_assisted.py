"""specjax speculative decoding vs HF assisted generation (specjax.bench.studies.assisted)."""

import json
import os
import subprocess
import sys

import pytest

from specjax.bench.studies import assisted
from specjax.model import steps
from specjax.model.config import get_preset

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT = [1, 5, 9, 200, 3, 7]


def _needs_torch():
  pytest.importorskip("torch", reason="HF assisted generation needs torch "
                      "(pip install -e '.[test]')")
  pytest.importorskip("transformers", reason="HF assisted generation needs transformers")


# ---------------------------------------------------------------- divergence (no torch)

def test_identical_lists_have_no_divergence():
  assert assisted.first_divergence([3, 1, 4], [3, 1, 4]) is None


def test_divergence_reports_first_index_and_both_tokens():
  a = [3, 1, 4, 1, 5, 9]
  b = list(a)
  b[3] = 7
  b[5] = 8  # a later difference: only the first is reported
  d = assisted.first_divergence(a, b)
  assert d == assisted.Divergence(index=3, a=1, b=7)
  assert str(d) == "first differs at token 3: 1 vs 7"


def test_divergence_of_a_shorter_list():
  d = assisted.first_divergence([3, 1, 4], [3, 1])
  assert d == assisted.Divergence(index=2, a=4, b=None)
  assert "4 vs end" in str(d)


def _engine(name, base, spec):
  t = assisted.timing.Timing([1.0])
  return assisted.EngineResult(name, len(base), base, spec, t, t, 1, 4, 2)


def test_divergences_and_table_name_the_altered_token():
  toks = [5, 6, 7, 8, 9]
  bad = [5, 6, 0, 8, 9]
  engines = {"hf": _engine("hf", toks, toks), "specjax": _engine("specjax", toks, bad)}
  div = assisted.divergences(engines)
  assert div["speculative: specjax vs hf"] == assisted.Divergence(2, 0, 7)
  assert div["specjax: speculative vs baseline"] == assisted.Divergence(2, 0, 7)
  assert div["baseline: specjax vs hf"] is None and div["hf: assisted vs baseline"] is None
  r = assisted.PairResult("p", "t", "d", 4, [1], 16, 2, "sdpa", engines, div)
  assert not r.identical
  rows = {row[0]: row for row in assisted.table_rows([r])}
  assert rows["specjax"][6] == "no (vs hf: token 2)"
  assert rows["hf"][6] == "no (vs specjax: token 2)"
  rec = json.loads(json.dumps(r.to_dict()))
  assert rec["divergences"]["speculative: specjax vs hf"] == {"index": 2, "a": 0, "b": 7}
  assert rec["tokens_identical"] is False


def test_goal_compares_speedups():
  def engine(name, spec_s):
    return assisted.EngineResult(name, 10, [0], [0], assisted.timing.Timing([1.0]),
                                 assisted.timing.Timing([spec_s]), 1, 1, 1)
  engines = {"hf": engine("hf", 1.25), "specjax": engine("specjax", 1.0)}
  r = assisted.PairResult("p", "t", "t", 4, [1], 16, 2, "sdpa", engines, {})
  g = assisted.goal(r)
  assert g["holds"] and g["specjax_speedup"] == 1.0 and g["hf_speedup"] == 0.8


# ---------------------------------------------------------------- end to end (torch)

@pytest.fixture(scope="module")
def tiny_models(init_params):
  _needs_torch()
  cfg, dcfg = get_preset("tiny"), get_preset("tiny-draft")
  return steps.Runner(cfg, init_params(cfg, 0)), steps.Runner(dcfg, init_params(dcfg, 1))


@pytest.mark.parametrize("pair", ["tiny/tiny-draft", "draft=target"])
def test_engines_emit_identical_tokens(tiny_models, pair):
  target, draft = tiny_models
  draft = target if pair == "draft=target" else draft
  r = assisted.compare(target, draft, PROMPT, 20, gamma=3, reps=1, pair=pair)
  assert r.identical, {k: str(d) for k, d in r.divergences.items()}
  hf, sj = r.engines["hf"], r.engines["specjax"]
  assert len(sj.spec_tokens) == 20 and hf.spec_tokens == sj.spec_tokens
  for e in (hf, sj):
    assert e.spec.median > 0 and e.baseline.median > 0 and len(e.spec.times) == 1
    assert 0 < e.n_drafted and 0 <= e.n_accept <= e.n_drafted
  if pair == "draft=target":  # every draft accepted, on both engines
    assert hf.accept_rate == 1.0 and sj.accept_rate == 1.0
    # HF: ceil(20 / (gamma + 1)) steps, the last drafting only what fits.
    assert (hf.n_steps, hf.n_drafted) == (5, 15)
  assert sj.decode["spec_compile_s"] >= 0 and sj.decode["spec_tokens_per_s"] > 0


def test_step_counter_counts_hf_drafts(tiny_models):
  target, _ = tiny_models
  pt_target, pt_self = assisted.torch_models(target, target)  # every draft accepted
  assisted.configure_assistant(pt_self, 2)
  counter = assisted.StepCounter(pt_target)
  with counter:
    toks = assisted.hf_generate(pt_target, PROMPT, 9, assistant=pt_self)
  assert toks == assisted.hf_generate(pt_target, PROMPT, 9)
  # Steps emit 3 tokens each (2 drafts + 1): prompt + 2 drafts, then [last, 2 drafts] twice.
  assert counter.widths == [len(PROMPT) + 2, 3, 3]
  assert counter.stats(len(PROMPT), 9) == {"n_steps": 3, "n_drafted": 6, "n_accept": 6}
  assisted.hf_generate(pt_target, PROMPT, 3)  # the hook is gone outside `with`
  assert counter.widths == [len(PROMPT) + 2, 3, 3]


def test_script_runs_both_pairs(tmp_path):
  _needs_torch()
  out = tmp_path / "cmp.json"
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "experiments", "compare_assisted.py"),
       "--model=tiny", "--model_draft=tiny-draft", "--gamma=3", "--n_predict=12", "--reps=1",
       "--prompt_tokens=4,5,6", f"--json_out={out}"],
      capture_output=True, text=True, timeout=300, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr
  assert "| engine" in proc.stdout and "performance goal" in proc.stdout
  rec = json.loads(out.read_text())
  assert [p["draft"] for p in rec["pairs"]] == ["tiny-draft", "tiny"]
  assert all(p["tokens_identical"] for p in rec["pairs"]), proc.stdout
  assert rec["environment"]["torch_threads"] == 2 and "jax" in rec["environment"]
  assert "holds" in rec["goal"]
  # a row per (pair, engine): the prompt ids, its tokens, its target-only tokens (greedy,
  # float32: the same)
  assert [(r["pair"], r["engine"]) for r in rec["rows"]] == [
      (p["pair"], e) for p in rec["pairs"] for e in p["engines"]]
  for r in rec["rows"]:
    assert r["prompt_ids"] == [4, 5, 6] and len(r["tokens"]) == 12
    assert r["tokens"] == r["baseline_tokens"], r


def test_default_schedule_is_what_hf_gives_a_user_who_sets_nothing(tiny_models):
  target, _ = tiny_models
  from transformers import GenerationConfig
  _, pt_self = assisted.torch_models(target, target)
  gc, fresh = pt_self.generation_config, GenerationConfig()
  assisted.configure_assistant(pt_self, 3)
  constant = [getattr(gc, f) for f in assisted.ASSISTANT_FIELDS]
  assisted.configure_assistant(pt_self, 3, "default")  # after the constant one: undone
  got = [getattr(gc, f) for f in assisted.ASSISTANT_FIELDS]
  assert got == [getattr(fresh, f) for f in assisted.ASSISTANT_FIELDS] and got != constant
  with pytest.raises(assisted.ConfigError, match="schedule"):
    assisted.configure_assistant(pt_self, 3, "heuristic")


def test_hfs_default_schedule_against_per_row_lengths(tiny_models, monkeypatch):
  """HF's own schedule and specjax's per-row lengths (budget=auto) emit the
  target's tokens; the schedule is not the constant one (the draft = target
  pair accepts every draft, so HF's default drafts other widths than 3), and
  specjax's speculative call is the per-row one (a constant gamma 3 would
  emit the same tokens)."""
  target, draft = tiny_models
  calls, rows_call = [], assisted.rows_call
  monkeypatch.setattr(assisted, "rows_call",
                      lambda *a, **k: calls.append(a[4]) or rows_call(*a, **k))
  for d in (draft, target):
    r = assisted.compare(target, d, PROMPT, 20, gamma=3, reps=1, hf_schedule="default",
                         specjax_gamma="auto:rows,max=3,budget=auto")
    assert r.identical, {k: str(x) for k, x in r.divergences.items()}
    assert r.hf_schedule == "default" and r.to_dict()["specjax_gamma"] == "auto:rows,max=3,budget=auto"
  hf = r.engines["hf"]
  assert hf.accept_rate == 1.0 and (hf.n_steps, hf.n_drafted) != (5, 15)
  assert calls == ["auto:rows,max=3,budget=auto"] * 2


def test_script_runs_each_prompt_of_a_file(tmp_path):
  _needs_torch()
  out, prompts = tmp_path / "cmp.json", tmp_path / "p.txt"
  prompts.write_text("4,5,6\n7,8,9,10\n")
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "experiments", "compare_assisted.py"),
       "--model=tiny", "--model_draft=tiny-draft", "--gamma=2", "--n_predict=8", "--reps=1",
       f"--prompt_file={prompts}", "--noself_pair", "--hf_schedule=default",
       f"--json_out={out}"],
      capture_output=True, text=True, timeout=300, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr
  assert "its default schedule" in proc.stdout and "performance goal" not in proc.stdout
  rec = json.loads(out.read_text())
  assert [p["prompt_tokens"] for p in rec["pairs"]] == [[4, 5, 6], [7, 8, 9, 10]]
  assert [p["pair"].split(":")[0] for p in rec["pairs"]] == ["prompt 0", "prompt 1"]
  assert all(p["tokens_identical"] and p["hf_schedule"] == "default" for p in rec["pairs"])
  assert [r["prompt_ids"] for r in rec["rows"]] == [[4, 5, 6]] * 2 + [[7, 8, 9, 10]] * 2


def test_script_bad_input_is_one_line():
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "experiments", "compare_assisted.py"),
       "--model=tiny", "--model_draft=no-such-model"],
      capture_output=True, text=True, timeout=120, cwd=ROOT)
  assert proc.returncode == 1 and "Traceback" not in proc.stderr
  assert any(l.startswith("error:") for l in proc.stderr.splitlines())
