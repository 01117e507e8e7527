"""The gamma x acceptance sweep: measured speedup next to the theory's.

  python experiments/sweep_gamma.py --config=configs/sweep_gamma.py:quick --workdir=/tmp/specjax_quick

Writes results.jsonl (one line per point, as it finishes), results.csv,
config.json, costs.json, noise.json, speedup.png, verify_cost.png and
summary.md into --workdir. --resume skips the points already in
results.jsonl; a workdir that holds records is refused unless --resume or
--overwrite (its old outputs moved aside into WORKDIR/replaced-STAMP/).
The config picks the runner: `taskbench` the task suite, `contexts` a gamma
sweep per context depth, `trees` the trees sweep, otherwise the gamma sweep
(specjax/bench/sweep/).
"""

import os
import sys

from absl import flags

from specjax import cli
from specjax.bench.sweep import contexts, gamma, harness, taskbench_report, taskbench_run, trees
from specjax.bench.sweep.config import SweepConfig

_CONFIG = cli.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "..", "configs", "sweep_gamma.py"),
    "Sweep config file (configs/sweep_gamma.py[:quick]).")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/specjax_sweep", "Output folder.")
_RESUME = flags.DEFINE_bool("resume", False, "Skip points already in workdir/results.jsonl.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Move a finished workdir's outputs aside "
                               "(WORKDIR/replaced-STAMP/) and start again.")


def main(argv):
  del argv
  cfg = SweepConfig.from_mapping(_CONFIG.value)  # validated once, typed from here on
  kw = dict(resume=_RESUME.value, overwrite=_OVERWRITE.value, progress=sys.stderr.isatty())
  if cfg.runner == "taskbench":  # one sweep per category and tree drafter, then the report
    taskbench_run.run_taskbench(cfg, _WORKDIR.value, **kw)
    summary = taskbench_report.REPORT
  elif cfg.runner == "contexts":  # one gamma sweep per context depth, then the report
    contexts.run_contexts(cfg, _WORKDIR.value, **kw)
    summary = contexts.REPORT
  else:
    harness.run(trees.RUNNER if cfg.runner == "trees" else gamma.RUNNER, cfg, _WORKDIR.value,
                **kw)
    summary = "summary.md"
  with open(os.path.join(_WORKDIR.value, summary)) as f:
    print(f.read())
  print(f"outputs in {_WORKDIR.value}")


if __name__ == "__main__":
  cli.run(main)
