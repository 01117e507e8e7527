"""The sweep's grid: its settings checked, its points (drafter, batch, gamma,
acceptance rule, temperature) and their keys, the groups of points that
share their target-only runs and probes, the prompts and the ragged rows of
a batch, and the check that a resumed sweep measures what it started to."""

from __future__ import annotations

import dataclasses

from specjax import cli
from specjax import workdir as wd
from specjax.bench import taskbench
from specjax.decode import acceptance
from specjax.drafters import registry
from specjax.errors import ConfigError
from specjax.formats import chat as chat_lib
from specjax.metrics import schema
from specjax.model.sampling import SamplingParams
from specjax.train import pair
from specjax.workdir import Record


def validate(cfg) -> None:
  """Bad sweep settings -> one ConfigError naming the field."""
  if not cfg.gammas or any(int(g) < 1 or int(g) > 64 for g in cfg.gammas):
    raise ConfigError(f"config.gammas must be integers in [1, 64], got {list(cfg.gammas)}")
  batches = list(cfg.get("batches", (1,)))
  if not batches or any(int(b) < 1 for b in batches):
    raise ConfigError(f"config.batches must be integers >= 1, got {batches}")
  if int(cfg.get("auto_every", 8)) < 1:
    raise ConfigError(f"config.auto_every must be >= 1, got {cfg.auto_every}")
  if not cfg.accepts:
    raise ConfigError("config.accepts is empty")
  if str(cfg.get("prompt_set", "continuation")) not in pair.PROMPT_FILES:
    raise ConfigError(f"config.prompt_set must be one of {', '.join(pair.PROMPT_FILES)}, "
                      f"got {cfg.prompt_set!r}")
  specs = drafter_specs(cfg)
  for spec in specs:
    registry.parse(spec)
  if len({registry.parse(x).spec for x in specs}) < len(specs):
    raise ConfigError(f"config.drafters names a drafter twice: {specs}")
  for a in cfg.accepts:
    for g in cfg.gammas:
      acceptance.parse_rule(a).resolve(int(g))
  if int(cfg.get("heldout_prompts", 0)) < 0:
    raise ConfigError(f"config.heldout_prompts must be >= 0, got {cfg.heldout_prompts}")
  for name in ("n_predict", "reps"):
    if int(getattr(cfg, name)) < 1:
      raise ConfigError(f"config.{name} must be >= 1, got {getattr(cfg, name)}")
  if not list(cfg.temps):
    raise ConfigError("config.temps is empty")
  for t in cfg.temps:
    SamplingParams(float(t), int(cfg.top_k), float(cfg.top_p))


def drafter_specs(cfg) -> list[str]:
  """The drafters a sweep compares: config.drafters, or the one config.drafter."""
  specs = [str(x) for x in (cfg.get("drafters", None) or ())]
  return specs or [str(cfg.get("drafter", "model"))]


AUTO = "auto"  # the gamma of a point whose gamma is chosen at run time (autogamma)


@dataclasses.dataclass(frozen=True)
class Point:
  gamma: int | str  # an int, or AUTO
  accept_rule: str
  sp: SamplingParams
  batch: int = 1
  drafter: str = "model"  # the drafter's canonical spec (drafters.Drafter.spec)

  @property
  def auto(self) -> bool:
    return self.gamma == AUTO

  @property
  def key(self) -> tuple:
    return (self.drafter, self.batch, self.gamma, self.accept_rule, self.sp.temperature)


def point_key(rec: Record) -> tuple:
  g = rec["gamma"]
  return (str(rec.get("drafter") or "model"), int(rec.get("batch", 1)),
          g if g == AUTO else int(g), str(rec["accept_rule"]), float(rec["temperature"]))


def batch_prompts(prompts: list[list[int]], batch: int) -> list[list[list[int]]]:
  """The groups of rows a point at `batch` runs, one generate call each.
  Batch 1: every prompt on its own (the original sweep). Batch B > 1: one
  group of B rows; row r is prompt r mod n cut short by (r div n) mod
  ceil(L/2) tokens, so the rows have ragged lengths (and none is empty)."""
  if batch == 1:
    return [[p] for p in prompts]
  n = len(prompts)
  rows = []
  for r in range(batch):
    p = prompts[r % n]
    rows.append(p[:len(p) - (r // n) % max(1, (len(p) + 1) // 2)])
  return [rows]


def group_key(p: Point) -> tuple:
  """Points that share a group (run_group): same drafter, batch, gamma and
  sampling settings; they differ only in the acceptance rule."""
  return (p.drafter, p.batch, p.gamma, p.sp)


def sweep_prompts(cfg, tok, vocab_size: int) -> list[list[int]]:
  """The prompts of a sweep: `heldout_prompts` shipped held-out prompts, or one;
  with `taskbench_category`, that task suite category's conversations (the
  first `taskbench_prompts`, 0: all) through the chat template.
  With `chat`, each is a user turn rendered with the target's chat template
  (the chat form, for Instruct targets; a target without one is refused)."""
  n = int(cfg.get("heldout_prompts", 0))
  chat = bool(cfg.get("chat", False))
  category = str(cfg.get("taskbench_category", ""))
  if category and not cfg.prompt_tokens:  # a task suite category (bench/taskbench_run.py)
    return taskbench.category_prompts(category, tok, vocab_size,
                                      int(cfg.get("taskbench_prompts", 0)))
  if n:
    if tok is None:
      raise ConfigError("config.heldout_prompts needs a target with a tokenizer")
    texts = pair.shipped_prompts(n, kind=str(cfg.get("prompt_set", "continuation")))
    if len(texts) < n:
      raise ConfigError(f"config.heldout_prompts={n}, but only {len(texts)} are shipped")
  elif not chat:
    return [cli.parse_prompt(cfg.prompt or None, cfg.prompt_tokens or None, tok, vocab_size)]
  elif cfg.prompt_tokens:
    raise ConfigError("config.chat renders text with the chat template; config.prompt_tokens "
                      "are ids already")
  else:
    texts = [cfg.prompt or cli.DEFAULT_PROMPT_TEXT]
  if not chat:
    return [tok.encode(t) for t in texts]
  return [cli.check_ids(cli.chat_ids(tok, chat_lib.user_turn(t), "config.chat"), vocab_size)
          for t in texts]


# Fields that may change between a run and its --resume (they only add points).
_POINT_FIELDS = ("gammas", "accepts", "temps", "batches", "auto_gamma", "drafters")


def check_same_sweep(workdir: str, cfg) -> None:
  """Resuming into a workdir whose points were measured differently (other
  settings, or an older record schema) is refused."""
  saved = wd.read_config(workdir)
  if saved is None:
    return
  if saved.get("schema") != schema.SCHEMA_VERSION:
    raise ConfigError(f"cannot resume: {workdir} holds results of an older specjax (record "
                      f"schema {saved.get('schema', 1)}, now {schema.SCHEMA_VERSION}); "
                      f"use another --workdir")
  old, new = saved.get("config") or {}, wd.normalised(cfg.to_dict())
  old.setdefault("drafter", "model")  # sweeps from before drafters drafted with the model
  old.setdefault("prompt_set", "continuation")  # ... and ran the continuation prompts
  old.setdefault("chat", False)  # ... as raw text
  diff = sorted(k for k in set(old) | set(new)
                if k not in _POINT_FIELDS and old.get(k) != new.get(k))
  if diff:
    raise ConfigError(f"cannot resume: the workdir's sweep used different settings for "
                      f"{', '.join(diff)}; use another --workdir or the same config")
