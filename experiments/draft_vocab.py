"""Builds a target's reduced draft vocabulary from its own replies and ships
it (specjax/train/draft_vocab.py; drafters/vocab.py):

  python experiments/draft_vocab.py --workdir=/tmp/specjax_vocab --out_dir=specjax/assets/smollm2-vocab

Greedy replies of the target to --n_train training prompts of the
self-distillation mix are counted; the set is the special tokens plus the
most frequent ids (--size), stored with the whole ranking so that a drafter
spec's `:vocab=N` can cut any other size; the coverage of each size on
--n_heldout held-out prompts' replies is printed and stored. Interrupt at
any time: the same command resumes (finished reply batches).
"""

import os
from pathlib import Path

from absl import flags

from specjax import cli
from specjax import workdir as wd
from specjax.drafters import vocab
from specjax.errors import ConfigError
from specjax.formats import checkpoint
from specjax.model import steps
from specjax.train import draft_vocab, replies

_CONFIG = cli.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "..", "configs", "train.py") + ":smollm2",
    "The self-distillation config whose target and prompt mix are used.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/specjax_vocab", "The replies (resumable).")
_OUT = flags.DEFINE_string("out_dir", None, "Write draft_vocab.json here (default: the workdir).")
_N_TRAIN = flags.DEFINE_integer("n_train", 256, "Training prompts whose replies are counted.")
_N_HELD = flags.DEFINE_integer("n_heldout", 64, "Held-out prompts for the coverage.")
_N_NEW = flags.DEFINE_integer("n_new", 128, "Reply length (greedy, up to EOS).")
_SIZE = flags.DEFINE_integer("size", 8192, "Ids in the stored set (specials included).")
_BATCH = flags.DEFINE_integer("batch", 32, "Replies per generation batch.")


def main(argv):
  del argv
  if min(_N_TRAIN.value, _N_HELD.value, _N_NEW.value, _SIZE.value, _BATCH.value) < 1:
    raise ConfigError("--n_train, --n_heldout, --n_new, --size and --batch must be >= 1")
  c = _CONFIG.value
  work = Path(_WORKDIR.value)
  settings = {"target": str(c.target), "mix": dict(c.mix), "seed": int(c.seed),
              "heldout_every": int(c.heldout_every), "mix_version": replies.MIX_VERSION,
              "max_files": int(c.max_files), "n_train": _N_TRAIN.value,
              "n_heldout": _N_HELD.value, "n_new": _N_NEW.value}
  wd.check_stage(work / "vocab.settings.json", settings, [work / "gen"],
                 "use a new --workdir for other settings")
  tcfg, tparams, tok = checkpoint.load_model(str(c.target), dtype="float32")
  if tok is None or tok.chat is None:
    raise ConfigError(f"target {c.target}: the prompt mix needs its tokenizer and chat template")
  mix = replies.prompt_mix(dict(c.mix), int(c.seed), int(c.heldout_every), int(c.max_files))
  ranked, cover, counts = draft_vocab.build(steps.Runner(tcfg, tparams), tok, mix, _N_TRAIN.value,
                                            _N_HELD.value, _N_NEW.value, _BATCH.value, work,
                                            int(c.seed))
  size = min(_SIZE.value, len(ranked))
  out = vocab.save(_OUT.value or work, vocab.top_ids(counts, size, tok.special_ids()),
                   tcfg.vocab_size, tok.special_ids(), ranked=ranked, target=str(c.target),
                   source=settings, coverage={str(k): v for k, v in cover.items()},
                   distinct_tokens=int((counts > 0).sum()))
  print(f"{int((counts > 0).sum()):,} distinct ids in {int(counts.sum()):,} reply tokens")
  for k, v in cover.items():
    print(f"V_d = {k:>6,}: held-out coverage {v:.4f}")
  print(f"wrote {out} ({size:,} ids)")


if __name__ == "__main__":
  cli.run(main)
