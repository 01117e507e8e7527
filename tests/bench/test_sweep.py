"""The sweep end to end on tiny models (seconds): outputs, resume, bad config."""

import json

import pytest

from configs import sweep_gamma
from specjax.formats import checkpoint
from specjax.model import config
from specjax.model import llama as model
from specjax.metrics import schema
from specjax.bench import sweep
from specjax.errors import SpecjaxError


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
  """One saved tiny model, used as both draft and target."""
  cfg = config.get_preset("tiny")
  path = tmp_path_factory.mktemp("tiny_ckpt")
  checkpoint.save(path, cfg, model.init_params(cfg, seed=3))
  return str(path)


def _tiny_config(path, **kw):
  c = sweep_gamma.get_config("quick")
  c.target = c.draft = path   # draft = target: real acceptance is total
  c.gammas = (1, 3)
  c.accepts = ("bernoulli:0.5", "always", "real")
  c.n_predict, c.ctx_size, c.reps = 12, 48, 1
  c.measure_split = True
  for k, v in kw.items():
    setattr(c, k, v)
  return c


def test_sweep_writes_every_output(tmp_path, tiny_dir):
  records = sweep.run_sweep(_tiny_config(tiny_dir, gammas=(3,)), str(tmp_path), progress=False)
  assert len(records) == 3
  for name in ("results.jsonl", "results.csv", "config.json", "costs.json",
               "speedup.png", "verify_cost.png", "summary.md"):
    assert (tmp_path / name).stat().st_size > 0, name
  lines = (tmp_path / "results.jsonl").read_text().splitlines()
  assert len(lines) == 3
  rec = json.loads(lines[0])
  for key in ("speedup", "predicted_leviathan", "predicted_measured_cost", "efficiency",
              "alpha", "c", "verify_ratio", "baseline_tps", "spec_tps", "env",
              "draft_share", "verify_share", "rest_share", "accept_rule", "accept_rate",
              "temperature", "t_accept_s", "n_catchup", "n_kept"):
    assert key in rec, key
  assert set(rec) <= set(schema.FIELDS)  # one record schema
  assert rec["env"]["cpu"]["model"] and rec["env"]["git_commit"]
  real = [r for r in records if r["accept_rule"] == "real"]
  assert all(r["accept_rate"] == 1.0 for r in real)   # the draft is the target
  always = [r for r in records if r["accept_rule"] == "always"]
  assert all(r["mean_accepted"] == r["gamma"] for r in always)
  assert abs(sum(rec[k] for k in ("draft_share", "verify_share", "accept_share",
                                  "rest_share")) - 1) < 1e-6
  summary = (tmp_path / "summary.md").read_text()
  assert "measured-cost model" in summary and "| 3 | always |" in summary
  csv_lines = (tmp_path / "results.csv").read_text().splitlines()
  assert len(csv_lines) == 4 and csv_lines[0].split(",") == list(schema.CSV_COLUMNS)
  assert "Machine: " in summary and rec["env"]["cpu"]["model"] in summary
  # per-position alpha and the geometric check, for the random (Bernoulli, real) points
  assert "Acceptance against the i.i.d. assumption" in summary
  assert (tmp_path / "acceptance.png").stat().st_size > 0
  bern = [r for r in records if r["accept_rule"] == "bernoulli:0.5"]
  assert all(len(r["alpha_at_pos"]) == r["gamma"] for r in bern)
  assert all(abs(sum(r["geometric"]["expected"]) - 1) < 1e-9 for r in bern)


def test_resume_skips_finished_points_and_survives_a_torn_line(tmp_path, tiny_dir):
  cfg = _tiny_config(tiny_dir, accepts=("always",), measure_split=False)
  sweep.run_sweep(cfg, str(tmp_path), progress=False)
  path = tmp_path / "results.jsonl"
  first = path.read_text().splitlines()
  # Interrupted mid-write: keep one finished point plus a torn line.
  path.write_text(first[0] + "\n" + first[1][:20])
  records = sweep.run_sweep(cfg, str(tmp_path), resume=True, progress=False)
  assert len(records) == 2
  kept = [json.loads(l) for l in path.read_text().splitlines() if l.startswith("{") and l.endswith("}")]
  assert kept[0] == json.loads(first[0])  # the finished point was not redone
  assert {(r["gamma"], r["accept_rule"]) for r in records} == {(1, "always"), (3, "always")}
  with pytest.raises(SpecjaxError, match="n_predict"):
    sweep.run_sweep(_tiny_config(tiny_dir, accepts=("always",), measure_split=False,
                                 n_predict=10), str(tmp_path), resume=True, progress=False)
  # results of an older record schema are not mixed with new ones
  saved = json.loads((tmp_path / "config.json").read_text())
  (tmp_path / "config.json").write_text(json.dumps({**saved, "schema": 1}))
  with pytest.raises(SpecjaxError, match="older specjax"):
    sweep.run_sweep(cfg, str(tmp_path), resume=True, progress=False)


@pytest.mark.parametrize("field,value,match", [
    ("gammas", (0, 2), "gammas"), ("accepts", ("sometimes",), "unknown acceptance"),
    ("accepts", ("mean_length:5",), "mean_length"), ("reps", 0, "reps"),
    ("target", "no-such-model", "no-such-model"), ("drafters", ("model", "ngram", "model"),
                                                   "twice"),
    ("drafters", ("model", "ngram:3-1"), "ngram_min"), ("prompt_set", "poetry", "prompt_set")])
def test_bad_config_is_one_clear_error(tmp_path, tiny_dir, field, value, match):
  with pytest.raises(SpecjaxError, match=match):
    sweep.run_sweep(_tiny_config(tiny_dir, **{field: value}), str(tmp_path), progress=False)


def test_heldout_prompts_need_a_tokenizer(tmp_path, tiny_dir):
  with pytest.raises(SpecjaxError, match="tokenizer"):
    sweep.run_sweep(_tiny_config(tiny_dir, heldout_prompts=2), str(tmp_path), progress=False)


def test_drafters_config_on_the_shipped_target(tmp_path):
  """The drafters dimension: every drafter on the shipped target, one sweep,
  the editing prompts (the `real` rule: the pair's real acceptance)."""
  c = sweep_gamma.get_config("drafters")
  c.drafters = ("model", "ngram", "layerskip:4", "eagle")
  c.gammas, c.temps, c.heldout_prompts, c.prompt_set = (3,), (0.0,), 1, "editing"
  c.n_predict, c.reps = 12, 1
  records = sweep.run_sweep(c, str(tmp_path), progress=False)
  by = {r["drafter"]: r for r in records}
  assert sorted(by) == ["eagle", "layerskip:4", "model", "ngram:1-4"]
  for r in records:
    assert r["n_prompts"] == 1 and r["target"] == "stdlib-target"
    assert r["n_kept"] == 11 and r["prompt_set"] == "editing"
  assert by["model"]["draft"] == "stdlib-draft" and by["model"]["mean_accepted"] > 0.5
  assert by["ngram:1-4"]["draft"] is None and by["ngram:1-4"]["c"] < 0.2
  assert by["layerskip:4"]["draft"].endswith("[layerskip:4]")
  summary = (tmp_path / "summary.md").read_text()
  assert "## Drafters" in summary
  for d in by:
    assert f"| {d} | real | 0 | 3 |" in summary
  assert (tmp_path / "drafters.png").stat().st_size > 0
  saved = json.loads((tmp_path / "costs.json").read_text())
  assert sorted(saved["drafters"]) == sorted(by)


def test_points_of_one_gamma_share_the_baseline_runs_and_the_probes(tmp_path, tiny_dir,
                                                                     monkeypatch):
  """Rules at one gamma form a group: target-only runs once per repetition
  (plus one warm-up), the probes once per repetition, each point's own
  speculative run once per repetition; the group's records share baseline."""
  calls = {"base": 0, "spec": 0, "probes": 0}
  for name, obj, attr in (("base", sweep.Bench, "base"), ("spec", sweep.Bench, "spec"),
                          ("probes", sweep, "_rep_costs")):
    real = getattr(obj, attr)
    def counted(*a, _real=real, _name=name, **k):
      calls[_name] += 1
      return _real(*a, **k)
    monkeypatch.setattr(obj, attr, counted)
  cfg = _tiny_config(tiny_dir, gammas=(1, 3), accepts=("bernoulli:0.5", "always"), reps=2,
                     measure_split=False)
  records = sweep.run_sweep(cfg, str(tmp_path), progress=False)
  assert len(records) == 4
  # 2 groups x 2 reps, + 1 warm-up (one target-only program)
  assert calls["base"] == 2 * 2 + 1
  # 4 points x 2 reps, + 2 warm-ups (one program per gamma: both rules simulated)
  assert calls["spec"] == 4 * 2 + 2
  assert calls["probes"] == 2 * 2
  by_gamma = {}
  for r in records:
    by_gamma.setdefault(r["gamma"], set()).add(r["baseline_tps"])
  assert all(len(v) == 1 for v in by_gamma.values())
  with pytest.raises(ValueError, match="different groups"):
    sweep.run_group(None, [sweep.Point(1, "always", sweep.SamplingParams()),
                           sweep.Point(2, "always", sweep.SamplingParams())])
