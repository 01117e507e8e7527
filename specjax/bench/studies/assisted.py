"""Speculative decoding against HF assisted generation, on the same weights.

For one pair and one prompt, greedy, no EOS stop, `compare` runs HF's
target.generate without and with assistant_model=draft (num_assistant_tokens
= gamma, the confidence early stop off; or HF's default schedule) and
specjax's generation.generate and speculative.generate (rule real; or
per-row lengths, budget=auto), on `hf.to_torch_model` of the very
params specjax runs: the four token lists should be identical, and every
divergence is reported with its first index. Each call is warmed up once
(compile time apart), then the four are timed `reps` times interleaved;
medians. tokens/s here counts all n_predict tokens over the whole generate
call, prefill included (HF has no prefill timer), with specjax's usual
decode-only tokens/s beside it; speedup = speculative / baseline of the same
engine; accept_rate = n_accept / n_drafted. docs/engines.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
from typing import Any, Callable

from specjax.decode import autorows
from specjax.decode import generation
from specjax.formats import hf
from specjax.decode import plan, speculative
from specjax.model import steps
from specjax.metrics import divergence
from specjax.metrics import timing
from specjax.errors import ConfigError
from specjax.model.sampling import SamplingParams

ENGINES = ("hf", "specjax")
PAD_ID = 0  # HF wants a pad id; batch 1 never pads

# ---------------------------------------------------------------- divergence


@dataclasses.dataclass(frozen=True)
class Divergence:
  """Where two token lists first differ."""
  index: int          # first differing position (or the shorter list's length)
  a: int | None       # the first list's token there; None: the list ended
  b: int | None

  def __str__(self) -> str:
    show = lambda t: "end" if t is None else str(t)
    return f"first differs at token {self.index}: {show(self.a)} vs {show(self.b)}"


def first_divergence(a, b) -> Divergence | None:
  """None when the token lists are identical, else where they first differ
  (divergence.first_divergence) and the two tokens there."""
  n = divergence.first_divergence(a, b)
  if n is None:
    return None
  return Divergence(n, int(a[n]) if n < len(a) else None, int(b[n]) if n < len(b) else None)

# ---------------------------------------------------------------- HF side


SCHEDULES = ("constant", "default")  # HF's assistant: gamma every step, or HF's own schedule
ASSISTANT_FIELDS = ("num_assistant_tokens", "num_assistant_tokens_schedule",
                    "assistant_confidence_threshold")


def configure_assistant(draft_pt, gamma: int, schedule: str = "constant") -> None:
  """'constant': HF's assistant proposes exactly gamma tokens every step (a
  constant schedule, no confidence-based early stop; transformers >= 4.45).
  'default': what a user gets who sets nothing, a fresh GenerationConfig's
  values (the schedule that shrinks the draft after rejections, and the
  confidence stop)."""
  if schedule not in SCHEDULES:
    raise ConfigError(f"the HF assistant schedule must be one of {', '.join(SCHEDULES)}, "
                      f"got {schedule!r}")
  gc = draft_pt.generation_config
  if schedule == "default":
    from transformers import GenerationConfig  # pylint: disable=import-outside-toplevel
    fresh = GenerationConfig()
    for name in ASSISTANT_FIELDS:
      setattr(gc, name, getattr(fresh, name))
    return
  gc.num_assistant_tokens = int(gamma)
  gc.num_assistant_tokens_schedule = "constant"
  gc.assistant_confidence_threshold = 0.0


class StepCounter(contextlib.AbstractContextManager):
  """Counts the target's forward calls in an HF assisted generate.

  Call i (i > 0) feeds [last, candidates] (T_i = candidates + 1); the first
  call feeds the prompt plus the first candidates. Hence, for N generated
  tokens: n_steps = calls, n_drafted = sum T_i - prompt - (calls - 1),
  n_accept = N - n_steps (each step emits its matches plus one token).
  """

  def __init__(self, model):
    self.model = model
    self.widths: list[int] = []
    self._handle = None

  def _hook(self, module, args, kwargs):
    del module
    ids = kwargs.get("input_ids", args[0] if args else None)
    self.widths.append(int(ids.shape[1]))

  def __enter__(self):
    self.widths = []
    self._handle = self.model.register_forward_pre_hook(self._hook, with_kwargs=True)
    return self

  def __exit__(self, *exc):
    self._handle.remove()
    return False

  def stats(self, prompt_len: int, n_generated: int) -> dict[str, int]:
    n_steps = len(self.widths)
    return {"n_steps": n_steps,
            "n_drafted": sum(self.widths) - prompt_len - (n_steps - 1),
            "n_accept": n_generated - n_steps}


def hf_generate(model, prompt: list[int], n_predict: int, assistant=None) -> list[int]:
  """Greedy HF generate of exactly n_predict tokens (EOS ignored); ids only."""
  import torch  # pylint: disable=import-outside-toplevel
  ids = torch.tensor([prompt], dtype=torch.long)
  kw = {} if assistant is None else {"assistant_model": assistant}
  with torch.inference_mode():
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=n_predict, min_new_tokens=n_predict,
                         eos_token_id=None, pad_token_id=PAD_ID, **kw)
  return out[0, len(prompt):].tolist()


def torch_models(target: steps.Runner, draft: steps.Runner, attn: str = "sdpa"):
  """(target, draft) as transformers LlamaForCausalLM, via hf.to_torch_model.

  A draft with the target's weights still gets its own torch module, so its
  forwards are not counted as the target's. `attn` is HF's attention kernel
  ("sdpa", HF's default, or "eager").
  """
  out = []
  for m in (target, draft):
    pt = hf.to_torch_model(m.cfg, m.params)
    if hasattr(pt, "set_attn_implementation"):
      pt.set_attn_implementation(attn)
    else:  # transformers < 4.48
      pt.config._attn_implementation = attn  # pylint: disable=protected-access
    out.append(pt)
  return tuple(out)

# ---------------------------------------------------------------- timing


@dataclasses.dataclass
class Measured:
  """One generate call: its warm-up output, its timed outputs and timing."""
  first: Any
  outputs: list[Any]
  timing: timing.Timing


def time_interleaved(calls: dict[str, Callable[[], Any]], reps: int) -> dict[str, Measured]:
  """Warms each call up once (untimed, compile counted), then times all of
  them `reps` times, interleaved per repetition.

  Raises:
    RuntimeError: something compiled during the timed repetitions.
  """
  if reps < 1:
    raise ConfigError(f"reps must be >= 1, got {reps}")
  out = {}
  for name, call in calls.items():
    with timing.CompileWatch() as cw:
      first = timing.block(call())
    out[name] = Measured(first, [], timing.Timing([], cw.seconds, cw.count))
  with timing.CompileWatch() as late:
    for _ in range(reps):
      for name, call in calls.items():
        res, secs = timing.timed(call)
        out[name].outputs.append(res)
        out[name].timing.times.append(secs)
  if late.count:
    raise RuntimeError(f"{late.count} compilation(s) during timed repetitions: "
                       f"{dict(late.names)}")
  return out

# ---------------------------------------------------------------- comparison


@dataclasses.dataclass
class EngineResult:
  """One engine's baseline and speculative runs on one pair."""
  engine: str                      # "hf" | "specjax"
  n_predict: int                   # generated tokens per call (first included)
  baseline_tokens: list[int]
  spec_tokens: list[int]
  baseline: timing.Timing          # whole generate call, seconds
  spec: timing.Timing
  n_steps: int                     # target verify calls
  n_drafted: int
  n_accept: int
  decode: dict[str, float] | None = None  # specjax: decode-only medians

  @property
  def baseline_tps(self) -> float:
    return self.n_predict / self.baseline.median

  @property
  def spec_tps(self) -> float:
    return self.n_predict / self.spec.median

  @property
  def speedup(self) -> float:
    return self.spec_tps / self.baseline_tps

  @property
  def accept_rate(self) -> float:
    return self.n_accept / self.n_drafted if self.n_drafted else 0.0

  def to_dict(self) -> dict[str, Any]:
    return {"engine": self.engine, "baseline_tokens_per_s": self.baseline_tps,
            "spec_tokens_per_s": self.spec_tps, "speedup": self.speedup,
            "accept_rate": self.accept_rate, "n_steps": self.n_steps,
            "n_drafted": self.n_drafted, "n_accept": self.n_accept,
            "baseline": {**self.baseline.to_dict(), "times_s": self.baseline.times},
            "spec": {**self.spec.to_dict(), "times_s": self.spec.times},
            "decode_only": self.decode,
            "baseline_tokens": self.baseline_tokens, "spec_tokens": self.spec_tokens}


@dataclasses.dataclass
class PairResult:
  """Both engines on one draft/target pair, and every token divergence."""
  pair: str
  target: str
  draft: str
  gamma: int
  prompt: list[int]
  capacity: int                    # specjax's cache slots (HF's cache grows)
  torch_threads: int
  hf_attn: str
  engines: dict[str, EngineResult]
  divergences: dict[str, Divergence | None]
  hf_schedule: str = "constant"    # SCHEDULES
  specjax_gamma: str = ""          # specjax's, where not gamma (per-row: auto:rows,..)

  @property
  def identical(self) -> bool:
    return all(d is None for d in self.divergences.values())

  def to_dict(self) -> dict[str, Any]:
    return {"pair": self.pair, "target": self.target, "draft": self.draft,
            "gamma": self.gamma, "hf_schedule": self.hf_schedule,
            "specjax_gamma": self.specjax_gamma or str(self.gamma), "prompt_tokens": self.prompt,
            "n_predict": self.engines["hf"].n_predict, "capacity": self.capacity,
            "torch_threads": self.torch_threads, "hf_attn": self.hf_attn,
            "tokens_identical": self.identical,
            "divergences": {k: None if d is None else dataclasses.asdict(d)
                            for k, d in self.divergences.items()},
            "engines": {k: e.to_dict() for k, e in self.engines.items()}}


def divergences(engines: dict[str, EngineResult]) -> dict[str, Divergence | None]:
  """The four comparisons that matter; the first is the issue's requirement."""
  h, s = engines["hf"], engines["specjax"]
  return {
      "speculative: specjax vs hf": first_divergence(s.spec_tokens, h.spec_tokens),
      "baseline: specjax vs hf": first_divergence(s.baseline_tokens, h.baseline_tokens),
      "hf: assisted vs baseline": first_divergence(h.spec_tokens, h.baseline_tokens),
      "specjax: speculative vs baseline": first_divergence(s.spec_tokens, s.baseline_tokens),
  }


def _check_length(name: str, tokens: list[int], n: int) -> None:
  if len(tokens) != n:
    raise RuntimeError(f"{name} generated {len(tokens)} tokens, expected {n}")


def _hf_result(m: dict[str, Measured], n: int) -> EngineResult:
  base, spec = m["hf/baseline"], m["hf/speculative"]
  return EngineResult("hf", n, base.first, spec.first[0], base.timing, spec.timing,
                      **spec.first[1])


def _specjax_result(m: dict[str, Measured], n: int) -> EngineResult:
  base, spec = m["specjax/baseline"], m["specjax/speculative"]
  st = spec.first.stats
  med = lambda outs: statistics.median(r.eval_s for r in outs)
  decode = {"baseline_tokens_per_s": (n - 1) / med(base.outputs),
            "spec_tokens_per_s": (n - 1) / med(spec.outputs),
            "baseline_prefill_s": statistics.median(r.prompt_s for r in base.outputs),
            "spec_prefill_s": statistics.median(r.prompt_s for r in spec.outputs),
            "baseline_compile_s": base.first.compile_s,
            "spec_compile_s": spec.first.compile_s}
  decode["speedup"] = decode["spec_tokens_per_s"] / decode["baseline_tokens_per_s"]
  return EngineResult("specjax", n, base.first.tokens[0], spec.first.tokens[0], base.timing,
                      spec.timing, st.n_steps, st.n_drafted, st.n_accept, decode)


def rows_call(target: steps.Runner, draft: steps.Runner, prompt: list[int], n_predict: int,
              gamma: str, capacity: int) -> Callable[[], Any]:
  """specjax's per-row call (gamma 'auto:rows,..,budget=auto', the model
  drafter): its candidates compiled and their loop steps timed now
  (autorows.prepare), then one adaptive run per call."""
  pl = plan.parse_flags(drafter="model", gamma=gamma).resolve(target.cfg, draft.cfg, batch=1)
  if pl.auto != plan.ROWS:
    raise ConfigError(f"specjax's per-row run needs budget=auto (auto:rows,max=G,budget=auto), "
                      f"got {gamma!r}")
  return autorows.prepare(target, draft, [prompt], n_predict, pl, capacity=capacity)[2]


def compare(target: steps.Runner, draft: steps.Runner, prompt: list[int], n_predict: int,
            gamma: int = 4, reps: int = 3, pair: str = "", hf_models=None,
            hf_attn: str = "sdpa", hf_schedule: str = "constant",
            specjax_gamma: int | str | None = None) -> PairResult:
  """Both engines, baseline and speculative, on one pair (greedy, no EOS).

  Args:
    target, draft: specjax models; HF gets the same weights.
    prompt: token ids (batch 1: HF assisted generation supports no more).
    n_predict: tokens to generate, the first (from the prompt) included.
    gamma: draft tokens per step (HF's constant schedule; specjax's default).
    reps: timed repetitions of each call, after one untimed warm-up.
    pair: a label for the pair.
    hf_models: (target, draft) torch models to reuse; default: built with
      `torch_models(target, draft, hf_attn)`. The torch draft's
      generation_config is set by `configure_assistant(draft, gamma, hf_schedule)`.
    hf_schedule: SCHEDULES: gamma every step, or HF's own default schedule.
    specjax_gamma: specjax's draft length, when not `gamma`: an int, or
      per-row lengths 'auto:rows,max=G,budget=auto' (rows_call).
  Returns:
    a PairResult; check `.identical` / `.divergences`.
  """
  import torch  # pylint: disable=import-outside-toplevel
  sj_gamma = gamma if specjax_gamma is None else specjax_gamma
  rows = isinstance(sj_gamma, str)
  width = plan.parse_rows(sj_gamma)[0] if rows else sj_gamma
  plan.SpecConfig(target.cfg, draft.cfg, width)  # vocab and gamma checks
  pt_target, pt_draft = hf_models or torch_models(target, draft, hf_attn)
  configure_assistant(pt_draft, gamma, hf_schedule)
  # Tight: specjax attends over every cache slot, HF's cache holds the sequence.
  capacity = generation.plan_capacity(target.cfg, len(prompt), n_predict,
                                      extra=max(gamma, width),
                                      ctx_size=len(prompt) + n_predict)
  counter = StepCounter(pt_target)
  spec = (rows_call(target, draft, prompt, n_predict, sj_gamma, capacity) if rows else
          lambda: speculative.generate(target, draft, [prompt], n_predict, sj_gamma,
                                       sp=SamplingParams(), rule="real", capacity=capacity))

  def hf_spec():
    with counter:
      toks = hf_generate(pt_target, prompt, n_predict, assistant=pt_draft)
    return toks, counter.stats(len(prompt), len(toks))

  calls = {
      "hf/baseline": lambda: hf_generate(pt_target, prompt, n_predict),
      "hf/speculative": hf_spec,
      "specjax/baseline": lambda: generation.generate(target, [prompt], n_predict,
                                                      capacity=capacity),
      "specjax/speculative": spec,
  }
  m = time_interleaved(calls, reps)
  engines = {"hf": _hf_result(m, n_predict),
             "specjax": _specjax_result(m, n_predict)}
  for e in engines.values():
    _check_length(f"{e.engine} baseline", e.baseline_tokens, n_predict)
    _check_length(f"{e.engine} speculative", e.spec_tokens, n_predict)
  return PairResult(pair or f"{target.cfg.name}/{draft.cfg.name}", target.cfg.name,
                    draft.cfg.name, gamma, list(prompt), capacity, torch.get_num_threads(),
                    pt_target.config._attn_implementation,  # pylint: disable=protected-access
                    engines, divergences(engines), hf_schedule,
                    "" if specjax_gamma is None else str(specjax_gamma))

# ---------------------------------------------------------------- report

TABLE_COLUMNS = ("engine", "pair", "baseline t/s", "speculative t/s", "speedup", "accept rate",
                 "tokens identical", "decode-only base t/s", "decode-only spec t/s")


def _identical_cell(r: PairResult, engine: str) -> str:
  """'yes', or which comparison of this row's speculative tokens failed first."""
  other = "hf" if engine == "specjax" else "specjax"
  own = "hf: assisted vs baseline" if engine == "hf" else "specjax: speculative vs baseline"
  for label, key in ((f"vs {other}", "speculative: specjax vs hf"), ("vs own baseline", own)):
    d = r.divergences[key]
    if d is not None:
      return f"no ({label}: token {d.index})"
  return "yes"


def table_rows(results: list[PairResult]) -> list[list[str]]:
  rows = []
  for r in results:
    for name in ENGINES:
      e = r.engines[name]
      dec = e.decode or {}
      fmt = lambda k: f"{dec[k]:.2f}" if k in dec else "-"
      rows.append([name, r.pair, f"{e.baseline_tps:.2f}", f"{e.spec_tps:.2f}",
                   f"{e.speedup:.3f}x", f"{100 * e.accept_rate:.1f}%", _identical_cell(r, name),
                   fmt("baseline_tokens_per_s"), fmt("spec_tokens_per_s")])
  return rows


def goal(result: PairResult) -> dict[str, Any]:
  """The issue's performance goal on a draft = target pair: specjax's speedup
  over its own baseline >= HF assisted generation's over HF's baseline."""
  s, h = result.engines["specjax"].speedup, result.engines["hf"].speedup
  return {"pair": result.pair, "gamma": result.gamma, "specjax_speedup": s,
          "hf_speedup": h, "holds": s >= h}
