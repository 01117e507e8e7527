"""Math word problems with known answers, generated from templates (seeded):
the development suite's math category (bench/sweep/taskbench.py, SUITE_SEED /
SUITE_N, `math_problems`) and the training prompt mix's (train/replies.py,
`training_problems`). The two use disjoint templates and closing phrases, so
no training problem shares a skeleton with the suite (issue 38; the
evaluation suite's are written by hand, docs/taskbench.md). Each problem's
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
_CLOSING = "Think step by step, then give the final answer as a number."
# The training mix's own skeletons and closing: none shares a phrase with the
# suites (tests/train/test_leaks.py checks runs of 8 tokens).
_TRAIN_TEMPLATES = (
    ("A farmer collects {a} eggs a day for {b} days and drops {c} of them. How many "
     "unbroken eggs does the farmer have?", "{a} * {b} - {c}"),
    ("Sam puts {a} dollars aside each week for {b} weeks, then spends {c} dollars on a "
     "gift. What is left of his savings?", "{a} * {b} - {c}"),
    ("A choir starts the year with {a} singers; {b} join in spring and {b} more in "
     "summer. How big is the choir by autumn?", "{a} + 2 * {b}"),
    ("Nina bakes {a} cakes using {b} grams of flour for each and still has {c} grams "
     "in the bag. How much flour did the bag hold at first?", "{a} * {b} + {c}"),
    ("A car park has {a} levels of {b} spaces, and {c} spaces are taken. How many "
     "spaces are free?", "{a} * {b} - {c}"),
    ("Two jars hold {a} and {b} buttons. Pia moves buttons until both jars hold the "
     "same amount. How many buttons end up in each jar?", "({a} + {b}) // 2"),
    ("A ferry takes {a} cars per crossing and crosses {b} times on weekdays. On Sunday "
     "it adds {c} crossings. How many cars can it take on Sunday?", "({b} + {c}) * {a}"),
    ("A packer fills {a} crates with {b} apples each and then finds {c} loose apples "
     "on the floor. How many apples are there altogether?", "{a} * {b} + {c}"),
    ("Omar has a budget of {c} coins and buys {b} lamps costing {a} coins apiece. "
     "How many coins does he keep?", "{c} - {a} * {b}"),
    ("A hiker climbs {a} metres before lunch and {b} metres after, then walks {c} "
     "metres back down. How high above the start is she?", "{a} + {b} - {c}"),
)
_TRAIN_CLOSING = "Show the working, and put the result on the last line."


def _draw(rng: random.Random, expr: str) -> tuple[dict, str, int]:
  """Numbers for one template, drawn until the answer is a whole non-negative number."""
  while True:
    v = {"a": rng.randint(3, 24), "b": rng.randint(2, 15), "c": rng.randint(2, 40)}
    if "({a} - {b}) // 2" == expr:
      v["a"] = v["b"] + 2 * rng.randint(2, 20)  # an even remainder to share
    if "({a} + {b}) // 2" == expr:
      v["a"] += (v["a"] + v["b"]) % 2  # an even total to halve
    if "{c} - {a} * {b}" == expr:
      v["c"] = v["a"] * v["b"] + rng.randint(1, 50)
    expression = expr.format(**v)
    answer = evaluate(expression)
    if answer >= 0:
      return v, expression, answer


def _problems(templates, closing: str, n: int, seed: int) -> list[dict]:
  rng = random.Random(seed)
  out = []
  for i in range(n):
    text, expr = templates[i % len(templates)]
    v, expression, answer = _draw(rng, expr)
    out.append({"messages": [{"role": "user", "content": f"{text.format(**v)} {closing}"}],
                "expression": expression, "answer": answer, "template": i % len(templates)})
  return out


def math_problems(n: int = SUITE_N, seed: int = SUITE_SEED) -> list[dict]:
  """n word problems of the development suite (seeded), each {"messages",
  "expression", "answer"}: the answer is `evaluate(expression)`, the
  expression uses the numbers in the text. The templates are cycled, the
  numbers drawn."""
  out = _problems(_TEMPLATES, _CLOSING, n, seed)
  for r in out:
    del r["template"]
  return out


def training_problems(n: int, seed: int) -> list[dict]:
  """n word problems for the training mix, as `math_problems` but from
  _TRAIN_TEMPLATES with their own closing; "template" is the skeleton's
  index (the mix's split keeps a skeleton on one side)."""
  return _problems(_TRAIN_TEMPLATES, _TRAIN_CLOSING, n, seed)
