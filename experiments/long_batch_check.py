"""Speculation's speedup against batch on long, mixed prompts, each prompt
prefilled once (issue 39; docs/long_context.md, "Measured at 4 K on mixed rows").

The sweep and experiments/speculative.py prefill a run's rows for every run;
at 4 K tokens a row's prefill is about a minute on 2 CPU cores, more than a
run's decode, so a batch sweep there is mostly prefill. Here each prompt of
the long suite at --context is prefilled once, alone; a batch's cache is
rows stacked (row r: prompt r mod n), and every run starts from a copy of
it: target-only decode and the speculative loop (speculative.start), one
untimed warm-up of each, then --reps alternating. A row's KV does not depend
on the batch that holds it, so a run is the run after its own prefill; the
tokens are checked equal to target-only's in every row. Times are decode
only, as the sweep's (eval_s): speedup = target-only s/token over
speculative s/token. Writes OUT/records.jsonl (the sweep's record fields
that context_plot.curves reads), OUT/log.txt, and from the records with the
cost surface's fit (--surface: its results.jsonl) OUT/summary.md (measured
beside predicted) and OUT/contexts.png (--plot_only: these alone). OUT keeps
its settings (settings.json): a rerun with the same ones skips the batches
already recorded, with others it is refused. --engine=torch runs the same
on PyTorch (torch_spec.TorchSpec, eager, the streaming draft on the
target's cache), its records drawn in PyTorch's panel beside its fit.
  python experiments/long_batch_check.py --context=4096 --batches=1,4,8 --out=/tmp/lbc
"""

import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from configs import sweep_gamma  # pylint: disable=wrong-import-position
from specjax import cli
from specjax import workdir as wd
from specjax.bench.backends import torch_drafts, torch_llama, torch_spec
from specjax.bench.studies import cost_surface_report
from specjax.bench.sweep import context_plot
from specjax.bench.sweep import prompts as sweep_prompts
from specjax.bench.sweep.config import SweepConfig
from specjax.decode import generation, plan as plans, speculative
from specjax.drafters import registry, streaming
from specjax.errors import ConfigError
from specjax.formats import checkpoint
from specjax.metrics.stats import Records, SpecStats
from specjax.metrics.timing import block
from specjax.model import steps
from specjax.model.sampling import SamplingParams

_CONTEXT = flags.DEFINE_integer("context", 4096, "The long suite's context (its prompts).")
_BATCHES = flags.DEFINE_list("batches", ["1", "4", "8"], "Rows per run.")
_DRAFTER = flags.DEFINE_string("drafter", "streaming:256,4", "A drafter with no draft model.")
_GAMMA = flags.DEFINE_integer("gamma", 4, "Draft length.")
_N_PREDICT = flags.DEFINE_integer("n_predict", 64, "Tokens per row.")
_REPS = flags.DEFINE_integer("reps", 2, "Timed repetitions (target-only first in even ones).")
_PROMPTS = flags.DEFINE_integer("prompts", 6, "The long suite's prompts at the context.")
_OUT = flags.DEFINE_string("out", "/tmp/long_batch_check", "Output folder.")
_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Target.")
_DTYPE = flags.DEFINE_string("dtype", "float32", "Its dtype.")
_SURFACE = flags.DEFINE_string(
    "surface", os.path.join(os.path.dirname(__file__), "..", "docs", "results", "cost_surface",
                            "quiet_daf84b8"),
    "A cost surface's workdir (experiments/cost_surface.py): the fit the predictions use.")
_ENGINE = flags.DEFINE_enum("engine", "xla", ["xla", "torch"],
                            "specjax's loop, or PyTorch's (torch_spec.TorchSpec, eager; "
                            "the streaming draft only).")
_ATTENTION = flags.DEFINE_enum("attention", "auto", ["auto", "blocked", "masked"],
                               "specjax's attention kernel (ModelConfig.attention); "
                               "auto: the backend's.")
_PLOT_ONLY = flags.DEFINE_bool("plot_only", False, "Only the summary and plot of OUT's records.")


def log(out: str, msg: str) -> None:
  line = f"{time.strftime('%H:%M:%S')} {msg}"
  print(line, flush=True)
  with open(os.path.join(out, "log.txt"), "a") as f:
    f.write(line + "\n")


def stack(trees):
  """Per-row pytrees (batch 1 each) stacked into one batch."""
  return jax.tree.map(lambda *xs: jnp.concatenate(xs, 0), *trees)


def copy(tree):
  return jax.tree.map(jnp.copy, tree)


class XlaRuns:
  """specjax's runs from the prompts' prefilled row caches (--engine=xla)."""

  def __init__(self, target, p, rows, cap: int):
    self.target, self.p, self.rows = target, p, rows
    self.dparams = p.sc.drafter.draft_params(target.params, None)
    self.logits, self.caches = [], []
    for row in rows:
      lg, ca = block(target.prefill([row], target.new_cache(1, cap)))
      self.logits.append(lg)
      self.caches.append(ca)

  def group(self, ix):
    return stack([self.logits[i] for i in ix]), stack([self.caches[i] for i in ix])

  def target_only(self, g, ix, n_predict: int):
    """(seconds, tokens per row) of one decode from a copy of the group's
    cache (made before the clock starts)."""
    del ix
    logits, cache = g[0], block(copy(g[1]))
    t0 = time.perf_counter()
    out, _ = block(generation.decode_loop(
        self.target.params, logits, cache, jax.random.PRNGKey(0), cfg=self.target.cfg,
        sp=SamplingParams(), n_predict=n_predict, eos_id=generation.NO_EOS))
    return time.perf_counter() - t0, jax.device_get(out).tolist()

  def spec(self, g, ix, n_predict: int):
    """(seconds, tokens per row, its Records) of one speculative run from a copy."""
    target, sc, key, dparams = self.target, self.p.sc, jax.random.PRNGKey(0), self.dparams
    st, first = speculative.start(target, dparams, [self.rows[i] for i in ix], g[0],
                                  copy(g[1]), key, sc)
    out = jnp.full((len(ix), n_predict + sc.gamma + 1), generation.NO_EOS, jnp.int32)
    out = out.at[:, 0].set(first)
    t0 = time.perf_counter()
    out, count, rec, _ = block(speculative.spec_loop(
        target.params, dparams, st, out, jax.random.fold_in(key, 1),
        jnp.asarray(self.p.accept_probs()), sc=sc, n_predict=n_predict,
        eos_id=generation.NO_EOS))
    secs = time.perf_counter() - t0
    tokens, records = speculative.outputs(out, count, rec)
    return secs, tokens, records


class TorchRuns:
  """PyTorch's runs (torch_spec.TorchSpec, eager, with the streaming draft on
  the target's cache) from the prompts' prefilled row caches (--engine=torch)."""

  def __init__(self, cfg, params, drafter, gamma: int, rows, cap: int):
    tmodel = torch_llama.TorchLlama(cfg, params, compile=False)
    self.engine = torch_spec.TorchSpec(tmodel, torch_drafts.TorchStreamingDraft(
        tmodel, drafter.window, drafter.sinks))
    self.rows, self.gamma, self.cap = rows, gamma, cap
    self.caches, self.first = [], []
    for row in rows:
      cache = tmodel.new_cache(1, cap)
      self.first.append(tmodel.prefill([row], cache))
      self.caches.append(cache)

  def group(self, ix):
    torch = self.engine.torch
    return (torch_llama.Cache.stack([self.caches[i] for i in ix]),
            torch.cat([self.first[i] for i in ix]))

  def target_only(self, g, ix, n_predict: int):
    r = self.engine.generate_target([self.rows[i] for i in ix], n_predict, capacity=self.cap,
                                    start=(g[0].clone(), g[1]))
    return r.eval_s, r.tokens

  def spec(self, g, ix, n_predict: int):
    r = self.engine.generate([self.rows[i] for i in ix], n_predict, self.gamma,
                             capacity=self.cap, start=(g[0].clone(), g[1], None))
    return r.eval_s, r.tokens, r.records


def groups(n_prompts: int, batch: int) -> list[list[int]]:
  """The prompt indices of each run: batch 1 every prompt alone, batch B one
  group of B rows, row r prompt r mod n (the sweep's batch_prompts, uncut)."""
  if batch == 1:
    return [[i] for i in range(n_prompts)]
  return [[r % n_prompts for r in range(batch)]]


def measure(out, engine, p, n_prompts: int, batch: int, n_predict: int, reps: int) -> dict:
  """One batch's record: every group warmed up once, then reps alternating;
  alpha and tokens per step pooled over the last repetition's runs."""
  runs = [(ix, engine.group(ix)) for ix in groups(n_prompts, batch)]
  base_t, spec_t, last = [], [], []
  for rep in range(-1, reps):  # -1: the warm-up (compiles), untimed
    b_s = s_s = 0.0
    order = ("base", "spec") if rep % 2 == 0 else ("spec", "base")
    recs, n_kept = [], 0
    for ix, g in runs:
      for what in order:
        if what == "base":
          secs, base_tok = engine.target_only(g, ix, n_predict)
          b_s += secs
        else:
          secs, spec_tok, r = engine.spec(g, ix, n_predict)
          s_s += secs
          recs.append(r)
          n_kept += sum(map(len, spec_tok)) - len(ix)
      if [r[:n_predict] for r in spec_tok] != [r[:n_predict] for r in base_tok]:
        raise SystemExit(f"batch {batch}: speculative tokens differ from target-only's")
    log(out, f"batch {batch} rep {rep}: target-only {b_s:.1f} s, speculative {s_s:.1f} s")
    if rep >= 0:
      base_t.append(b_s / (len(runs) * batch * (n_predict - 1)))
      spec_t.append(s_s / n_kept)
      last = recs
  st = SpecStats.compute(Records.concat(last), gamma=p.sc.gamma, n_predict=n_predict)
  return dict(drafter=p.sc.drafter.spec, gamma=p.sc.gamma, batch=batch, temperature=0.0,
              alpha=st.alpha, tokens_per_step=st.tokens_per_step, n_steps=st.n_steps,
              speedup=statistics.median(b / s for b, s in zip(base_t, spec_t)),
              speedup_reps=[b / s for b, s in zip(base_t, spec_t)],
              baseline_tps=1 / statistics.median(base_t), spec_tps=1 / statistics.median(spec_t),
              n_predict=n_predict * len(runs) * batch, n_prompts=n_prompts, reps=reps,
              load_avg=wd.load_avg())


def report(out: str, surface: str) -> None:
  """OUT/summary.md and OUT/contexts.png: each batch measured beside its
  engine's fit's prediction at its alpha, and the other engine's."""
  recs = wd.read_jsonl(os.path.join(out, "records.jsonl"))
  fit = cost_surface_report.surface_fit(wd.read_jsonl(os.path.join(surface, wd.RESULTS)))
  lines = ["| engine | context | batch | alpha | tokens/step | measured | predicted (its "
           "engine's fit) | error | predicted (the other's fit) | KV share of T(B, 1) |",
           "|---|" + "---:|" * 9]
  xla_first = lambda r: (r.get("engine", "xla") != "xla", r["context"], r["batch"])
  for r in sorted(recs, key=xla_first):
    own = r.get("engine", "xla")  # records before the torch engine: xla
    x, t = fit.speedup(own, r), fit.speedup("torch" if own == "xla" else "xla", r)
    lines.append(f"| {own} | {r['context']} | {r['batch']} | {r['alpha']:.3f} | "
                 f"{r['tokens_per_step']:.2f} | {r['speedup']:.3f}x | {x:.3f}x | "
                 f"{100 * (x - r['speedup']) / r['speedup']:+.0f}% | {t:.3f}x | "
                 f"{fit.kv_share(own, r['context'], r['batch']):.2f} |")
  with open(os.path.join(out, wd.SUMMARY), "w") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))
  context_plot.plot(recs, os.path.join(out, "contexts.png"), fit)


def batches() -> list[int]:
  try:
    out = [int(b) for b in _BATCHES.value]
  except ValueError:
    raise ConfigError(f"--batches must be whole numbers, got {','.join(_BATCHES.value)}") from None
  if not out or min(out) < 1:
    raise ConfigError(f"--batches must be positive, got {','.join(_BATCHES.value)}")
  return out


def main(argv):
  del argv
  out = _OUT.value
  wd.check_output_dir(out, "--out")
  fit_records = os.path.join(_SURFACE.value, wd.RESULTS)
  if not os.path.isfile(fit_records):
    raise ConfigError(f"--surface {_SURFACE.value} holds no {wd.RESULTS} (a cost surface's "
                      f"workdir: experiments/cost_surface.py)")
  records = os.path.join(out, "records.jsonl")
  if _PLOT_ONLY.value:
    if not os.path.isfile(records):
      raise ConfigError(f"--plot_only: {records} does not exist")
    report(out, _SURFACE.value)
    return
  todo = batches()
  os.makedirs(out, exist_ok=True)
  settings = dict(context=_CONTEXT.value, drafter=_DRAFTER.value, gamma=_GAMMA.value,
                  n_predict=_N_PREDICT.value, reps=_REPS.value, prompts=_PROMPTS.value,
                  model=_MODEL.value, dtype=_DTYPE.value, engine=_ENGINE.value)
  if _ATTENTION.value != "auto":  # older folders, made with the backend's kernel, still resume
    settings["attention"] = _ATTENTION.value
  if _ENGINE.value == "torch" and not isinstance(registry.parse(_DRAFTER.value),
                                                 streaming.StreamingDrafter):
    raise ConfigError(f"--engine=torch runs the streaming draft, not {_DRAFTER.value}")
  if wd.check_stage(os.path.join(out, "settings.json"), settings, [records],
                    "choose another --out"):
    done = {r["batch"] for r in wd.read_jsonl(records)}
    todo = [b for b in todo if b not in done]
    log(out, f"resuming: batches {sorted(done)} already recorded")
  cfg, params, tok = checkpoint.load_model(_MODEL.value, dtype=_DTYPE.value)
  if _ATTENTION.value != "auto":
    cfg = cfg.replace(attention=_ATTENTION.value)
  scfg = SweepConfig.from_mapping(sweep_gamma.get_config("long_context")).replace(
      contexts=(), context=_CONTEXT.value, taskbench_prompts=_PROMPTS.value)
  rows = sweep_prompts.sweep_prompts(scfg, tok, cfg.vocab_size)
  p = plans.resolve(cfg, None, drafter=_DRAFTER.value, gamma=_GAMMA.value, rule="real")
  cap = p.capacity(max(map(len, rows)), _N_PREDICT.value)
  log(out, f"{len(rows)} prompts of {[len(x) for x in rows]} tokens; capacity {cap}; "
           f"env {json.dumps(wd.environment())[:300]}")
  t0 = time.perf_counter()
  if _ENGINE.value == "torch":
    engine = TorchRuns(cfg, params, p.sc.drafter, _GAMMA.value, rows, cap)
  else:
    engine = XlaRuns(steps.Runner(cfg, params), p, rows, cap)
  log(out, f"{_ENGINE.value}: {len(rows)} prefills in {time.perf_counter() - t0:.1f} s")
  for b in todo:
    rec = dict(measure(out, engine, p, len(rows), b, _N_PREDICT.value, _REPS.value),
               context=_CONTEXT.value, prompt_lens=[len(x) for x in rows],
               target=cfg.name, precision=_DTYPE.value, engine=_ENGINE.value,
               attention=cfg.attention)
    wd.append_jsonl(os.path.join(out, "records.jsonl"), [rec])
    log(out, f"batch {b}: speedup {rec['speedup']:.3f}x ({rec['speedup_reps']}), alpha "
             f"{rec['alpha']:.3f}, tokens/step {rec['tokens_per_step']:.2f}")
  report(out, _SURFACE.value)


if __name__ == "__main__":
  cli.run(main)
