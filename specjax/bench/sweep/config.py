"""A sweep's settings, validated once into a frozen dataclass (`SweepConfig`).

The script's ml_collections config (configs/sweep_gamma.py documents every
field) is turned into a `SweepConfig` at the entry point (`from_mapping`):
types converted, every field checked, one ConfigError naming the field.
Past that point nothing reads a config with a default: the runners read
typed attributes, and what a runner's dimension adds (rules at its gammas
or trees) it checks in its own `check`, before any work either.
Fields added after the first sweeps take their old implicit default, so
configs written before them still load.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from specjax.bench.sweep import engine
from specjax.bench.sweep import longsuite, taskbench
from specjax.errors import ConfigError
from specjax.model.sampling import SamplingParams
from specjax.train import pair

MAX_GAMMA = 64
AUTO = "auto"  # a gamma or a tree chosen at run time


@dataclasses.dataclass(frozen=True)
class SweepConfig:
  """Every setting of a sweep (configs/sweep_gamma.py: one line per field)."""
  target: str
  draft: str
  dtype: str
  drafter: str
  gammas: tuple[int, ...]
  accepts: tuple[str, ...]
  temps: tuple[float, ...]
  top_k: int
  top_p: float
  prompt: str
  prompt_tokens: str
  n_predict: int
  ctx_size: int
  reps: int
  seed: int
  measure_split: bool
  # added later: their defaults are what sweeps ran before them
  drafters: tuple[str, ...] = ()
  prompt_set: str = "continuation"
  heldout_prompts: int = 0
  chat: bool = False
  batches: tuple[int, ...] = (1,)
  auto_gamma: bool = False
  auto_calibrate: bool = True
  auto_every: int = 8
  trees: tuple[str, ...] = ()
  siblings: str = "topk"
  taskbench: tuple[str, ...] = ()
  taskbench_category: str = ""
  taskbench_prompts: int = 0
  taskbench_trees: tuple[str, ...] = ()
  taskbench_suite: str = "dev"
  noise_threshold: float = 0.15
  auto_candidates: str = ""  # an auto tree's: '' the config's static trees, or auto[:N1,..]
  contexts: tuple[int, ...] = ()  # context depths: one gamma sweep each (contexts.py)
  context: int = 0  # the context one of its sweeps runs (set by the runner; 0: none)
  row_budgets: tuple[str, ...] = ()  # per-row lengths' points: default | auto | N (row_budgets)

  def __post_init__(self):
    for f in dataclasses.fields(self):
      object.__setattr__(self, f.name, _typed(f.name, f.type, getattr(self, f.name)))
    for check in (_check_sizes, _check_points, _check_prompts, _check_suite, _check_contexts,
                  _check_row_budgets):
      check(self)

  @classmethod
  def from_mapping(cls, m: Mapping[str, Any]) -> "SweepConfig":
    """From an ml_collections ConfigDict (or a dict): unknown fields and
    missing required ones are one ConfigError."""
    m = dict(m.items())
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(m) - names)
    if unknown:
      raise ConfigError(f"config.{unknown[0]} is not a sweep setting "
                        f"({', '.join(sorted(names))})")
    missing = sorted(f.name for f in dataclasses.fields(cls)
                     if f.name not in m and f.default is dataclasses.MISSING)
    if missing:
      raise ConfigError(f"the config lacks {', '.join('config.' + x for x in missing)}")
    return cls(**m)

  def to_dict(self) -> dict[str, Any]:
    """Every field (config.json; `workdir.normalised` compares it)."""
    return dataclasses.asdict(self)

  def replace(self, **kw) -> "SweepConfig":
    return dataclasses.replace(self, **kw)

  @property
  def drafter_specs(self) -> tuple[str, ...]:
    """The drafters compared: `drafters`, or the one `drafter`."""
    return self.drafters or (self.drafter,)

  def sampling(self, temperature: float) -> SamplingParams:
    return SamplingParams(temperature, self.top_k, self.top_p)

  @property
  def runner(self) -> str:
    """Which runner the settings describe: taskbench, contexts, trees or gamma."""
    return ("taskbench" if self.taskbench else "contexts" if self.contexts
            else "trees" if self.trees else "gamma")


_SEQ = {"tuple[int, ...]": int, "tuple[str, ...]": str, "tuple[float, ...]": float}
_ONE = {"int": int, "str": str, "float": float, "bool": bool}


def _typed(name: str, kind: str, v: Any) -> Any:
  """v as the field's type (a sequence given as a comma-separated string
  too, as --config.gammas=1,2,3 arrives); ConfigError naming the field."""
  try:
    if kind in _SEQ:
      items = v.split(",") if isinstance(v, str) else list(v)
      return tuple(_SEQ[kind](x.strip() if isinstance(x, str) else x) for x in items
                   if not (isinstance(x, str) and not x.strip()))
    if kind == "bool" and not isinstance(v, bool):
      raise ValueError
    if kind == "int" and isinstance(v, float) and v != int(v):
      raise ValueError
    return _ONE[kind](v)
  except (TypeError, ValueError):
    raise ConfigError(f"config.{name} must be {kind}, got {v!r}") from None


def _at_least(cfg: SweepConfig, name: str, low: int) -> None:
  values = getattr(cfg, name)
  for v in values if isinstance(values, tuple) else (values,):
    if v < low:
      raise ConfigError(f"config.{name} must be >= {low}, got {values}")


def _check_sizes(cfg: SweepConfig) -> None:
  for name, low in (("n_predict", 1), ("reps", 1), ("ctx_size", 1), ("heldout_prompts", 0),
                    ("auto_every", 1), ("taskbench_prompts", 0), ("batches", 1),
                    ("contexts", 1), ("context", 0)):
    _at_least(cfg, name, low)
  if not cfg.batches:
    raise ConfigError("config.batches is empty")
  if not cfg.noise_threshold > 0:
    raise ConfigError(f"config.noise_threshold must be > 0, got {cfg.noise_threshold}")


def _check_points(cfg: SweepConfig) -> None:
  """Gammas, rules, temperatures, drafters and trees parse."""
  if not cfg.gammas or any(not 1 <= g <= MAX_GAMMA for g in cfg.gammas):
    raise ConfigError(f"config.gammas must be integers in [1, {MAX_GAMMA}], "
                      f"got {list(cfg.gammas)}")
  if not cfg.accepts:
    raise ConfigError("config.accepts is empty")
  for a in cfg.accepts:
    engine.check_rule(a)
  if not cfg.temps:
    raise ConfigError("config.temps is empty")
  for t in cfg.temps:
    cfg.sampling(t)
  specs = [engine.drafter(x).spec for x in cfg.drafter_specs]
  if len(set(specs)) < len(specs):
    raise ConfigError(f"config.drafters names a drafter twice: {list(cfg.drafter_specs)}")
  if cfg.siblings not in ("topk", "stochastic"):
    raise ConfigError(f"config.siblings must be topk or stochastic, got {cfg.siblings!r}")
  for t in cfg.trees:
    if t != AUTO:
      engine.fixed_tree(t, "config.trees:")
  if cfg.auto_candidates and engine.auto_candidates(cfg.auto_candidates) is None:
    raise ConfigError(f"config.auto_candidates must be '' (the static trees) or "
                      f"auto[:N1,..], got {cfg.auto_candidates!r}")


def _check_prompts(cfg: SweepConfig) -> None:
  if cfg.prompt_set not in pair.PROMPT_FILES:
    raise ConfigError(f"config.prompt_set must be one of {', '.join(pair.PROMPT_FILES)}, "
                      f"got {cfg.prompt_set!r}")
  if cfg.chat and cfg.prompt_tokens and not cfg.heldout_prompts:
    raise ConfigError("config.chat renders text with the chat template; config.prompt_tokens "
                      "are ids already")


def _check_suite(cfg: SweepConfig) -> None:
  suites = (*taskbench.SUITES, taskbench.LONG)
  if cfg.taskbench_suite not in suites:
    raise ConfigError(f"config.taskbench_suite must be one of {', '.join(suites)}, "
                      f"got {cfg.taskbench_suite!r}")
  cats = taskbench.suite_categories(cfg.taskbench_suite)
  for c in cfg.taskbench + ((cfg.taskbench_category,) if cfg.taskbench_category else ()):
    if c not in cats:
      raise ConfigError(f"config.taskbench: unknown category {c!r}; valid: {', '.join(cats)}")
  rows = tree_rows(cfg)
  if len(set(rows)) < len(rows):
    raise ConfigError(f"config.taskbench_trees names a row twice: {list(cfg.taskbench_trees)}")


def _check_contexts(cfg: SweepConfig) -> None:
  """Contexts run gamma sweeps of the long suite's prompts at each (or of
  prompt_tokens, tiled)."""
  if len(set(cfg.contexts)) < len(cfg.contexts):
    raise ConfigError(f"config.contexts names a context twice: {list(cfg.contexts)}")
  if cfg.contexts and (cfg.taskbench or cfg.trees):
    raise ConfigError("config.contexts runs one gamma sweep per context: leave config.taskbench "
                      "and config.trees empty")
  if cfg.prompt_tokens:
    return
  for c in cfg.contexts + ((cfg.context,) if cfg.context else ()):
    if cfg.taskbench_suite != taskbench.LONG:
      raise ConfigError("config.contexts takes its prompts from the long suite: set "
                        "config.taskbench_suite=long (or give config.prompt_tokens)")
    if c not in longsuite.CONTEXTS:
      raise ConfigError(f"config.contexts: the long suite has no prompts at context {c} "
                        f"(it has {', '.join(map(str, longsuite.CONTEXTS))})")


def _check_row_budgets(cfg: SweepConfig) -> None:
  """Each of row_budgets is default, auto or a budget N that some batch can
  hold (B <= N: every row's tail), spelled once."""
  if len(set(cfg.row_budgets)) < len(cfg.row_budgets):
    raise ConfigError(f"config.row_budgets names a budget twice: {list(cfg.row_budgets)}")
  for b in cfg.row_budgets:
    if b in (engine.ROWS_DEFAULT, AUTO):
      continue
    if not b.isdigit() or int(b) < min(cfg.batches):
      raise ConfigError(f"config.row_budgets: {b!r} is not default, auto or a verify budget N "
                        f"(tokens per step) of at least the smallest batch, {min(cfg.batches)}")
    engine.parse_rows(engine.rows_spec(max(cfg.gammas), b))


def row_budgets_at(cfg: SweepConfig, batch: int) -> list[str]:
  """The row budgets that apply at `batch`: default, auto, and each N >= B
  (a block of N tokens holds the B rows' tails)."""
  return [b for b in cfg.row_budgets if not b.isdigit() or int(b) >= batch]


def tree_rows(cfg: SweepConfig) -> list[tuple[str, str]]:
  """config.taskbench_trees ("DRAFTER@TREE", ...) -> [(drafter spec, tree
  spec)], each checked (the drafter parses, the tree is a fixed one, or
  auto[:N1,..]: --tree=auto's candidates, plan.candidate_trees, which the
  drafter can draft; one auto row per drafter)."""
  rows, autos = [], set()
  for row in cfg.taskbench_trees:
    drafter, sep, tree = row.rpartition("@")
    if not sep or not drafter or not tree:
      raise ConfigError(f"config.taskbench_trees: {row!r} is not DRAFTER@TREE "
                        "(e.g. eagle:smollm2-eagle@dynamic:4,4,16)")
    spec = engine.drafter(drafter).spec
    if tree.strip().startswith(AUTO):  # auto[:N1,..]: the drafter drafts every candidate
      try:
        engine.check_auto_tree(spec, tree)
      except ConfigError as e:
        raise ConfigError(f"config.taskbench_trees: {row!r}: {e}") from None
      if spec in autos:
        raise ConfigError(f"config.taskbench_trees: {row!r}: one auto row per drafter")
      autos.add(spec)
      rows.append((spec, tree))
      continue
    t = engine.fixed_tree(tree, f"config.taskbench_trees: {row!r}:")
    rows.append((spec, getattr(t, "spec", tree)))
  return rows
