"""The task suite: Spec-Bench-style categories of chat prompts, written here.

Spec-Bench (Xia et al. 2024) reports mean accepted tokens and speedup per task
category, because acceptance depends on the task: code editing and
question answering over a passage copy from the prompt (n-gram and
prompt-lookup drafters shine), open chat does not. This suite has the same
shape at this project's scale, in files shipped under
specjax/assets/taskbench/ and held out from every training set:

  multi_turn       a conversation of two user turns and one assistant turn
  code_completion  a function head and docstring to complete
  code_editing     code and an edit to make (the answer copies most of it)
  summarization    a passage written here to summarize in two sentences
  qa               a question on a passage; "answer" copies from it
  math             word problems made by `math_problems` (seeded), each with
                   its "expression" and integer "answer"

Each line of CATEGORY.jsonl is {"messages": [...], ...}: a conversation
ending in a user turn, rendered with the target's chat template (the
`--chat` form; add_generation_prompt). The passages and stories are
invented, so no public data set leaks into them.
"""

from __future__ import annotations

import ast
import json
import operator
import random
from pathlib import Path

from specjax import cli
from specjax.errors import ConfigError
from specjax.formats import chat as chat_lib

DIR = Path(__file__).resolve().parents[1] / "assets" / "taskbench"
CATEGORIES = ("multi_turn", "code_completion", "code_editing", "summarization", "qa", "math")
# Spec-Bench's column names for ours (the leaderboard's header).
TITLES = {"multi_turn": "Multi-turn", "code_completion": "Code compl.",
          "code_editing": "Code edit", "summarization": "Summ.", "qa": "QA", "math": "Math"}
MATH_SEED, MATH_N = 27, 12


def load_category(name: str, directory: Path = DIR) -> list[dict]:
  """The records of one category: dicts with "messages" (checked) and its
  extra fields."""
  if name not in CATEGORIES:
    raise ConfigError(f"unknown taskbench category {name!r}; valid: {', '.join(CATEGORIES)}")
  path = Path(directory) / f"{name}.jsonl"
  if not path.is_file():
    raise ConfigError(f"taskbench file {path} is missing (math: experiments/make_math_prompts.py)")
  out = []
  for i, line in enumerate(path.read_text().splitlines(), 1):
    if not line.strip():
      continue
    where = f"{path}:{i}"
    try:
      rec = json.loads(line)
    except json.JSONDecodeError as e:
      raise ConfigError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(rec, dict) or "messages" not in rec:
      raise ConfigError(f"{where}: expected an object with \"messages\"")
    rec["messages"] = chat_lib.check_messages(rec["messages"], where)
    if rec["messages"][-1]["role"] != "user":
      raise ConfigError(f"{where}: the conversation must end in a user turn")
    out.append(rec)
  return out


def load_suite(directory: Path = DIR) -> dict[str, list[dict]]:
  """Every category, in CATEGORIES order."""
  return {name: load_category(name, directory) for name in CATEGORIES}


def category_prompts(name: str, tok, vocab_size: int, n: int = 0) -> list[list[int]]:
  """The first n (0: all) conversations of a category as prompt ids, rendered
  with the target's chat template (a target without one is refused)."""
  recs = load_category(name)
  recs = recs[:n] if n else recs
  return [cli.check_ids(cli.chat_ids(tok, r["messages"], f"taskbench {name}"), vocab_size)
          for r in recs]


# ------------------------------------------------------------ math problems

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.FloorDiv: operator.floordiv}


def evaluate(expression: str) -> int:
  """An integer expression of + - * // and parentheses (nothing else)."""
  def ev(node):
    if isinstance(node, ast.Expression):
      return ev(node.body)
    if isinstance(node, ast.Constant) and type(node.value) is int:
      return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
      return _OPS[type(node.op)](ev(node.left), ev(node.right))
    raise ConfigError(f"math expression {expression!r}: only integers and + - * // allowed")
  return ev(ast.parse(expression, mode="eval"))


# (text with {a}, {b}, {c}, expression over a, b, c); numbers drawn so the
# answer is a whole non-negative number.
_TEMPLATES = (
    ("A baker makes {a} trays of rolls with {b} rolls on each tray and sells {c} rolls. "
     "How many rolls are left?", "{a} * {b} - {c}"),
    ("A train has {a} carriages. Each carriage has {b} seats, and {c} seats are empty. "
     "How many passengers are seated?", "{a} * {b} - {c}"),
    ("Lena reads {a} pages on Monday, {b} pages on Tuesday and twice as many as on Tuesday "
     "on Wednesday. How many pages does she read in the three days?", "{a} + {b} + 2 * {b}"),
    ("A garden has {a} rows of {b} tulips. A storm breaks {c} tulips, and the gardener "
     "plants {b} new ones. How many tulips are there now?", "{a} * {b} - {c} + {b}"),
    ("Tom has {a} marbles. He gives {b} to his sister and then shares the rest equally "
     "with his friend, keeping half. How many marbles does Tom keep?", "({a} - {b}) // 2"),
    ("A shop sells pens at {a} cents each. Maya buys {b} pens and pays with {c} cents. "
     "How much change does she get, in cents?", "{c} - {a} * {b}"),
    ("A library has {a} shelves with {b} books each. It lends out {c} books. How many "
     "books remain on the shelves?", "{a} * {b} - {c}"),
    ("A cyclist rides {a} kilometres a day for {b} days, then {c} kilometres on the last "
     "day. How far does she ride in total?", "{a} * {b} + {c}"),
)


def math_problems(n: int = MATH_N, seed: int = MATH_SEED) -> list[dict]:
  """n word problems (seeded), each {"messages", "expression", "answer"}:
  the answer is `evaluate(expression)`, the expression uses the numbers in
  the text. The templates are cycled, the numbers drawn."""
  rng = random.Random(seed)
  out = []
  for i in range(n):
    text, expr = _TEMPLATES[i % len(_TEMPLATES)]
    while True:
      v = {"a": rng.randint(3, 24), "b": rng.randint(2, 15), "c": rng.randint(2, 40)}
      if "({a} - {b}) // 2" == expr:
        v["a"] = v["b"] + 2 * rng.randint(2, 20)  # an even remainder to share
      if "{c} - {a} * {b}" == expr:
        v["c"] = v["a"] * v["b"] + rng.randint(1, 50)
      expression = expr.format(**v)
      answer = evaluate(expression)
      if answer >= 0:
        break
    prompt = text.format(**v) + " Think step by step, then give the final answer as a number."
    out.append({"messages": [{"role": "user", "content": prompt}],
                "expression": expression, "answer": answer})
  return out


def write_math(directory: Path = DIR, n: int = MATH_N, seed: int = MATH_SEED) -> Path:
  """Writes math.jsonl (experiments/make_math_prompts.py)."""
  path = Path(directory) / "math.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in math_problems(n, seed)))
  return path
