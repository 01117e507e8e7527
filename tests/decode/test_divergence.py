"""Where greedy speculative tokens part from greedy target-only tokens.

`first_divergence` (metrics/divergence.py) on lists; then a constructed
near-tie: the verify's logits at one position get the runner-up raised to
just above the top (by 2^-12 of it, a sixteenth of a bfloat16 rounding step,
what a verify of gamma+1 rows and a decode of one row can disagree by in
bfloat16), so the speculative run emits the runner-up there and the
target-only run does not. The record's field (cli.row_records, and
experiments/speculative.py's --json_out end to end) must name the position
where the outputs really part, checked token by token here. The greedy
equality tests themselves stay in float32 (test_speculative.py and the
drafters' tests), where no argmax flips.

Deliberate bugs (MUTATIONS), each failing the same check: the comparison off
by one, the tokens compared against themselves instead of the baseline, and
the rows' baselines swapped in the record.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from specjax import cli
from specjax.decode import chain_step
from specjax.decode import generation
from specjax.decode import speculative
from specjax.metrics import divergence
from specjax.model import config
from specjax.model import llama as model
from specjax.model import sampling
from specjax.model import steps

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REL = 2.0 ** -12  # the near-tie: below bfloat16's spacing (2^-8 relative, or finer)

# ---------------------------------------------------------------- on lists


def test_equal_lists_have_no_divergence():
  assert divergence.first_divergence([3, 1, 4, 1], [3, 1, 4, 1]) is None
  assert divergence.first_divergence([], []) is None


@pytest.mark.parametrize("k", [0, 2, 4])
def test_the_first_differing_index(k):
  base = [3, 1, 4, 1, 5]
  spec = base[:k] + [9] + base[k + 1:]
  assert divergence.first_divergence(spec, base) == k
  assert divergence.first_divergence(spec[:k + 1] + [7, 7], base) == k  # later ones ignored


def test_a_prefix_parts_at_its_length():
  assert divergence.first_divergence([3, 1], [3, 1, 4]) == 2
  assert divergence.first_divergence([3, 1, 4], [3, 1]) == 2
  assert divergence.first_divergence([], [3]) == 0


def test_equality_is_claimed_only_greedy_with_the_real_rule():
  assert divergence.equality_claimed(0.0, simulated=False)
  assert not divergence.equality_claimed(0.7, simulated=False)
  assert not divergence.equality_claimed(0.0, simulated=True)


def test_rows_carry_the_field_only_where_equality_is_claimed():
  prompts, toks, base = [[1], [2]], [[5, 6, 7], [5, 6]], [[5, 6, 7], [5, 8]]
  rows = cli.row_records(prompts, toks, base, equality_claimed=True)
  assert [r["first_divergence"] for r in rows] == [None, 1]
  assert all("first_divergence" not in r for r in cli.row_records(prompts, toks, base))
  assert all("first_divergence" not in r
             for r in cli.row_records(prompts, toks, equality_claimed=True))  # no baseline


def test_the_line_says_where_and_why():
  assert "equal the target-only tokens" in divergence.summary_line([None], 96, "bfloat16")
  line = divergence.summary_line([63], 96, "bfloat16")
  assert "token 63" in line and "near-tie" in line and "not a bug" in line
  line = divergence.summary_line([None, 7], 16, "float32")
  assert "1 of 2 rows" in line and "1:7" in line and "expected to agree" in line

# ---------------------------------------------------------------- a constructed near-tie


def near_tie_verify(position: int, row: int | None = None):
  """chain_step.verify_phase (model drafter) whose logits at the absolute
  input position `position` (of `row`, every row if None) hold a near-tie:
  the runner-up raised to REL above the top, so it becomes the argmax there.
  The input at position p predicts the token at p + 1."""
  def verify_phase(tparams, tcache, tail, drafts, sc):
    tokens = jnp.concatenate([tail[:, 1:], drafts], 1)  # [B, gamma+1]
    logits, tcache_out = model.forward(tparams, tokens, tcache, sc.target)  # [B, T, V]
    b, t = tokens.shape
    at = tcache.lengths[:, None] + jnp.arange(t)[None, :] == position  # [B, T]
    if row is not None:
      at &= jnp.arange(b)[:, None] == row
    top, idx = jax.lax.top_k(logits, 2)  # [B, T, 2]
    raised = top[..., 0] + REL * jnp.maximum(jnp.abs(top[..., 0]), 1.0)  # [B, T]
    runner_up = jax.nn.one_hot(idx[..., 1], logits.shape[-1], dtype=jnp.bool_)  # [B, T, V]
    logits = jnp.where(at[..., None] & runner_up, raised[..., None], logits)
    return sampling.probs(logits, sc.sp), tcache_out, None  # no features (model drafter)
  return verify_phase


PROMPTS = [[5, 17, 42, 9, 100], [7, 7, 7]]
K = 6             # row 0's outputs part at this output index
N_PREDICT, GAMMA = 14, 3


@pytest.fixture(scope="module")
def near_tie_run(init_params):
  """Row 0 with the near-tie at output K (input position len(prompt) + K - 1),
  row 1 without; the target its own draft (every draft accepted but the tied
  one), float32."""
  cfg = config.get_preset("tiny", dtype="float32")
  target = steps.Runner(cfg, init_params(cfg, 1))
  base = generation.generate(target, PROMPTS, N_PREDICT).tokens
  mp = pytest.MonkeyPatch()
  jax.clear_caches()
  mp.setattr(chain_step, "verify_phase", near_tie_verify(len(PROMPTS[0]) + K - 1, row=0))
  try:
    spec = speculative.generate(target, target, PROMPTS, N_PREDICT, GAMMA).tokens
  finally:
    mp.undo()
    jax.clear_caches()
  return spec, base


def test_the_near_tie_parts_the_outputs_where_constructed(near_tie_run):
  spec, base = near_tie_run
  assert spec[0][:K] == base[0][:K] and spec[0][K] != base[0][K], (spec[0], base[0])
  assert spec[1] == base[1]  # float32, no tie: equal


def record_problems(rows, spec, base) -> list[str]:
  """What the rows' first_divergence gets wrong against the tokens, compared
  here one by one: the first index where they differ, None when equal."""
  bad = []
  for r, (row, s, b) in enumerate(zip(rows, spec, base)):
    parts = next((i for i, (x, y) in enumerate(zip(s, b)) if x != y), None)
    if row.get("first_divergence", "absent") != parts:
      bad.append(f"row {r}: field {row.get('first_divergence', 'absent')}, tokens part at {parts}")
  return bad


def test_the_record_names_where_the_outputs_part(near_tie_run):
  spec, base = near_tie_run
  rows = cli.row_records(PROMPTS, spec, base, equality_claimed=True)
  assert [r["first_divergence"] for r in rows] == [K, None]
  assert not record_problems(rows, spec, base)


def _off_by_one(orig):
  return lambda a, b: None if orig(a, b) is None else orig(a, b) + 1


def _against_itself(orig):
  return lambda a, b: orig(a, a)


def _baselines_swapped(orig):
  return lambda prompts, toks, base=None, **kw: orig(prompts, toks, base[::-1], **kw)


MUTATIONS = {
    "comparison off by one": (divergence, "first_divergence", _off_by_one),
    "tokens compared against themselves": (divergence, "first_divergence", _against_itself),
    "rows' baselines swapped": (cli, "row_records", _baselines_swapped),
}


@pytest.mark.parametrize("bug", list(MUTATIONS))
def test_each_deliberate_bug_fails_the_record_check(near_tie_run, monkeypatch, bug):
  module, name, make = MUTATIONS[bug]
  monkeypatch.setattr(module, name, make(getattr(module, name)))
  spec, base = near_tie_run
  rows = cli.row_records(PROMPTS, spec, base, equality_claimed=True)
  assert record_problems(rows, spec, base)

# ---------------------------------------------------------------- the script's record


SCRIPT_K, SCRIPT_PROMPT = 5, [4, 5, 6]
DRIVER = f"""
import runpy, sys
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
import test_divergence as t
from specjax.decode import chain_step
chain_step.verify_phase = t.near_tie_verify({len(SCRIPT_PROMPT) + SCRIPT_K - 1})
sys.argv = ["speculative.py"] + sys.argv[1:]
runpy.run_path({os.path.join(ROOT, "experiments", "speculative.py")!r}, run_name="__main__")
"""


def test_speculative_py_records_and_prints_where_a_near_tie_parts(tmp_path):
  """experiments/speculative.py with the near-tie at output SCRIPT_K (float32,
  greedy, the real rule): the record's first_divergence and its row's are
  where its tokens and baseline tokens part, and the line says so."""
  out = tmp_path / "spec.json"
  proc = subprocess.run(
      [sys.executable, "-c", DRIVER, "--model=tiny", "--model_draft=tiny-draft",
       "--dtype=float32", "--prompt_tokens=" + ",".join(map(str, SCRIPT_PROMPT)),
       "--n_predict=12", "--gamma=3", "--reps=1", f"--json_out={out}"],
      capture_output=True, text=True, timeout=300, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr
  rec = json.loads(out.read_text())
  assert rec["first_divergence"] == rec["rows"][0]["first_divergence"] == SCRIPT_K
  assert not record_problems(rec["rows"], [rec["tokens"]], [rec["baseline_tokens"]])
  assert f"part at token {SCRIPT_K} (0-based); in float32" in proc.stdout
