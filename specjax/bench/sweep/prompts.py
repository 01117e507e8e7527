"""The prompts a sweep runs, as token ids: the config's one prompt (text or
ids), `heldout_prompts` shipped held-out prompts (continuation or editing),
a task suite category's conversations (the mixed category: every
category's in turn), or those of a context (the long suite's,
`context_prompts`); with `chat`, each text a user turn through the target's
chat template (a target without one is refused)."""

from __future__ import annotations

from specjax import cli
from specjax.bench.sweep import longsuite, taskbench
from specjax.bench.sweep.config import SweepConfig
from specjax.errors import ConfigError
from specjax.formats import chat as chat_lib
from specjax.train import pair


def sweep_prompts(cfg: SweepConfig, tok, vocab_size: int) -> list[list[int]]:
  """The prompts of a sweep (module docstring); with `taskbench_category`,
  the first `taskbench_prompts` (0: all) of its conversations, unless
  `prompt_tokens` are given (models without a tokenizer)."""
  n = cfg.heldout_prompts
  if cfg.context:
    return context_prompts(cfg, tok, vocab_size)
  if cfg.taskbench_category == taskbench.MIXED:  # prompt_tokens: those ids for each category
    if cfg.prompt_tokens:
      return [cli.parse_prompt(None, cfg.prompt_tokens, tok, vocab_size)] * len(
          taskbench.CATEGORIES)
    return taskbench.mixed_prompts(tok, vocab_size, cfg.taskbench_prompts, cfg.taskbench_suite)
  if cfg.taskbench_category and not cfg.prompt_tokens:
    return taskbench.category_prompts(cfg.taskbench_category, tok, vocab_size,
                                      cfg.taskbench_prompts, cfg.taskbench_suite)
  if n:
    if tok is None:
      raise ConfigError("config.heldout_prompts needs a target with a tokenizer")
    texts = pair.shipped_prompts(n, kind=cfg.prompt_set)
    if len(texts) < n:
      raise ConfigError(f"config.heldout_prompts={n}, but only {len(texts)} are shipped")
  elif not cfg.chat:
    return [cli.parse_prompt(cfg.prompt or None, cfg.prompt_tokens or None, tok, vocab_size)]
  else:
    texts = [cfg.prompt or cli.DEFAULT_PROMPT_TEXT]
  if not cfg.chat:
    return [tok.encode(t) for t in texts]
  return [cli.check_ids(cli.chat_ids(tok, chat_lib.user_turn(t), "config.chat"), vocab_size)
          for t in texts]


def context_prompts(cfg: SweepConfig, tok, vocab_size: int) -> list[list[int]]:
  """The prompts of a sweep at `context` (bench/sweep/contexts.py): the first
  `taskbench_prompts` (0: all) of the long suite's at that context, a
  document's summary and question in turn; or `prompt_tokens` tiled to
  context - n_predict tokens (models without a tokenizer)."""
  if cfg.prompt_tokens:
    ids = cli.parse_prompt(None, cfg.prompt_tokens, tok, vocab_size)
    n = cfg.context - cfg.n_predict
    if n < 1:
      raise ConfigError(f"config.contexts: {cfg.context} leaves no room for a prompt before "
                        f"n_predict ({cfg.n_predict}) tokens")
    return [(ids * (n // len(ids) + 1))[:n]]
  per_cat = [[cli.check_ids(cli.chat_ids(tok, r["messages"], f"long suite {cat}"), vocab_size)
              for r in taskbench.load_category(cat, longsuite.DIR) if r["context"] == cfg.context]
             for cat in longsuite.CATEGORIES]
  out = [p for pair in zip(*per_cat) for p in pair]
  return out[:cfg.taskbench_prompts] if cfg.taskbench_prompts else out
