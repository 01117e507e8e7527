"""train/draft_vocab.py: the ranking counts the target's replies to the
training side only, puts the special tokens first, and the coverage is
measured on the held-out side's replies; reply batches are reused."""

import numpy as np

from specjax.model import config
from specjax.model import steps
from specjax.train import draft_vocab


class Tok:
  """A stand-in tokenizer: a conversation's ids are its message's characters."""
  eos_id = 2

  def encode_chat(self, messages):
    return [3 + ord(c) % 50 for c in messages[0]["content"]]

  def special_ids(self):
    return [0, 1, 2]


def test_the_ranking_counts_the_training_replies(tmp_path, init_params):
  cfg = config.get_preset("tiny")
  target = steps.Runner(cfg, init_params(cfg, 3))
  mix = [{"messages": [{"role": "user", "content": f"prompt {i}"}], "heldout": i % 4 == 0}
         for i in range(12)]
  logs = []
  ranked, cover, counts = draft_vocab.build(target, Tok(), mix, 5, 2, 6, 4, tmp_path,
                                            log=logs.append, sizes=(3, 16, 256, 512))
  train = draft_vocab.pick(mix, 5, False, 0)
  assert len(train) == 5 and not any(r["heldout"] for r in train)
  assert counts.sum() == 5 * 6  # the replies' tokens only (no EOS reached on random weights)
  assert ranked[:3].tolist() == [0, 1, 2] and sorted(ranked.tolist()) == list(range(cfg.vocab_size))
  top = ranked[3:3 + int((counts[3:] > 0).sum())]
  assert np.all(np.diff(counts[top]) <= 0)  # then by count
  assert set(cover) == {3, 16, 256} and cover[256] == 1.0 and cover[3] == 0.0  # specials only
  assert cover[3] <= cover[16] <= cover[256]
  again = draft_vocab.build(target, Tok(), mix, 5, 2, 6, 4, tmp_path, log=logs.append)
  assert np.array_equal(again[0], ranked)
  assert sum(l.startswith("replies ") for l in logs) == 3  # 2 + 1 batches, then none: read back
