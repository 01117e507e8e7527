"""experiments/divergence_study.py resumes only what this command asked: a
rerun with another --model_draft measures it (before, it measured nothing
and printed the first draft's table under the new command)."""

import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMON = ["--dtypes=float32", "--prompt_sets=continuation", "--n_prompts=1", "--n_predict=4",
          "--gamma=2"]


def study(out_dir, *args):
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "divergence_study.py"),
                         f"--out_dir={out_dir}", *COMMON, *args], capture_output=True,
                        text=True, timeout=600, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc


def test_a_rerun_with_another_draft_measures_it(tmp_path):
  first = study(tmp_path, "--model_draft=stdlib-draft")
  assert "[float32 continuation 1/1]" in first.stderr
  again = study(tmp_path, "--model_draft=stdlib-draft")
  assert "[float32" not in again.stderr  # the same command: resumed, nothing measured
  other = study(tmp_path, "--model_draft=stdlib-target")  # the target drafting for itself
  assert "[float32 continuation 1/1]" in other.stderr
  recs = [json.loads(l) for l in (tmp_path / "divergence.jsonl").read_text().splitlines()]
  assert [(r["model_draft"], r["draft"]) for r in recs] == [
      ("stdlib-draft", "stdlib-draft"), ("stdlib-target", "stdlib-target")]
  # the summary is the new command's: one prompt, and it names the new draft
  summary = (tmp_path / "summary.md").read_text()
  assert "(stdlib-target drafted by stdlib-target," in summary
  assert re.search(r"\| float32 +\| +1 \|", summary), summary
