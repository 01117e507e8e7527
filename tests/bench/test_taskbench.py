"""The task suite (bench/taskbench.py): its files load, every category has
10-20 conversations ending in a user turn, every math answer is right, QA
answers copy from their passage; the quick config runs end to end on tiny
models (bench/taskbench_run.py)."""

import json
import statistics

import pytest

from specjax.bench import taskbench
from specjax.errors import ConfigError


@pytest.fixture(scope="module")
def suite():
  return taskbench.load_suite()


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


def test_math_file_is_the_seeded_generator_output(suite):
  assert suite["math"] == taskbench.math_problems()
  assert taskbench.math_problems(seed=1) != taskbench.math_problems()


def test_qa_answers_copy_from_the_passage(suite):
  for r in suite["qa"]:
    assert r["answer"] in r["messages"][-1]["content"].split("Question:")[0]


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
def quick_run(tmp_path_factory):
  """configs/sweep_gamma.py:taskbench_quick on the tiny pair (random weights,
  no tokenizer: every category runs the same ids), as a user would override it."""
  from configs import sweep_gamma  # pylint: disable=import-outside-toplevel
  from specjax.bench import taskbench_run  # pylint: disable=import-outside-toplevel
  c = sweep_gamma.get_config("taskbench_quick")
  c.target, c.draft, c.chat = "tiny", "tiny-draft", False
  c.prompt_tokens = "1,5,9,200,3,7,7,7,7,7,7,7,7,7,7,7"  # repeats: the n-gram drafter matches
  c.drafters = ("ngram", "model")
  c.n_predict, c.ctx_size = 16, 64
  c.taskbench = ("code_editing", "math")  # two categories: CI time (each compiles its own sweep)
  workdir = tmp_path_factory.mktemp("taskbench")
  return workdir, c, taskbench_run.run_taskbench(c, str(workdir), progress=False)


def test_quick_config_runs_every_category_and_writes_the_report(quick_run):
  from specjax.bench import taskbench_run  # pylint: disable=import-outside-toplevel
  workdir, cfg, records = quick_run
  assert {(r["category"], r["drafter"]) for r in records} == {
      (c, d) for c in cfg.taskbench for d in ("ngram:1-4", "model")}
  text = (workdir / taskbench_run.REPORT).read_text()
  table = [ln for ln in text.splitlines() if ln.startswith("| ngram") or ln.startswith("| model")]
  assert len(table) == 2 and all(ln.count("x |") == len(cfg.taskbench) + 1 for ln in table)
  assert "| Code edit | model | 0 | 4 |" in text
  assert (workdir / taskbench_run.PLOT).stat().st_size > 0
  assert len((workdir / taskbench_run.RECORDS).read_text().splitlines()) == len(records)
  assert sweep_gamma_categories() == taskbench.CATEGORIES


def sweep_gamma_categories():
  from configs import sweep_gamma  # pylint: disable=import-outside-toplevel
  return tuple(sweep_gamma.get_config("taskbench_quick").taskbench)


def test_leaderboard_takes_each_points_own_numbers(quick_run):
  """The overall column is the mean of the row's category speedups and MAT
  the mean tokens per step; a record moved to another category moves its cell."""
  from specjax.bench import taskbench_run  # pylint: disable=import-outside-toplevel
  _, _, records = quick_run
  recs = [dict(r) for r in records]
  for r in recs:
    r["speedup"] = 2.0 if r["category"] == "math" else 1.0
    r["tokens_per_step"] = 3.0
  row = next(ln for ln in taskbench_run.leaderboard(recs).splitlines() if ln.startswith("| model"))
  cells = [c.strip() for c in row.strip("|").split("|")]
  assert cells[2:] == ["1.00x", "2.00x", "3.00", "1.50x"]
  # Deliberate bug: the overall column as the best category, not the mean.
  mean = statistics.mean
  statistics.mean = max
  try:
    bad = next(ln for ln in taskbench_run.leaderboard(recs).splitlines() if ln.startswith("| model"))
  finally:
    statistics.mean = mean
  assert bad != row


def test_sweep_renders_a_category_with_the_chat_template():
  """sweep_points.sweep_prompts with config.taskbench_category: the category's
  conversations through the target's chat template (SmolLM2's tokenizer)."""
  from specjax.bench import sweep_points  # pylint: disable=import-outside-toplevel
  from specjax.errors import CheckpointError  # pylint: disable=import-outside-toplevel
  from specjax.formats import checkpoint, gguf, gguf_tokenizer  # pylint: disable=import-outside-toplevel
  try:
    path = checkpoint.packaged_path("smollm2-135m")
  except CheckpointError as e:
    pytest.skip(str(e))
  tok = gguf_tokenizer.gguf_tokenizer(gguf.open_reader(path), str(path))
  from configs import sweep_gamma  # pylint: disable=import-outside-toplevel
  c = sweep_gamma.get_config("taskbench_quick")
  c.taskbench_category = "math"
  got = sweep_points.sweep_prompts(c, tok, 49152)
  want = [tok.encode_chat(r["messages"]) for r in taskbench.load_category("math")[:2]]
  assert got == want and len(got) == c.taskbench_prompts == 2
  assert got[0].count(1) == 3  # <|im_start|> (id 1): system, user, assistant
  c.taskbench_category = "qa"  # deliberate bug: another category's prompts
  assert sweep_points.sweep_prompts(c, tok, 49152) != want
