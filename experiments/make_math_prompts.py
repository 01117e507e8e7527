"""Writes the task suite's math word problems (seeded, with known answers).

  python experiments/make_math_prompts.py

Writes specjax/assets/taskbench/math.jsonl (train/mathgen.math_problems, through bench/taskbench):
each line {"messages": [a user turn], "expression": "3 * 12 - 5", "answer": 31}.
The same seed gives the same file (tests/bench/test_taskbench.py checks it).
"""

import sys

from absl import flags

from specjax import cli
from specjax.bench.sweep import taskbench

_N = flags.DEFINE_integer("n", taskbench.MATH_N, "Problems to write (the suite: 10-20).")
_SEED = flags.DEFINE_integer("seed", taskbench.MATH_SEED, "Seed of the numbers.")


def main(argv):
  del argv
  path = taskbench.write_math(n=_N.value, seed=_SEED.value)
  print(f"wrote {_N.value} problems to {path}", file=sys.stderr)


if __name__ == "__main__":
  cli.run(main)
