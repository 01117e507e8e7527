"""Speculative decoding, like llama.cpp's `speculative` example.

Built-in defaults (random weights at the CPU pair's real shapes, no download):
  python experiments/speculative.py --gamma=4 --accept=bernoulli:0.8
Drafters, shapes and rules:
  --drafter=ngram | layerskip:6 | layerskip:0-5,9 | eagle[:PATH] | eagle3[:PATH]
  --tree=kary:2,3 | sequoia:16,4 | dynamic:10,6,60 | dynamic:4,4,16+ngram:8
  --accept=real | bernoulli:0.8 | fraction:0.8 | always | mean_length:3
Chat models, batches, shapes chosen at run time:
  --chat --system=TEXT       the prompt as a user turn through the chat template
  --prompt_file=F --n_parallel=4   one prompt per line (.jsonl: conversations)
  --gamma=auto --auto_set=1,2,4,8  gamma re-chosen every --auto_every steps
  --gamma=auto:rows[,max=G][,budget=N]  each row its own draft length, one packed
                                   verify of N tokens (docs/packed_verify.md)
  --tree=auto | auto:8,16,32       the tree re-chosen among chains and Sequoia's trees
Each run also times target-only generation on the same prompts and cache
capacity (--baseline), alternating over --reps, and prints the median
speedup; greedy with the real rule, it says where the outputs first differ
(in float32 they agree; docs/results.md for bfloat16). --json_out keeps every
row. Every flag is checked before a model loads (decode/plan.py); the flags
in full: docs/scripts.md.
"""

import dataclasses
import json
import statistics
import sys

import numpy as np
from absl import flags

from specjax.decode import adaptive
from specjax.decode import autogamma
from specjax.decode import autorows
from specjax.decode import autotree
from specjax.decode import plan
from specjax.decode import rows_step
from specjax.decode import rows_theory
from specjax.formats import checkpoint
from specjax import cli
from specjax.drafters import registry
from specjax.drafters import eagle
from specjax.decode import generation
from specjax.metrics import divergence
from specjax.metrics import schema
from specjax.decode import speculative
from specjax.model import steps
from specjax.formats import tokenizer
from specjax import workdir as wd
from specjax.errors import ConfigError

_MODEL = flags.DEFINE_string("model", "cpu-target", "Target: preset name, HF directory, orbax "
                             "directory or GGUF file.")
_MODEL_DRAFT = flags.DEFINE_string("model_draft", "cpu-draft", "Draft: preset name, HF directory, "
                                   "orbax directory or GGUF file (--drafter=model only).")
_DRAFTER = cli.define_drafter_flag()
_N_PREDICT = flags.DEFINE_integer("n_predict", 128, "Tokens to generate.", lower_bound=1)
_GAMMA = flags.DEFINE_string("gamma", "5", "gamma, the draft length: tokens drafted per step "
                             f"(1 to {cli.MAX_GAMMA}), or 'auto': chosen at run time from "
                             "--auto_set (measured costs, acceptance so far), or "
                             "'auto:rows[,max=G][,budget=N]': each row its own length.")
flags.DEFINE_alias("draft", "gamma")  # llama.cpp's name for it
_ACCEPT = flags.DEFINE_string("accept", "real", "Acceptance rule: real | always | bernoulli:P | "
                              "fraction:F | mean_length:L")
_P_MIN = flags.DEFINE_float("p_min", 0.0, "Stop drafting when the draft's top probability is below this.",
                            lower_bound=0.0, upper_bound=1.0)
_GEN = cli.GenerationFlags("Sampling seed (random-init seed of presets: seed, seed+1).")
_DTYPE_DRAFT = flags.DEFINE_enum(
    "dtype_draft", None, ["float32", "bfloat16", "float16", "f32", "bf16", "f16", "bf16-mixed",
                          "int8"], "The draft's dtype (e.g. int8 for a cheap draft); default: --dtype.")
_CTX = flags.DEFINE_integer("ctx_size", None, "Context: the longest sequence (prompt + n_predict) "
                            "allowed, and the KV cache's size; default: what the run needs "
                            "(within the target's max_seq_len).", lower_bound=1)
_LOOP = flags.DEFINE_enum("loop", "device", ["device", "host"],
                          "device: one lax.while_loop; host: jitted phases timed one by one.")
_BASELINE = flags.DEFINE_bool("baseline", True, "Also time target-only generation and print the speedup.")
_REPS = flags.DEFINE_integer("reps", 3, "Timed repetitions; target-only and speculative alternate, "
                             "medians reported.", lower_bound=1)
_IGNORE_EOS = flags.DEFINE_bool("ignore_eos", True, "Do not stop at end-of-sequence (fixed-length runs).")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write statistics, timings and every row's "
                                "prompt ids, tokens and baseline tokens as one JSON object.")
_TREE = flags.DEFINE_string(
    "tree", "chain", "Draft shape: chain (depth --gamma), a JSON list of rank paths "
    "'[[0],[1],[0,0]]' or a .json file of one, kary:K,D, sequoia:N,D[:p1,..] (p conditional: "
    "rank k accepted given ranks 0..k-1 rejected) or sequoia:N,D:marginal=w1,.. (Sequoia's "
    "vector: w_k = P(rank k is the accepted child); docs/trees.md), dynamic:K,D,N "
    "(EAGLE-2: per row, the N likeliest of the top-K expansions over D levels), auto[:N1,..] "
    "(model.tree.parse)")
_SIBLINGS = flags.DEFINE_enum("siblings", "topk", ["topk", "stochastic"],
                              "A tree's siblings: the draft's top-k, or i.i.d. draws from q.")
_AUTO_SET = flags.DEFINE_string("auto_set", "1,2,4,8", "The gammas --gamma=auto chooses from.")
_AUTO_CALIBRATE = flags.DEFINE_bool(
    "auto_calibrate", True, "--gamma=auto: time each gamma's loop step after the warm-up "
    "(one run per gamma) and choose from those step costs.")
_AUTO_EVERY = flags.DEFINE_integer("auto_every", autogamma.EVERY, "Steps between gamma choices (chunks of 1, 2, 4, .. up to this).",
                                   lower_bound=1)
_AUTO_COSTS = flags.DEFINE_string("auto_costs", None, "A sweep's costs.json to take the costs at "
                                  "this batch from, instead of measuring them at start.")
_EAGLE_HEAD = flags.DEFINE_string("eagle_head", "", "The head of --drafter=eagle: a directory "
                                  "written by experiments/train_eagle.py, or a shipped head's "
                                  "name; default: the head shipped for --model (stdlib-eagle for "
                                  "stdlib-target, smollm2-eagle for smollm2-135m).")


def _drafter():
  """--drafter, with --eagle_head for a bare 'eagle'."""
  d = registry.parse(_DRAFTER.value)
  if d.kind == "eagle" and ":" not in _DRAFTER.value:
    d = eagle.EagleDrafter(_EAGLE_HEAD.value)
  return d


def auto_costs(target, draft, batch, capacity, depth, pl: plan.Plan, sp):
  """The chooser's costs at this batch: from --auto_costs (--gamma=auto) or
  measured now."""
  if pl.auto == "tree":
    cands = autotree.trees_of(pl)
    return autotree.measure_costs(target, draft, batch, capacity, depth, cands, sp, pl.rule,
                                  drafter=pl.drafter)
  if _AUTO_COSTS.value:
    try:
      with open(_AUTO_COSTS.value) as f:
        d = json.load(f)["batches"][str(batch)]
    except (OSError, KeyError, ValueError):
      raise ConfigError(f"--auto_costs {_AUTO_COSTS.value} holds no costs at batch {batch} "
                        f"(a batch sweep's costs.json has them)") from None
    return autogamma.BatchCosts.from_dict(d)
  gammas = [autogamma.gamma_of(k) for k in pl.configs]
  return autogamma.measure_costs(target, draft, batch, capacity, depth, gammas, sp, pl.rule,
                                 drafter=pl.drafter)


def main(argv):
  del argv
  sp = _GEN.sampling()
  run_flags = plan.parse_flags(  # every flag checked before any model loads
      drafter=_drafter(), gamma=cli.parse_gamma(_GAMMA.value), rule=_ACCEPT.value,
      tree=_TREE.value, siblings=_SIBLINGS.value, sp=sp, p_min=_P_MIN.value,
      auto_set=_AUTO_SET.value)
  auto = run_flags.auto
  spelled = {"gamma": "--gamma=auto", "tree": "--tree=auto",
             plan.ROWS: "--gamma=auto:rows,budget=auto"}.get(auto)
  if auto and _LOOP.value != "device":
    raise ConfigError(f"{spelled} runs the device loop in chunks: no --loop=host")
  if auto in ("tree", plan.ROWS) and _AUTO_COSTS.value:
    raise ConfigError(f"{spelled} measures its costs at start: no --auto_costs")
  drafter = run_flags.drafter
  tcfg, tparams, tok = checkpoint.load_model(_MODEL.value, dtype=_GEN.dtype, seed=_GEN.seed)
  draft = None
  if drafter.needs_draft_model:
    dcfg, dparams, dtok = checkpoint.load_model(_MODEL_DRAFT.value,
                                                dtype=_DTYPE_DRAFT.value or _GEN.dtype,
                                                seed=_GEN.seed + 1, role="draft")
    plan.check_vocabularies(tcfg, dcfg)
    tokenizer.check_same_tokens(tok, dtok)
    draft = steps.Runner(dcfg, dparams)
  prompts = _GEN.prompts(tok, tcfg.vocab_size)
  pl = run_flags.resolve(tcfg, draft and draft.cfg, batch=len(prompts))
  eos = None if _IGNORE_EOS.value else (tok.eos_id if tok else tcfg.eos_token_id)
  target = steps.Runner(tcfg, tparams)
  # One capacity for both sides: attention cost grows with it.
  depth = max(len(p) for p in prompts)
  capacity = pl.capacity(depth, _N_PREDICT.value, ctx_size=_CTX.value)
  kw = dict(seed=_GEN.seed, eos_id=eos, capacity=capacity)
  n = _N_PREDICT.value
  progress(f"{len(prompts)} rows, {sum(map(len, prompts))} prompt tokens, cache capacity "
           f"{capacity}: a first run of each side compiles (excluded from the timings)")
  if auto == plan.ROWS:  # each budget's loop step timed, then N chosen between chunks
    compile_s, times, spec = autorows.prepare(target, draft, prompts, n, pl,
                                              every=_AUTO_EVERY.value, **kw)
    print("T(N), seconds per loop step (never falling with N): " + ", ".join(
        f"N={c.budget}: {1e3 * times[k]:.2f} ms" for k, c in pl.configs.items()))
  elif auto:
    cost = auto_costs(target, draft, len(prompts), capacity, depth, pl, sp)
    tune = autogamma if auto == "gamma" else autotree
    tune.check_batch(cost, len(prompts))
    akw = dict(every=_AUTO_EVERY.value, **kw)
    compile_s = adaptive.warm_up(target, draft, prompts, n, pl, **akw)
    if _AUTO_CALIBRATE.value:  # each candidate's loop step, timed in the loop itself
      cost = tune.calibrate(target, draft, prompts, n, cost, pl, **akw)
    chooser = autogamma.GammaChooser if auto == "gamma" else autotree.TreeChooser
    spec = lambda: adaptive.generate(target, draft, prompts, n, pl, chooser(cost, pl), **akw)
  else:
    spec = lambda: speculative.run(target, draft, prompts, n, pl, loop=_LOOP.value, **kw)
    compile_s = spec().compile_s
  base = lambda: generation.generate(target, prompts, n, sp, loop=_LOOP.value, **kw)
  compile_s += base().compile_s if _BASELINE.value else 0.0  # warm-up
  spec_tps, base_tps = [], []
  for i in range(_REPS.value):  # alternating, so both sides see the same machine state
    if _BASELINE.value:
      b = base()
      base_tps.append(b.n_decoded / b.eval_s)
    res = spec()
    spec_tps.append(res.stats.tokens_per_s)
    progress(f"repetition {i + 1}/{_REPS.value}: speculative {spec_tps[-1]:.2f} tokens/s"
             + (f", target-only {base_tps[-1]:.2f}" if base_tps else ""))
  _report(tcfg, pl, tok, prompts, res, b if _BASELINE.value else None,
          statistics.median(spec_tps), statistics.median(base_tps) if base_tps else None,
          capacity, compile_s, dparams=pl.drafter.draft_params(tparams, draft))


def progress(line: str) -> None:
  """A progress line on stderr (stdout keeps the report): long-context runs
  spend minutes in prefill and compiles before the first figure."""
  print(line, file=sys.stderr, flush=True)


def row_lines(res, auto: str = "") -> list[str]:
  """Per-row statistics of a batch run, then the loop's steps (a batch runs
  until its slowest row is done)."""
  rec = res.records
  lines = ["row | out tokens | steps | accepted | drafted | accept % | tokens/step"]
  for r in range(len(res.tokens)):
    sel = rec.row == r
    n_acc, n_dr = int(rec.n_acc[sel].sum()), int(rec.n_drafted[sel].sum())
    steps_r, kept = int(sel.sum()), int(rec.kept[sel].sum())
    lines.append(f"{r:3d} | {len(res.tokens[r]):10d} | {steps_r:5d} | {n_acc:8d} | {n_dr:7d} | "
                 f"{100 * n_acc / max(n_dr, 1):8.1f} | {kept / max(steps_r, 1):11.3f}")
  loop = int(rec.step.max()) + 1 if rec.step.size else 0
  lines.append(f"total: {len(res.tokens)} rows, {loop} loop steps (the slowest row), "
               f"{rec.step.size} row-steps, mean {rec.step.size / max(len(res.tokens), 1):.2f} per row")
  if getattr(res, "chosen", None) and auto == "gamma":
    used = np.bincount([autogamma.gamma_of(k) for k in res.chosen])
    lines.append("auto gamma: steps per gamma " + ", ".join(
        f"{g}: {n}" for g, n in enumerate(used) if n) + "; alpha estimates " + ", ".join(
            f"{a:.2f}" for a in res.estimates))
  elif getattr(res, "chosen", None) and auto == plan.ROWS:
    names = sorted(set(res.chosen), key=res.chosen.index)
    factors = getattr(getattr(res, "chooser", None), "factors", None) or [1.0]
    lines.append("auto budget: steps per candidate " + ", ".join(
        f"{k}: {res.chosen.count(k)}" for k in names)
        + f"; drafts kept / expected by the model at the last choice {factors[-1]:.2f}")
  elif getattr(res, "chosen", None):
    names = sorted(set(res.chosen), key=res.chosen.index)
    lines.append("auto tree: steps per tree " + ", ".join(
        f"{k}: {res.chosen.count(k)}" for k in names) + "; p by rank at the last choice "
        + (", ".join(f"{x:.2f}" for x in res.estimates[-1]) if res.estimates else "-"))
  return lines


def _report(tcfg, pl, tok, prompts, res, base, spec_tps, base_tps, capacity, compile_s,
            dparams):
  st = res.stats
  drafter, dcfg, rule = pl.drafter, pl.first.draft, pl.rule
  for p, out in zip(prompts, res.tokens):
    print(cli.detokenize(tok, p) + cli.detokenize(tok, out), flush=True)
    print()
  n_prompt = sum(len(p) for p in prompts)
  print(f"encoded {n_prompt:4d} tokens in {res.prompt_s:8.3f} seconds, speed: "
        f"{n_prompt / res.prompt_s:9.3f} t/s")
  print(f"decoded {st.n_kept:4d} tokens in {res.eval_s:8.3f} seconds, speed: "
        f"{st.tokens_per_s:9.3f} t/s (last repetition)")
  print()
  print("\n".join(st.summary_lines()))
  print()
  if len(prompts) > 1 or getattr(res, "chosen", None):
    print("\n".join(row_lines(res, pl.auto)))
    print()
  theory = budget = None
  if pl.first.per_row:  # --gamma=auto:rows: the tokens per step against the model's
    budget = ([pl.configs[k].budget for k in res.chosen] if getattr(res, "chosen", None)
              else rows_step.budget_of(pl.first, len(prompts)))
    theory = rows_theory.compare(res.records, budget, pl.first.gamma, len(prompts))
    print("\n".join(theory.lines()))
    print()
  own = drafter.own_params(dparams)  # not what it only reads of the target's
  if dcfg is None:
    draft = "no draft model"
  elif own < dcfg.num_params():
    draft = f"draft: {dcfg.name} ({own / 1e6:.1f} M params of its own; the rest: the target's)"
  else:
    draft = f"draft: {dcfg.name} ({own / 1e6:.1f} M params)"
  print(f"target: {tcfg.name} ({tcfg.num_params() / 1e6:.1f} M params), drafter {drafter}, "
        f"{draft}, {tcfg.precision}, accept rule {rule}, loop={_LOOP.value}, cache capacity "
        f"{capacity}")
  print(f"{'compile time':>18} = {1e3 * compile_s:10.2f} ms (excluded from all timings)")
  sp = _GEN.sampling()
  out = schema.run_record(
      st, target=tcfg.name, draft=dcfg.name if dcfg is not None else None,
      drafter=drafter.spec, precision=tcfg.precision, accept_rule=str(rule),
      temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, p_min=_P_MIN.value,
      seed=_GEN.seed, loop=_LOOP.value, capacity=capacity, reps=_REPS.value,
      spec_tps=spec_tps, prompt_s=res.prompt_s, compile_s=compile_s, env=wd.environment(),
      batch=len(prompts),
      **({"prompt_tokens": prompts[0], "tokens": res.tokens[0]} if len(prompts) == 1 else {}),
      **({"auto_set": sorted({autogamma.gamma_of(k) for k in res.chosen}),
          "auto_every": _AUTO_EVERY.value} if pl.auto == "gamma" else {}),
      **({"auto_trees": sorted(set(res.chosen)), "auto_every": _AUTO_EVERY.value}
         if pl.auto == "tree" else {}))
  print(f"{'speculative':>18} = {spec_tps:9.3f} tokens per second (median of {_REPS.value})")
  if base is not None:
    print(f"{'target-only':>18} = {base_tps:9.3f} tokens per second (median of {_REPS.value}, "
          f"alternating)")
    print(f"{'speedup':>18} = {spec_tps / base_tps:.3f}x (speculative t/s / target-only t/s)")
    out.update(baseline_tps=base_tps, speedup=spec_tps / base_tps)
    if len(prompts) == 1:
      out.update(baseline_tokens=base.tokens[0])
  # greedy with the real rule: where the outputs part from target-only, if they do
  claimed = base is not None and divergence.equality_claimed(sp.temperature, rule.simulated)
  if claimed:
    parts = [divergence.first_divergence(t, b) for t, b in zip(res.tokens, base.tokens)]
    print(divergence.summary_line(parts, _N_PREDICT.value, tcfg.precision))
    if len(prompts) == 1:
      out.update(first_divergence=parts[0])
  if _JSON_OUT.value:  # the run's record, then every row (not a run field: per row)
    rows = cli.row_records(prompts, res.tokens, base.tokens if base is not None else None,
                           equality_claimed=claimed)
    wd.write_json(_JSON_OUT.value, {**out, "rows": rows, **(
        {"per_row": dataclasses.asdict(theory),
         "per_row_steps": rows_theory.step_table(res.records, budget)}
        if theory is not None else {})})


if __name__ == "__main__":
  cli.run(main)
