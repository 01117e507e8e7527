"""The task suite: Spec-Bench-style categories of chat prompts, written here.

Acceptance depends on the task (code editing and QA copy from the prompt,
open chat does not), so Spec-Bench (Xia et al. 2024) reports MAT and speedup
per category; this suite has its shape at this project's scale: multi_turn,
code_completion, code_editing, summarization, qa and math (each with its
expression and integer answer). Two suites (SUITES): "dev", shipped in
specjax/assets/taskbench/ (math from `math_problems`, seeded), which the
training data was designed against, and "eval", in taskbench_eval/, written
by hand before the next drafts were trained and never used to design their
data; and "long" (LONG, longsuite.py), summarization and qa over 1 K-8 K
token documents built from the stdlib. Each line of CATEGORY.jsonl is {"messages": [...], ...}, a
conversation ending in a user turn, rendered with the target's chat
template. The passages are invented. MIXED (`mixed_prompts`): batches whose
rows come from different categories. docs/taskbench.md.
"""

from __future__ import annotations

import json
from pathlib import Path

from specjax import cli
from specjax.bench.sweep import longsuite
from specjax.errors import ConfigError
from specjax.formats import chat as chat_lib
from specjax.train import mathgen

DIR = Path(__file__).resolve().parents[2] / "assets" / "taskbench"
# The suites by name (SweepConfig.taskbench_suite): development and evaluation.
SUITES = {"dev": DIR, "eval": DIR.parent / "taskbench_eval"}
# The long-context suite (longsuite.py): summarization and qa over stdlib reference pages of
# 1 K-8 K tokens; apart from SUITES, whose suites hold every category.
LONG = "long"
CATEGORIES = ("multi_turn", "code_completion", "code_editing", "summarization", "qa", "math")
# Mixed batches: the categories' conversations in turn, so a batch's rows come from several.
MIXED = "mixed"
# Spec-Bench's column names for ours (the leaderboard's header).
TITLES = {"multi_turn": "Multi-turn", "code_completion": "Code compl.",
          "code_editing": "Code edit", "summarization": "Summ.", "qa": "QA", "math": "Math",
          MIXED: "Mixed"}
MATH_SEED, MATH_N = mathgen.SUITE_SEED, mathgen.SUITE_N
# The generator lives with the training data (train/mathgen.py): the training mix draws
# problems from it with another seed.
evaluate, math_problems = mathgen.evaluate, mathgen.math_problems


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


def category_prompts(name: str, tok, vocab_size: int, n: int = 0, suite: str = "dev"
                     ) -> list[list[int]]:
  """The first n (0: all) conversations of a category of `suite` (SUITES) as
  prompt ids, rendered with the target's chat template (a target without
  one is refused)."""
  recs = load_category(name, suite_dir(suite))
  recs = recs[:n] if n else recs
  return [cli.check_ids(cli.chat_ids(tok, r["messages"], f"taskbench {name}"), vocab_size)
          for r in recs]


def mixed_prompts(tok, vocab_size: int, n: int = 0, suite: str = "dev") -> list[list[int]]:
  """The MIXED category: the categories' conversations in turn (CATEGORIES
  order), n of each (0: as many as the shortest category has), so prompt i
  is of category mixed_categories(..)[i] and a batch of B rows (row r:
  prompt r mod len) holds rows of min(B, 6) categories."""
  per = [category_prompts(c, tok, vocab_size, n, suite) for c in CATEGORIES]
  return [p for turn in zip(*per) for p in turn]


def mixed_categories(n_prompts: int) -> list[str]:
  """The category of each of the MIXED category's prompts, in order."""
  return [CATEGORIES[i % len(CATEGORIES)] for i in range(n_prompts)]


def suite_dir(suite: str) -> Path:
  """A suite's folder: SUITES' or the long suite's."""
  if suite == LONG:
    return longsuite.DIR
  if suite not in SUITES:
    raise ConfigError(f"unknown taskbench suite {suite!r}; valid: {', '.join((*SUITES, LONG))}")
  return SUITES[suite]


def suite_categories(suite: str) -> tuple[str, ...]:
  """What config.taskbench may name: a suite's categories (MIXED: rows of them all)."""
  return longsuite.CATEGORIES if suite == LONG else (*CATEGORIES, MIXED)


# ------------------------------------------------------------ math problems


def write_math(directory: Path = DIR, n: int = MATH_N, seed: int = MATH_SEED) -> Path:
  """Writes math.jsonl (experiments/make_math_prompts.py)."""
  path = Path(directory) / "math.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in math_problems(n, seed)))
  return path
