"""The task suite (bench/sweep/taskbench.py): its files load, every category has
10-20 conversations ending in a user turn, every math answer is right, QA
answers copy from their passage; the quick config runs end to end on tiny
models (bench/sweep/taskbench_run.py), its token-tree rows (an EAGLE head's
dynamic tree through the trees sweep) included; the report's goals come
from the records."""

import json
import statistics

import pytest

import lawcheck
from configs import sweep_gamma
from specjax.bench.sweep import config as sweep_config
from specjax.bench.sweep import taskbench, taskbench_report, taskbench_run
from specjax.bench.sweep.config import SweepConfig
from specjax.errors import ConfigError


def quick(**kw) -> SweepConfig:
  """configs/sweep_gamma.py:taskbench_quick, typed, with `kw` replaced."""
  return SweepConfig.from_mapping(sweep_gamma.get_config("taskbench_quick")).replace(**kw)


@pytest.fixture(scope="module", params=sorted(taskbench.SUITES))
def suite(request):
  """Each suite: the development one and the evaluation one (taskbench.SUITES)."""
  return taskbench.load_suite(taskbench.SUITES[request.param])


def test_every_category_loads_with_10_to_20_prompts(suite):
  assert tuple(suite) == taskbench.CATEGORIES
  for name, recs in suite.items():
    assert 10 <= len(recs) <= 20, name
    for r in recs:
      assert r["messages"][-1]["role"] == "user" and r["messages"][-1]["content"].strip()
  assert all(len(r["messages"]) == 3 for r in suite["multi_turn"])
  texts = [r["messages"][-1]["content"] for recs in suite.values() for r in recs]
  assert len(set(texts)) == len(texts)  # no prompt twice


def _math_ok(rec) -> bool:
  """The stated answer is the expression's value, and every number of the
  expression is in the problem's text."""
  text = rec["messages"][-1]["content"]
  numbers = [t for t in rec["expression"].replace("(", " ").replace(")", " ").split()
             if t.isdigit() and t != "2"]
  return (taskbench.evaluate(rec["expression"]) == rec["answer"]
          and all(f" {n} " in f" {text} " for n in numbers))


def test_every_math_answer_is_correct(suite):
  assert all(_math_ok(r) for r in suite["math"])
  # Deliberate bugs: an answer off by one, a number not in the text.
  r = dict(suite["math"][0])
  assert not _math_ok(dict(r, answer=r["answer"] + 1))
  assert not _math_ok(dict(r, expression=r["expression"].replace(" - ", " - 1")))


def test_math_file_is_the_seeded_generator_output():
  dev = taskbench.load_suite()
  assert dev["math"] == taskbench.math_problems()
  assert taskbench.math_problems(seed=1) != taskbench.math_problems()


def test_qa_answers_copy_from_the_passage(suite):
  for r in suite["qa"]:
    assert r["answer"] in r["messages"][-1]["content"].split("Question:")[0]


def test_the_evaluation_suite_is_new():
  """No conversation, instruction line or math skeleton of the evaluation
  suite is the development suite's (its phrasing: tests/train/test_leaks.py)."""
  dev, new = (taskbench.load_suite(taskbench.SUITES[n]) for n in ("dev", "eval"))
  lines = lambda s: {m["content"].split("\n")[0] for recs in s.values() for r in recs
                     for m in r["messages"]}
  assert not lines(dev) & lines(new)
  skeleton = lambda s: {"".join(c for c in r["messages"][0]["content"] if not c.isdigit())
                        for r in s["math"]}
  assert not skeleton(dev) & skeleton(new) and len(skeleton(new)) == len(new["math"])


def test_evaluate_refuses_anything_but_arithmetic():
  assert taskbench.evaluate("(7 - 3) // 2 + 2 * 5") == 12
  with pytest.raises(ConfigError, match="only integers"):
    taskbench.evaluate("__import__('os')")


def test_bad_files_are_one_clear_error(tmp_path):
  with pytest.raises(ConfigError, match="unknown taskbench category"):
    taskbench.load_category("translation")
  with pytest.raises(ConfigError, match="is missing"):
    taskbench.load_category("qa", tmp_path)
  (tmp_path / "qa.jsonl").write_text(json.dumps({"messages": [
      {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}) + "\n")
  with pytest.raises(ConfigError, match="end in a user turn"):
    taskbench.load_category("qa", tmp_path)


# ------------------------------------------------------------ the quick config, end to end


@pytest.fixture(scope="module")
def tiny_head(tmp_path_factory):
  """A random EAGLE head for the tiny target (it drafts badly; the runs only
  need its shapes)."""
  from specjax.drafters import eagle  # pylint: disable=import-outside-toplevel
  from specjax.model import config  # pylint: disable=import-outside-toplevel
  cfg = config.get_preset("tiny")
  hcfg = eagle.head_config(cfg)
  return str(eagle.save_head(tmp_path_factory.mktemp("head") / "tiny-eagle", hcfg,
                             eagle.init_head(hcfg), cfg, "tiny"))


TREE = "dynamic:2,2,3"


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory, tiny_head):
  """configs/sweep_gamma.py:taskbench_quick on the tiny pair (random weights,
  no tokenizer: every category runs the same ids), as a user would override it,
  with one EAGLE dynamic-tree row (a random head for the tiny target)."""
  assert len(quick().taskbench_trees) == 1 and "@dynamic:" in quick().taskbench_trees[0]
  c = quick(target="tiny", draft="tiny-draft", chat=False,
            prompt_tokens="1,5,9,200,3,7,7,7,7,7,7,7,7,7,7,7",  # repeats: n-gram matches
            drafters=("ngram", "model"), taskbench_trees=(f"eagle:{tiny_head}@{TREE}",),
            n_predict=16, ctx_size=64,
            taskbench=("code_editing", "math"))  # two categories: CI time
  workdir = tmp_path_factory.mktemp("taskbench")
  return workdir, c, taskbench_run.run_taskbench(c, str(workdir), progress=False)


def test_quick_config_runs_every_category_and_writes_the_report(quick_run, tiny_head):
  workdir, cfg, records = quick_run
  tree_row = f"eagle:{tiny_head} {TREE}"
  assert {(r["category"], r["drafter"]) for r in records} == {
      (c, d) for c in cfg.taskbench for d in ("ngram:1-4", "model", tree_row)}
  text = (workdir / taskbench_report.REPORT).read_text()
  table = [ln for ln in text.splitlines() if ln.startswith("| ngram") or ln.startswith("| model")
           or ln.startswith("| eagle")]
  assert len(table) == 3 and all(ln.count("x |") == len(cfg.taskbench) + 1 for ln in table)
  assert "| Code edit | model | 0 | 4 |" in text
  # the tree row: its tree in the gamma column, the trees sweep's prediction, no Leviathan
  row = next(ln for ln in text.splitlines() if ln.startswith(f"| Code edit | {tree_row} | 0 |"))
  cells = [c.strip() for c in row.strip("|").split("|")]
  assert cells[3] == TREE and cells[-2].endswith("x") and cells[-1] == "n/a"
  assert text.startswith("# Task suite") and "EAGLE 3.61, EAGLE-2 4.36" in text
  assert "## Goals" in text and f"{tree_row}, T=0: MAT" in text
  assert (workdir / taskbench_report.PLOT).stat().st_size > 0
  assert len((workdir / taskbench_report.RECORDS).read_text().splitlines()) == len(records)
  assert sweep_gamma_categories() == taskbench.CATEGORIES
  for cat in cfg.taskbench:  # each drafter's trees sweep in its own subdirectory
    assert (workdir / cat / taskbench_run.tree_dir(f"eagle:{tiny_head}") / "results.jsonl").is_file()
  tree = next(r for r in records if r["drafter"] == tree_row)
  assert tree["tree"] == TREE and tree["gamma"] == 2 and tree["tree_nodes"] == 3
  assert tree["t_draft_s"] > 0 and tree["predicted_step_s"] == pytest.approx(
      tree["t_draft_s"] + tree["t_verify_s"] + tree["t_accept_s"])
  assert tree["predicted_measured_cost"] == pytest.approx(
      tree["tokens_per_step"] * tree["t_target_s"] / tree["predicted_step_s"])


def test_resume_runs_nothing_again(quick_run, monkeypatch):
  """A resumed run finds every point (chains and trees) finished: nothing is
  measured, and the records are the same; a rerun without --resume is
  refused before anything is written."""
  from specjax.bench.sweep import gamma, trees  # pylint: disable=import-outside-toplevel
  from specjax.errors import OutputError  # pylint: disable=import-outside-toplevel
  workdir, cfg, records = quick_run
  def boom(*a, **k):
    raise AssertionError("a finished point ran again")
  monkeypatch.setattr(gamma, "run_group", boom)
  monkeypatch.setattr(trees, "run_point", boom)
  again = taskbench_run.run_taskbench(cfg, str(workdir), resume=True, progress=False)
  key = lambda r: (r["category"], r["drafter"], r["gamma"], r["speedup"])
  assert sorted(map(key, again)) == sorted(map(key, records))
  report = (workdir / taskbench_report.REPORT).read_bytes()
  with pytest.raises(OutputError, match="holds"):
    taskbench_run.run_taskbench(cfg, str(workdir), progress=False)
  assert (workdir / taskbench_report.REPORT).read_bytes() == report


def test_tree_rows_are_checked():
  c = SweepConfig.from_mapping(sweep_gamma.get_config("taskbench"))
  assert sweep_config.tree_rows(c) == [("eagle:smollm2-eagle", "dynamic:4,4,16"),
                                       ("eagle:smollm2-eagle", "dynamic:10,6,60"),
                                       ("eagle:smollm2-eagle", "dynamic:10,6,60+ngram:8")]
  assert c.draft == "smollm2-draft" and "model" in c.drafters and "eagle:smollm2-eagle" in c.drafters
  for bad, msg in (("dynamic:2,2,3", "not DRAFTER@TREE"), ("eagle@auto:x", "expected auto"),
                   ("eagle@dynamic:2,2,30", "more nodes"), ("bogus@chain:2", "unknown drafter")):
    with pytest.raises(ConfigError, match=msg):
      c.replace(taskbench_trees=(bad,))


APART_ROWS = ("eagle:/heads/a_b@dynamic:2,2,3", "eagle:/heads/a/b@dynamic:2,2,3",
              "ngram@dynamic:2,2,3")


def apart_mismatches(taskbench_run) -> list[str]:
  """Three tree rows whose drafters sanitise alike or draft nothing
  (APART_ROWS), planned by taskbench_run.sweeps, each sweep's rows taken
  from records of every drafter (as a shared or stale directory would hold
  them): each drafter's sweep must get a directory of its own and each row
  only its own drafter's records."""
  c = quick(drafters=(), taskbench=("math",), taskbench_trees=APART_ROWS)
  plan = taskbench_run.sweeps(c, "/w")
  everyone = [dict(drafter=d, tree=t, origin=d) for d, t in sweep_config.tree_rows(c)]
  records = [r for s in plan for r in s.rows(everyone)]
  bad = []
  if len({s.workdir for s in plan}) != 3:
    bad.append(f"shared directories {[s.workdir for s in plan]}")
  if sorted(r["origin"] for r in records) != ["eagle:/heads/a/b", "eagle:/heads/a_b", "ngram:1-4"]:
    bad.append(f"records {[(r['tree_drafter'], r['origin']) for r in records]}")
  bad += [f"{r['tree_drafter']} took {r['origin']}'s record" for r in records
          if r["origin"] != r["tree_drafter"]]
  return bad


def test_tree_rows_keep_each_drafter_apart():
  """Two drafter specs that sanitise to one name get two directories, a
  tree sweep's records are taken by drafter as well as tree, and an n-gram
  dynamic-tree row is accepted by the checks (the trees sweep skips it with
  one line: tests/bench/test_tree_sweep.py)."""
  from specjax.bench.sweep import trees  # pylint: disable=import-outside-toplevel
  a, b = taskbench_run.tree_dir("eagle:/heads/a_b"), taskbench_run.tree_dir("eagle:/heads/a/b")
  assert a != b and a.startswith("trees-eagle_heads_a_b-") and b.startswith("trees-eagle_heads_a_b-")
  assert taskbench_run.tree_dir("ngram:1-4") == taskbench_run.tree_dir("ngram:1-4")
  c = quick(taskbench_trees=APART_ROWS)
  assert sweep_config.tree_rows(c)[-1] == ("ngram:1-4", "dynamic:2,2,3")
  trees.RUNNER.check(taskbench_run.tree_config(c, "math", "ngram:1-4", ["dynamic:2,2,3"]))
  assert apart_mismatches(taskbench_run) == []


APART_MUTATIONS = {
    "tree_dir without the spec's hash": (taskbench_run, "tree_dir", ' + "-" + digest', ""),
    "a trees sweep's records taken by tree only": (
        taskbench_run.Sweep, "rows", ' and r.get("drafter") == self.drafter', ""),
}


@pytest.mark.parametrize("bug", list(APART_MUTATIONS))
def test_each_deliberate_apart_bug_fails(bug, monkeypatch):
  owner, name, old, new = APART_MUTATIONS[bug]
  monkeypatch.setattr(owner, name, lawcheck.mutant(getattr(owner, name), old, new))
  bad = apart_mismatches(taskbench_run)
  print(f"MUTATION | {bug} | {bad[:2]}")
  assert bad, f"{bug}: not caught"


def sweep_gamma_categories():
  return quick().taskbench


def test_leaderboard_takes_each_points_own_numbers(quick_run):
  """The overall column is the mean of the row's category speedups and MAT
  the mean tokens per step; a record moved to another category moves its cell."""
  _, _, records = quick_run
  recs = [dict(r) for r in records]
  for r in recs:
    r["speedup"] = 2.0 if r["category"] == "math" else 1.0
    r["tokens_per_step"] = 3.0
  row = next(ln for ln in taskbench_report.leaderboard(recs).splitlines() if ln.startswith("| model"))
  cells = [c.strip() for c in row.strip("|").split("|")]
  assert cells[2:] == ["1.00x", "2.00x", "3.00", "1.50x"]
  # Deliberate bug: the overall column as the best category, not the mean.
  mean = statistics.mean
  statistics.mean = max
  try:
    bad = next(ln for ln in taskbench_report.leaderboard(recs).splitlines() if ln.startswith("| model"))
  finally:
    statistics.mean = mean
  assert bad != row


def test_sweep_renders_a_category_with_the_chat_template():
  """prompts.sweep_prompts with config.taskbench_category: the category's
  conversations through the target's chat template (SmolLM2's tokenizer)."""
  from specjax.bench.sweep import prompts  # pylint: disable=import-outside-toplevel
  from specjax.errors import CheckpointError  # pylint: disable=import-outside-toplevel
  from specjax.formats import checkpoint, gguf, gguf_tokenizer  # pylint: disable=import-outside-toplevel
  try:
    path = checkpoint.packaged_path("smollm2-135m")
  except CheckpointError as e:
    pytest.skip(str(e))
  tok = gguf_tokenizer.gguf_tokenizer(gguf.open_reader(path), str(path))
  c = quick(taskbench_category="math")
  got = prompts.sweep_prompts(c, tok, 49152)
  want = [tok.encode_chat(r["messages"]) for r in taskbench.load_category("math")[:2]]
  assert got == want and len(got) == c.taskbench_prompts == 2
  assert got[0].count(1) == 3  # <|im_start|> (id 1): system, user, assistant
  # deliberate bug: another category's prompts
  assert prompts.sweep_prompts(c.replace(taskbench_category="qa"), tok, 49152) != want
  # the evaluation suite, by config.taskbench_suite; an unknown suite is one line
  got = prompts.sweep_prompts(c.replace(taskbench_suite="eval"), tok, 49152)
  assert got == [tok.encode_chat(r["messages"]) for r in
                 taskbench.load_category("math", taskbench.SUITES["eval"])[:2]] and got != want
  with pytest.raises(ConfigError, match="config.taskbench_suite must be one of dev, eval"):
    quick(taskbench_suite="fresh")


# ------------------------------------------------------------ the goals, from records


def _rec(cat, drafter, temp, speedup, mat, pred, **kw):
  return dict(dict(category=cat, drafter=drafter, temperature=temp, speedup=speedup,
                   tokens_per_step=mat, predicted_measured_cost=pred, accept_rule="real",
                   gamma=4, t_target_s=0.01, predicted_step_s=0.02, t_verify_s=0.012), **kw)


DYN = dict(tree="dynamic:4,4,16", tree_drafter="eagle:smollm2-eagle", gamma=4)
LABEL = "eagle:smollm2-eagle dynamic:4,4,16"


def _goal_records():
  return [
      _rec("code_editing", LABEL, 0.0, 1.5, 3.4, 1.45, **DYN),
      _rec("math", LABEL, 0.0, 0.9, 2.0, 1.2, **DYN),          # 25 % off its prediction
      _rec("math", LABEL, 1.0, 1.3, 5.0, 1.3, **DYN),          # T=1: not in the T=0 goals
      _rec("code_editing", "ngram:1-4", 0.0, 1.2, 2.6, 1.25),
      _rec("math", "ngram:1-4", 0.0, 0.8, 1.1, 0.7),            # 14 % above its prediction
      _rec("math", "ngram:1-4", 0.0, 0.6, 1.1, 0.6, accept_rule="bernoulli:0.8"),  # not real
  ]


def _check_goals(g) -> list[str]:
  """What the hand-made records imply; the names of the checks that fail."""
  bad = []
  e = g["eagle_dynamic"]
  if not (len(e) == 1 and e[0]["drafter"] == LABEL and e[0]["code_editing"] == 3.4
          and abs(e[0]["mean"] - 2.7) < 1e-9 and e[0]["n_categories"] == 2
          and e[0]["code_editing_ok"] and e[0]["mean_ok"]):
    bad.append(f"eagle dynamic {e}")
  eff = g["efficiency"]
  outside = sorted((o["category"], o["drafter"], o["temperature"]) for o in eff["outside"])
  if (eff["n"], eff["within"]) != (5, 3) or outside != [("math", LABEL, 0.0),
                                                        ("math", "ngram:1-4", 0.0)]:
    bad.append(f"efficiency {eff}")
  beats = {b["category"]: (b["drafter"], b["beats"], b["step_over_t1"]) for b in g["beats_target"]}
  if beats != {"code_editing": (LABEL, True, 2.0), "math": (LABEL, False, 2.0)}:
    bad.append(f"beats {beats}")
  return bad


def test_goals_come_from_the_records():
  g = taskbench_report.goals(_goal_records())
  assert _check_goals(g) == []
  text = "\n".join(taskbench_report.goals_lines(g))
  assert "MAT 3.40 on code editing (goal >= 3: met), 2.70 averaged over 2 categories" in text
  assert "3 of 5 points" in text and "| Math | ngram:1-4 | 0 | 4 | 0.80x | 0.70x | 1.14 |" in text
  assert "| Math | eagle:smollm2-eagle dynamic:4,4,16 | 0.90x | no | 2.00 | 2.00 | 1.20 |" in text
  # an EAGLE dynamic tree short of its goals says so
  low = [dict(r, tokens_per_step=2.0) if r["drafter"] == LABEL else r for r in _goal_records()]
  assert "NOT met" in "\n".join(taskbench_report.goals_lines(taskbench_report.goals(low)))
  # a run with T=1 rows only: one line, not an empty table
  t1 = "\n".join(taskbench_report.goals_lines(taskbench_report.goals(
      [r for r in _goal_records() if r["temperature"] == 1.0])))
  assert "against target-only: no T=0 rows in this run." in t1 and "| Category |" not in t1


GOAL_MUTATIONS = {
    "efficiency counts only points below their prediction (no abs)": (
        "abs(ratio - 1.0) > GOAL_EFFICIENCY", "1.0 - ratio > GOAL_EFFICIENCY"),
    "the EAGLE dynamic MAT averages every temperature": (
        "k[1:] == (label, 0.0)}", "k[1] == label}"),
    "the best drafter per category is taken at any temperature": (
        "k[0] == c and k[2] == 0.0]", "k[0] == c]"),
}


@pytest.mark.parametrize("bug", list(GOAL_MUTATIONS))
def test_each_deliberate_goals_bug_fails(bug):
  bugged = lawcheck.mutant(taskbench_report.goals, *GOAL_MUTATIONS[bug])
  bad = _check_goals(bugged(_goal_records()))
  print(f"MUTATION | {bug} | {bad[:2]}")
  assert bad, f"{bug}: not caught"


def test_gpu_part_leaves_out_missing_drafts(tmp_path, tiny_head):
  """gpu_study.taskbench_available: a drafter or tree row whose trained
  draft is missing is left out with one line; the others stay."""
  from specjax.bench.studies import gpu_study  # pylint: disable=import-outside-toplevel
  gone = str(tmp_path / "no-head")
  c = quick(drafters=("ngram", f"eagle:{gone}", f"eagle:{tiny_head}"),
            taskbench_trees=(f"eagle:{gone}@dynamic:2,2,3", f"eagle:{tiny_head}@dynamic:2,2,3"))
  sub, dropped = gpu_study.taskbench_available(c)
  assert sub.drafters == ("ngram", f"eagle:{tiny_head}")
  assert sub.taskbench_trees == (f"eagle:{tiny_head}@dynamic:2,2,3",)
  assert len(dropped) == 1 and dropped[0].startswith(f"eagle:{gone}: left out (")


def _parts_without_guard(parts, skip, lines, summary, machine):
  """gpu_study.run_parts as first written: no guard, no rewrite per part."""
  lines = list(lines)
  for name, part in parts:
    if name not in skip:
      lines += part()
  with open(summary, "w") as f:
    f.write("\n".join(lines + [machine]) + "\n")
  return "\n".join(lines)


def _check_parts(run_parts, tmp_path):
  """A part that raises is one FAILED line in the summary and the parts after
  it still run (a device lease has no time for a second try); the summary on
  disk holds every finished part before the next one starts."""
  summary = tmp_path / "gpu_summary.md"
  seen = []

  def boom():
    seen.append(summary.read_text() if summary.exists() else "")
    raise RuntimeError("no such jax API\nsecond line")

  parts = [("first", lambda: ["## first", "ok"]), ("broken", boom),
           ("last", lambda: ["## last", "ok"]), ("skipped", lambda: ["## skipped"])]
  text = run_parts(parts, {"skipped"}, ["# GPU check"], str(summary), "Machine: test.")
  assert "## first" in seen[0]  # written before the broken part ran
  assert "FAILED: RuntimeError: no such jax API" in text and "second line" not in text
  assert "## last" in text and "## skipped" not in text
  assert summary.read_text() == text and "Machine: test. Total" in text


def test_gpu_parts_a_failing_part_is_one_line(tmp_path):
  from specjax.bench.studies import gpu_study  # pylint: disable=import-outside-toplevel
  _check_parts(gpu_study.run_parts, tmp_path)


def test_gpu_parts_check_fails_the_unguarded_loop(tmp_path):
  """The loop as first written (no guard, one write at the end), committed as
  the broken variant: the check above fails on it."""
  with pytest.raises(RuntimeError, match="no such jax API"):
    _check_parts(_parts_without_guard, tmp_path)


# ------------------------------------------------------------ mixed batches, per-row lengths


def mixed_quick(**kw) -> SweepConfig:
  """configs/sweep_gamma.py:taskbench_mixed_quick, typed, with `kw` replaced."""
  return SweepConfig.from_mapping(sweep_gamma.get_config("taskbench_mixed_quick")).replace(**kw)


@pytest.fixture(scope="module")
def mixed_run(tmp_path_factory):
  """configs/sweep_gamma.py:taskbench_mixed_quick as shipped: the tiny pair, the mixed
  category at batch 2: gamma 1, per-row lengths at budget auto and N = 3."""
  c = mixed_quick()
  workdir = tmp_path_factory.mktemp("mixed")
  return workdir, c, taskbench_run.run_taskbench(c, str(workdir), progress=False)


ROWS_AUTO, ROWS_3 = "auto:rows,max=1,budget=auto", "auto:rows,max=1,budget=3"


def test_mixed_quick_runs_per_row_points_with_their_theory(mixed_run):
  workdir, cfg, records = mixed_run
  assert sorted(str(r["gamma"]) for r in records) == sorted(["1", ROWS_AUTO, ROWS_3])
  assert all(r["category"] == "mixed" and r["batch"] == 2 for r in records)
  assert all(r["row_categories"] == list(taskbench.CATEGORIES[:2]) for r in records)
  by = {str(r["gamma"]): r for r in records}
  for spec in (ROWS_AUTO, ROWS_3):
    r = by[spec]
    th = r["rows_theory"]
    assert r["gamma_max"] == 1 and r["speedup"] > 0 and th["steps"] == r["loop_steps"]
    assert len(th["alpha"]) == len(r["row_given"]) == len(r["row_proposed"]) == 2
    assert all(0 <= g <= 1 for g in r["row_given"]) and th["measured"] >= th["rows"] > 0
    assert min(th["predicted"], th["oracle"], th["uniform"]) >= th["rows"]
  fixed, auto = by[ROWS_3], by[ROWS_AUTO]
  assert fixed["budget"] == 3 and fixed["rows_theory"]["drafts"] <= 3 - 2
  assert fixed["t_packed_s"] > 0 and fixed["predicted_step_s"] == pytest.approx(
      fixed["t_draft_s"] + fixed["t_packed_s"] + fixed["t_accept_s"])
  assert fixed["predicted_measured_cost"] == pytest.approx(
      fixed["n_kept"] / (fixed["loop_steps"] * 2) * fixed["t_target_s"]
      / fixed["predicted_step_s"])
  assert set(fixed["predicted_rows"]) == {"predicted", "oracle", "uniform"}
  assert auto["budget"] == "auto"
  assert sorted(auto["rows_step_s"], key=int) == ["2", "3", "4"]  # candidate_budgets(2, 1)
  assert sum(auto["budgets_used"].values()) == auto["loop_steps"]
  # budget=auto's prediction: each step at its budget's calibrated T(N), against
  # target-only's seconds a token
  spent = sum(n * auto["rows_step_s"][b] for b, n in auto["budgets_used"].items())
  assert auto["predicted_step_s"] == pytest.approx(spent / auto["loop_steps"])
  assert auto["predicted_measured_cost"] == pytest.approx(
      auto["n_kept"] / spent / auto["baseline_tps"])
  assert set(auto["predicted_rows"]) == {"predicted", "oracle", "uniform"}
  text = (workdir / taskbench_report.REPORT).read_text()
  assert "## Mixed batches" in text and "Per-row lengths on the mixed batches" in text
  line = next(ln for ln in text.splitlines() if ln.startswith("| ngram:1-4 | 2 | real | 0 | multi"))
  assert f"| {by['1']['speedup']:.2f}x (1) | - | " in line  # no auto gamma in the quick config
  summary = (workdir / "mixed" / "summary.md").read_text()
  assert "### Per-row lengths against the best fixed gamma and auto" in summary
  assert "| per-row, budget 3 (N 3.0) |" in summary


def resume_todo(mixed_run, tmp_path, row_budgets) -> list:
  """The points a resume of a copy of the finished mixed workdir would run
  (harness.prepare: nothing measured), its N = 3 record deleted, with
  `row_budgets` in place of the config's."""
  import shutil  # pylint: disable=import-outside-toplevel
  from specjax.bench.sweep import harness  # pylint: disable=import-outside-toplevel
  workdir, cfg, _ = mixed_run
  copy = tmp_path / "w"
  shutil.copytree(workdir, copy)
  results = copy / "mixed" / "results.jsonl"
  lines = results.read_text().splitlines()
  results.write_text("".join(ln + "\n" for ln in lines if ROWS_3 not in ln))
  cfg = cfg.replace(row_budgets=row_budgets)
  return [p.gamma for s in taskbench_run.sweeps(cfg, str(copy))
          for p in harness.prepare(s.runner, s.cfg, s.workdir, resume=True).todo]


def check_resume(mixed_run, tmp_path) -> None:
  """A resume runs the deleted N = 3 point and a new budget's (N = 4, the
  row_budgets changed), not the finished budget=auto point; AssertionError
  (or the resume refused) otherwise."""
  todo = resume_todo(mixed_run, tmp_path, ("auto", "3", "4"))
  assert todo == [ROWS_3, "auto:rows,max=1,budget=4"], todo


def test_resume_skips_done_per_row_points_and_tells_budgets_apart(mixed_run, tmp_path):
  check_resume(mixed_run, tmp_path)


@pytest.mark.parametrize("bug", ["the budget dropped from the resume key",
                                 "row_budgets not a setting that only adds points"])
def test_each_deliberate_resume_bug_fails(bug, mixed_run, tmp_path, monkeypatch):
  from specjax.bench.sweep import outputs, points  # pylint: disable=import-outside-toplevel
  if bug.startswith("the budget"):
    monkeypatch.setattr(points, "gamma_key", lawcheck.mutant(
        points.gamma_key, "return g if", "return g.split(',budget=')[0] if"))
  else:
    monkeypatch.setattr(outputs, "POINT_FIELDS",
                        tuple(f for f in outputs.POINT_FIELDS if f != "row_budgets"))
  with pytest.raises((AssertionError, ConfigError)) as e:
    check_resume(mixed_run, tmp_path)
  print(f"MUTATION | {bug} | {str(e.value)[:80]}")


def mixed_rows_categories(tok, batch: int) -> list[str]:
  """The categories of the rows of the mixed category's batch of `batch`
  (prompts.sweep_prompts, points.batch_prompts), each row checked to be its
  category's conversation through the chat template; AssertionError otherwise."""
  from specjax.bench.sweep import points, prompts  # pylint: disable=import-outside-toplevel
  c = quick(taskbench_category="mixed", taskbench_prompts=2)
  got = prompts.sweep_prompts(c, tok, 49152)
  rows, = points.batch_prompts(got, batch)
  cats = taskbench_run.row_categories({"n_prompts": len(got), "batch": batch})
  for row, cat in zip(rows, cats):  # rows past the prompts are cut short (batch_prompts)
    first = [tok.encode_chat(r["messages"]) for r in taskbench.load_category(cat)[:2]]
    assert any(p[:len(row)] == row for p in first), f"a row of {cat} is not one of its conversations"
  return cats


def test_mixed_batches_draw_rows_from_several_categories(monkeypatch):
  """The mixed category's batches of 4, 8 and 16 rows hold rows of 4, 6 and 6
  categories (SmolLM2's tokenizer); a deliberate bug (the categories one
  after another, not in turn) leaves a batch of 4 with one."""
  from specjax.errors import CheckpointError  # pylint: disable=import-outside-toplevel
  from specjax.formats import checkpoint, gguf, gguf_tokenizer  # pylint: disable=import-outside-toplevel
  try:
    path = checkpoint.packaged_path("smollm2-135m")
  except CheckpointError as e:
    pytest.skip(str(e))
  tok = gguf_tokenizer.gguf_tokenizer(gguf.open_reader(path), str(path))
  assert [len(set(mixed_rows_categories(tok, b))) for b in (4, 8, 16)] == [4, 6, 6]
  monkeypatch.setattr(taskbench, "mixed_prompts", lambda tok, v, n, suite: [
      p for c in taskbench.CATEGORIES for p in taskbench.category_prompts(c, tok, v, n, suite)])
  with pytest.raises(AssertionError, match="not one of its conversations"):
    mixed_rows_categories(tok, 4)
