"""Trains an EAGLE-1 draft head for the shipped target and ships it.

  python experiments/train_eagle.py --config=configs/train.py:eagle \
      --workdir=/tmp/specjax_eagle --export_dir=specjax/assets

The target (stdlib-target) is frozen; its features are computed in the same
jitted step as the head's update (specjax/train/eagle.py). Interrupt at any time:
the same command resumes from the last checkpoint. Outputs: <workdir>/head/
(checkpoints, metrics.jsonl), training.png, alpha.json, eagle.json; with
--export_dir, <export_dir>/stdlib-eagle (load with eagle.load_eagle).
"""

import os
import sys

from absl import flags

from specjax import cli
from specjax.train import eagle

_CONFIG = cli.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "..", "configs", "train.py") + ":eagle",
    "Training config (configs/train.py:eagle or :eagle_tiny).")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/specjax_eagle",
                               "Checkpoints, metrics, corpus streams, summary.")
_EXPORT = flags.DEFINE_string("export_dir", None,
                              "Write the head under this directory (specjax/assets ships "
                              "it as stdlib-eagle); default: no export.")


def main(argv):
  del argv
  s = eagle.run(_CONFIG.value, _WORKDIR.value, _EXPORT.value, progress=sys.stderr.isatty())
  h, a = s["heldout"], s["alpha"]
  print(f"head: {s['head_params'] / 1e6:.2f} M params, {s['train_seconds']:.0f} s of training "
        f"(median {s['train_tok_s_median'] or 0:.0f} tokens/s)")
  print(f"held-out: loss {h['eval_loss']:.4f} (smooth L1 {h['eval_vloss']:.4f}, "
        f"cross-entropy {h['eval_ploss']:.4f}), top-1 agreement {h['eval_acc']:.3f}")
  for t, e in a["eagle"].items():
    line = f"alpha at T={t} (gamma {a['gamma']}, {a['prompts']} held-out prompts): eagle " \
           f"{e['alpha']:.3f} (mean accepted {e['mean_accepted']:.2f})"
    for name in a:
      if isinstance(a[name], dict) and name != "eagle":
        line += f", {name} {a[name][t]['alpha']:.3f} ({a[name][t]['mean_accepted']:.2f})"
    print(line)
  if "exported" in s:
    print(f"exported to {s['exported']}")


if __name__ == "__main__":
  cli.run(main)
