"""One adaptive loop: the draft shape re-chosen between chunks of steps.

The device loop runs in chunks (speculative.spec_chunk: one program per
candidate of the plan, whatever the chunk's length) of 1, 2, 4, .. `every`
steps; between chunks a `Chooser` sees the chunk's records (`observe`) and
picks the next candidate (`choose(remaining, live)`: the most tokens any
live row still needs, and the live rows). Auto gamma
(autogamma.GammaChooser) and auto tree (autotree.TreeChooser) are two
choosers with their cost models; `Fixed` forces a schedule (warm-up,
calibration, tests). Every candidate continues one SpecState (its
drafter's state does not depend on the shape; what it carries between
steps is as wide as the widest candidate's: SpecConfig.carried); the
output buffer is as wide as the deepest candidate needs and the cache holds
the widest block, so nothing recompiles between chunks.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.decode import generation
from specjax.decode import speculative
from specjax.decode.plan import Plan
from specjax.errors import ConfigError
from specjax.metrics.stats import SpecStats
from specjax.metrics.timing import CompileWatch, block
from specjax.model import steps

EVERY = 8  # steps per chunk once warmed in: the shape is re-chosen this often


class Chooser(Protocol):
  """Picks the candidate of each chunk from what the run has seen."""

  def start(self, rows: int) -> None:
    """Before the run: refuses (ConfigError) what does not fit its `rows`
    (costs measured at another batch)."""

  def observe(self, name: str, records: dict[str, np.ndarray]) -> None:
    """The live row-steps of the chunk just run with candidate `name`
    (speculative.REC_FIELDS, each [entries], and each entry's loop `step`
    and batch `row`)."""

  def choose(self, remaining: int, live: int) -> str:
    """The next chunk's candidate; what it estimated goes to `estimates`."""

  estimates: list


@dataclasses.dataclass
class Fixed:
  """A forced schedule: chunk c runs names[c % len(names)]."""
  names: Sequence[str]
  estimates: list = dataclasses.field(default_factory=list)
  _chunk: int = 0

  def start(self, rows):
    del rows

  def observe(self, name, records):
    del name, records

  def choose(self, remaining, live):
    del remaining, live
    self._chunk += 1
    return self.names[(self._chunk - 1) % len(self.names)]


@dataclasses.dataclass
class AdaptiveResult(speculative.SpecResult):
  chosen: list[str] = dataclasses.field(default_factory=list)  # each loop step's candidate
  estimates: list = dataclasses.field(default_factory=list)    # the chooser's, per choice
  chooser: Any = None  # the chooser after the run (what it counted)


def generate(target: steps.Runner, draft: steps.Runner | None, prompts, n_predict: int,
             plan: Plan, chooser: Chooser, seed: int = 0, eos_id: int | None = None,
             every: int = EVERY, ctx_size: int | None = None,
             capacity: int | None = None, keep_state: bool = False) -> AdaptiveResult:
  """Speculative generation with the plan's candidate re-chosen between
  chunks (module docstring). Same keys, capacity rule and outputs as
  speculative.run (`keep_state` too): with one candidate it emits that
  candidate's tokens."""
  if every < 1:
    raise ConfigError(f"every (steps per choice) must be >= 1, got {every}")
  unknown = set(getattr(chooser, "names", ())) - set(plan.configs)
  if unknown:
    raise ConfigError(f"no candidate {sorted(unknown)[0]!r} in this run's "
                      f"{', '.join(plan.configs)}")
  chooser.start(len(prompts))
  dparams = plan.drafter.draft_params(target.params, draft)
  probs = {k: jnp.asarray(plan.accept_probs(k)) for k in plan.configs}
  eos = generation.NO_EOS if eos_id is None else int(eos_id)
  cap = plan.capacity(max(len(p) for p in prompts), n_predict, ctx_size, capacity)
  key = jax.random.PRNGKey(seed)
  b = len(prompts)
  chosen = []
  with CompileWatch() as cw:
    t0 = time.perf_counter()
    st, first = speculative.prefill(target, dparams, prompts, cap, key, plan.widest)
    prompt_s = time.perf_counter() - t0
    out = jnp.full((b, n_predict + plan.deepest + 1), eos, jnp.int32).at[:, 0].set(first)
    step_key = jax.random.fold_in(key, 1)
    t0 = time.perf_counter()
    count, done, rec = speculative.loop_start(out, eos, n_predict)
    i, start, chunk = jnp.int32(0), 0, 0
    remaining, rows = n_predict - 1, b
    while start < n_predict:
      name = chooser.choose(max(1, remaining), rows)
      i, st, out, count, done, rec = speculative.spec_chunk(
          target.params, dparams, st, out, count, done, i, rec, step_key, probs[name],
          jnp.int32(min(every, 2 ** chunk)), sc=plan.configs[name], n_predict=n_predict,
          eos_id=eos)
      end = int(i)  # waits for the chunk
      chosen += [name] * (end - start)
      # one host copy per chunk (slicing on device would compile a program per slice)
      done_h, count_h, rec_h = jax.device_get((done, count, rec))
      live = rec_h["live"][start:end].astype(bool)
      step, row = np.nonzero(live)
      chooser.observe(name, {**{k: v[start:end][live] for k, v in rec_h.items()},
                             "step": step + start, "row": row})
      live_rows = ~done_h
      if end == start or end >= n_predict or not live_rows.any():
        break
      remaining = n_predict - int(count_h[live_rows].min())
      rows = int(live_rows.sum())
      start, chunk = end, chunk + 1
    block(out)
    eval_s = time.perf_counter() - t0
  tokens, records = speculative.outputs(out, count, rec, len(chosen))
  # each entry's own gamma: the statistics (alpha) count the drafts each step asked for
  depth = np.asarray([plan.configs[k].gamma for k in chosen], np.int64)
  records = dataclasses.replace(records, gamma=records.n_drafted if plan.first.per_row
                                else depth[records.step])  # per-row: the length given
  stats = SpecStats.compute(records, gamma=plan.deepest, n_predict=sum(map(len, tokens)),
                            eval_s=eval_s)
  return AdaptiveResult(tokens=tokens, stats=stats, prompt_s=prompt_s, eval_s=eval_s,
                        compile_s=cw.seconds, records=records, chosen=chosen,
                        estimates=list(chooser.estimates), chooser=chooser,
                        state=st if keep_state else None)


def warm_up(target, draft, prompts, n_predict: int, plan: Plan, **kw) -> float:
  """Compiles every candidate's chunk program (a run forcing each in turn);
  returns the compile seconds. Later runs of the same shapes compile
  nothing, whatever they choose."""
  return sum(generate(target, draft, prompts, n_predict, plan, Fixed([name]), **kw).compile_s
             for name in plan.configs)


def step_times(target, draft, prompts, n_predict: int, plan: Plan, **kw) -> dict[str, float]:
  """Each candidate's seconds per step measured in this loop itself (a run
  forcing it: its chunks and host round trips included). Call after
  `warm_up`: a run that compiles raises (its time would not be a step's)."""
  out = {}
  for name in plan.configs:
    r = generate(target, draft, prompts, n_predict, plan, Fixed([name]), **kw)
    if r.compile_s:
      raise RuntimeError(f"calibration compiled {name}'s program: call warm_up first")
    out[name] = r.eval_s / max(1, len(r.chosen))
  return out
