"""Math word problems with known answers, generated from templates (seeded):
the task suite's math category (bench/sweep/taskbench.py, SUITE_SEED / SUITE_N) and
the training prompt mix's (train/replies.py, another seed). Each problem's
answer is `evaluate(expression)` of the numbers in its text."""

from __future__ import annotations

import ast
import operator
import random

from specjax.errors import ConfigError

SUITE_SEED, SUITE_N = 27, 12  # the shipped suite's math.jsonl


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


def math_problems(n: int = SUITE_N, seed: int = SUITE_SEED) -> list[dict]:
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
