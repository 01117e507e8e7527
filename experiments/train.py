"""Trains the target/draft pair on the standard library's source and ships it.

  python experiments/train.py --config=configs/train.py --workdir=/tmp/specjax_train \
      --export_dir=specjax/assets

Stages: corpus + tokenizer, target, draft, distilled draft, real acceptance
before/after distillation, export (see specjax/train/pair.py). Interrupt it at any
time: run the same command again and it resumes from the last checkpoint.
Metrics: <workdir>/<stage>/metrics.jsonl; summary: <workdir>/training.json.
"""

import os
import sys

from absl import flags

from specjax import cli
from specjax.train import pair

_CONFIG = cli.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "..", "configs", "train.py"),
    "Training config (configs/train.py[:tiny]).")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/specjax_train",
                               "Checkpoints, metrics, corpus and tokenizer.")
_EXPORT = flags.DEFINE_string("export_dir", None,
                              "Write the HF pair here (specjax/assets ships it); "
                              "default: no export.")


def main(argv):
  del argv
  s = pair.run(_CONFIG.value, _WORKDIR.value, _EXPORT.value, progress=sys.stderr.isatty())
  h, a = s["heldout"], s["alpha"]
  print(f"corpus: {s['corpus']['train_files']} train files / {s['corpus']['train_tokens']:,} "
        f"tokens; held out {s['corpus']['heldout_files']} files / "
        f"{s['corpus']['heldout_tokens']:,} tokens")
  print(f"held-out loss (ppl): target {h['target']['eval_loss']:.3f} "
        f"({h['target']['eval_ppl']:.2f}), draft {h['draft_before']['eval_loss']:.3f} -> "
        f"distilled {h['draft_after']['eval_loss']:.3f}; KL to target "
        f"{h['draft_before']['eval_kl']:.3f} -> {h['draft_after']['eval_kl']:.3f}")
  for t in a["before"]:
    print(f"alpha at T={t} (gamma {a['gamma']}, {a['prompts']} held-out prompts): "
          f"{a['before'][t]['alpha']:.3f} before distillation, "
          f"{a['after'][t]['alpha']:.3f} after")
  print(f"summary: {os.path.join(_WORKDIR.value, pair.SUMMARY_FILE)}")
  if _EXPORT.value:
    print(f"exported to {_EXPORT.value}/stdlib-target and stdlib-draft")


if __name__ == "__main__":
  cli.run(main)
