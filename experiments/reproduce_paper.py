"""Reproduces the published speculative-decoding numbers from specjax.metrics.theory alone.

Run (after `pip install -e .`):

  python experiments/reproduce_paper.py --workdir=/tmp/specjax_paper

No model, no accelerator. Writes speedup_vs_gamma.png,
optimal_gamma_vs_alpha.png, summary.md, results.csv, results.jsonl and
config.json into --workdir (specjax/bench/studies/paper.py says what each holds) and prints
summary.md.
"""

from absl import flags

from specjax import cli
from specjax.bench.studies import paper

_WORKDIR = flags.DEFINE_string("workdir", "/tmp/specjax_paper", "Output folder (created if missing).")
_MAX_GAMMA = flags.DEFINE_integer("max_gamma", 10, "Largest draft length gamma in the plot and tables.",
                                  lower_bound=1, upper_bound=64)

flags.register_validator("workdir", lambda v: bool(v and v.strip()), message="--workdir must not be empty")


def main(argv):
  del argv
  try:
    summary = paper.write_outputs(_WORKDIR.value, _MAX_GAMMA.value)
  except OSError as e:
    cli.fail(str(e))
  print(summary)
  print(f"Wrote {_WORKDIR.value}/summary.md, speedup_vs_gamma.png, optimal_gamma_vs_alpha.png, "
        "results.csv, results.jsonl, config.json")


if __name__ == "__main__":
  cli.run(main)
