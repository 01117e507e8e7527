"""Where two token lists part: greedy speculative against greedy target-only.

Greedy speculative decoding emits the target's own argmax at every position,
so its tokens equal target-only greedy tokens *if the two compute the same
logits*. They do not, bit for bit: the verify runs the target over gamma + 1
rows at once and the target-only decode over one row, and the two products
reduce in different orders. In float32 the difference is in the last bits of
a 24-bit mantissa and no argmax flips (the greedy-equality tests run there);
in bfloat16 (8 bits) a difference of one rounding step flips the argmax
where the top two logits are that close (a near-tie), and from that token on
the two runs continue different texts. `first_divergence` is that position,
the run record's field of the same name (schema.FIELDS), defined once here
and used by experiments/speculative.py, cli.row_records and the study
(experiments/divergence_study.py; figures in docs/results.md).
"""

from __future__ import annotations

from typing import Sequence

# Compute precisions in which the target's logits are float32 throughout.
EXACT_PRECISIONS = ("float32", "int8")


def first_divergence(tokens: Sequence[int], baseline: Sequence[int]) -> int | None:
  """The 0-based index of the first token where `tokens` and `baseline`
  differ; the shorter list's length when one is a prefix of the other; None
  when they are equal."""
  a, b = [int(t) for t in tokens], [int(t) for t in baseline]
  for i, (x, y) in enumerate(zip(a, b)):
    if x != y:
      return i
  return None if len(a) == len(b) else min(len(a), len(b))


def equality_claimed(temperature: float, simulated: bool) -> bool:
  """Whether speculative tokens are meant to equal target-only tokens: greedy
  (temperature 0) with the real acceptance rule. Sampled runs draw from other
  random streams and simulated rules keep drafts the target would not choose,
  so there `first_divergence` is not defined (the field is absent)."""
  return temperature == 0 and not simulated


def summary_line(divergences: Sequence[int | None], n_tokens: int, precision: str) -> str:
  """One line for a greedy run: the outputs agree, or where each row parts
  and why (a near-tie in low precision; in float32 they must agree)."""
  parted = [(r, k) for r, k in enumerate(divergences) if k is not None]
  if not parted:
    return (f"greedy equality: the speculative tokens equal the target-only tokens "
            f"({'every row, ' if len(divergences) > 1 else ''}all {n_tokens})")
  where = (f"token {parted[0][1]}" if len(divergences) == 1 else
           f"{len(parted)} of {len(divergences)} rows (row:token " +
           ", ".join(f"{r}:{k}" for r, k in parted) + ")")
  if precision in EXACT_PRECISIONS:
    why = (f"in {precision} they are expected to agree (tested): an exact tie, or a bug "
           "worth reporting")
  else:
    why = (f"in {precision} this is a near-tie (the verify of gamma+1 rows and the decode "
           "of one row round differently), not a bug; float32 is where equality holds")
  return f"greedy equality: the outputs part at {where} (0-based); {why}"
