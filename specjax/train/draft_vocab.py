"""The reduced draft vocabulary of a target, built from its own replies
(drafters/vocab.py): greedy replies to the training side of the prompt mix,
their tokens counted, the ranking stored; the held-out side's replies give
each size's coverage (the share of the target's output tokens a draft over
that set could propose at all)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Callable

import numpy as np

from specjax.drafters import vocab
from specjax.model import steps
from specjax.train import replies

SIZES = (1024, 2048, 4096, 8192, 16384, 32768)


def pick(mix: list[dict], n: int, heldout: bool, seed: int) -> list[dict]:
  """n records of one side of the mix, seeded (every kind in proportion)."""
  side = [r for r in mix if bool(r["heldout"]) == heldout]
  random.Random(seed).shuffle(side)
  return side[:n]


def build(target: steps.Runner, tok, mix: list[dict], n_train: int, n_held: int, n_new: int,
          batch: int, work: Path, seed: int = 0, log: Callable[[str], None] = print,
          sizes=SIZES):
  """(ranking [V] int32, {size: held-out coverage}, counts [V]). The replies
  are written under work/gen and read back on a resumed run."""
  train = pick(mix, n_train, False, seed)
  held = pick(mix, n_held, True, seed)
  log(f"draft vocabulary: replies to {len(train)} training and {len(held)} held-out prompts")
  got = replies.generate_replies(target, tok, train, n_new, batch, work / "gen", "train", log)
  counts = vocab.count_tokens(got, target.cfg.vocab_size)
  special = tok.special_ids()
  ranked = vocab.ranking(counts, special)
  out = replies.generate_replies(target, tok, held, n_new, batch, work / "gen", "heldout", log)
  cover = {size: vocab.coverage(np.sort(ranked[:size]), out)
           for size in sizes if size <= len(ranked)}
  return ranked, cover, counts
