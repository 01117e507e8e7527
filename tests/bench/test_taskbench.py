"""The task suite (bench/taskbench.py): its files load, every category has
10-20 conversations ending in a user turn, every math answer is right, QA
answers copy from their passage; the quick config runs end to end on tiny
models (bench/taskbench_run.py)."""

import json

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
