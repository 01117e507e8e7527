"""How often greedy speculative tokens part from greedy target-only tokens, by precision.

  python experiments/divergence_study.py --out_dir=/tmp/divergence
  python experiments/divergence_study.py --out_dir=/tmp/divergence --dtypes=bfloat16       --prompt_sets=continuation --n_prompts=6 --n_predict=96

For each precision (--dtypes) the shipped pair (--model, --model_draft) runs
every shipped held-out prompt (pair.shipped_prompts: --prompt_sets) greedy,
target-only (generation.generate) and speculative with the real rule
(speculative.generate, --gamma), as experiments/speculative.py runs one
prompt at --temp=0: batch 1, no EOS stop, one cache capacity for both.
Per prompt: `first_divergence` (metrics/divergence.py) and, where they part,
the target's top-2 logit gap there (one full forward over the prompt and the
common prefix, in the same precision), also in units of bfloat16's spacing
at the top logit. Why they part, and the figures: docs/results.md, "Greedy
equality and precision".

Outputs in --out_dir: divergence.jsonl (one line per prompt and precision,
appended as each finishes; a rerun skips what the same models measured) and
summary.md (per precision: prompts, how many part, the first divergence,
the median gap; every parting prompt; the machine and commit).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np
from absl import flags

from specjax import cli
from specjax import workdir as wd
from specjax.bench import tables
from specjax.decode import generation
from specjax.decode import plan, speculative
from specjax.formats import checkpoint
from specjax.metrics import divergence
from specjax.model import config
from specjax.model import steps
from specjax.train import pair

_MODEL = flags.DEFINE_string("model", "stdlib-target", "Target (as speculative.py's --model).")
_MODEL_DRAFT = flags.DEFINE_string("model_draft", "stdlib-draft", "Draft model.")
_DTYPES = flags.DEFINE_list("dtypes", ["bfloat16", "bf16-mixed", "float32"],
                            "Precisions, each run for both models (as --dtype).")
_SETS = flags.DEFINE_list("prompt_sets", ["continuation", "editing"],
                          "Shipped held-out prompt sets (pair.shipped_prompts).")
_N_PROMPTS = flags.DEFINE_integer("n_prompts", 0, "First N prompts of each set (0: all).",
                                  lower_bound=0)
_N_PREDICT = flags.DEFINE_integer("n_predict", 96, "Tokens per prompt.", lower_bound=1)
_GAMMA = flags.DEFINE_integer("gamma", 5, "Draft length (speculative.py's default).",
                              lower_bound=1, upper_bound=cli.MAX_GAMMA)
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Where divergence.jsonl and summary.md go.",
                               required=True)

BF16_MANTISSA = 7  # stored bits: spacing 2^(e - 7) in [2^e, 2^(e+1))


def near_tie(runner: steps.Runner, prefix: list[int], spec_tok: int, base_tok: int):
  """The target's logits after `prefix` (one full forward, runner's precision):
  top-2 gap, target-only's token minus speculative's token, both also in
  bfloat16 spacings at the top logit."""
  cache = runner.new_cache(1, generation.plan_capacity(runner.cfg, len(prefix), 1))
  logits, _ = runner.prefill([prefix], cache)
  row = np.asarray(logits[0], np.float64)  # [V]
  top2 = np.sort(row)[-2:]
  step = 2.0 ** (np.floor(np.log2(abs(top2[1]) or 1.0)) - BF16_MANTISSA)
  gap, pair_gap = float(top2[1] - top2[0]), float(row[base_tok] - row[spec_tok])
  return {"top2_gap": gap, "top2_gap_bf16_steps": gap / step,
          "base_minus_spec": pair_gap, "base_minus_spec_bf16_steps": pair_gap / step}


def run_prompt(target, draft, ids: list[int]) -> dict:
  """Target-only and speculative greedy tokens of one prompt, and where they part."""
  n, gamma = _N_PREDICT.value, _GAMMA.value
  cap = generation.plan_capacity(target.cfg, len(ids), n, extra=gamma)
  base = generation.generate(target, [ids], n, capacity=cap).tokens[0]
  spec = speculative.generate(target, draft, [ids], n, gamma, rule="real",
                              capacity=cap).tokens[0]
  k = divergence.first_divergence(spec, base)
  rec = {"prompt_len": len(ids), "capacity": cap, "first_divergence": k,
         "tokens": spec, "baseline_tokens": base}
  if k is not None and k < min(len(spec), len(base)):
    rec.update(spec_token=spec[k], base_token=base[k],
               **near_tie(target, ids + base[:k], spec[k], base[k]))
  return rec


def summarise(records: list[dict]) -> list[list[str]]:
  """Per precision: prompts, parted, first divergence median / min, share of
  output tokens at or after it (all prompts), median top-2 gap there."""
  rows = []
  for prec in dict.fromkeys(r["precision"] for r in records):
    rs = [r for r in records if r["precision"] == prec]
    ks = [r["first_divergence"] for r in rs if r["first_divergence"] is not None]
    total = sum(len(r["baseline_tokens"]) for r in rs)
    after = sum(len(r["baseline_tokens"]) - r["first_divergence"] for r in rs
                if r["first_divergence"] is not None)
    gaps = [r["top2_gap_bf16_steps"] for r in rs if "top2_gap_bf16_steps" in r]
    rows.append([prec, str(len(rs)), str(len(ks)),
                 f"{statistics.median(ks):g}" if ks else "-", str(min(ks)) if ks else "-",
                 f"{100 * after / max(total, 1):.1f}%",
                 f"{statistics.median(gaps):.2f}" if gaps else "-"])
  return rows


def write_summary(path: str, records: list[dict], env: dict) -> str:
  table = tables.markdown_table(
      ["precision", "prompts", "parted", "first div. median", "min", "tokens after",
       "top-2 gap (bf16 steps)"], summarise(records), right=[False] + [True] * 6)
  parted = [r for r in records if r["first_divergence"] is not None]
  detail = tables.markdown_table(
      ["precision", "set", "prompt", "first div.", "target-only / spec token",
       "top-2 gap", "bf16 steps"],
      [[r["precision"], r["prompt_set"], str(r["prompt"]), str(r["first_divergence"]),
        f"{r.get('base_token', '-')} / {r.get('spec_token', '-')}",
        f"{r['top2_gap']:.4g}" if "top2_gap" in r else "-",
        f"{r['top2_gap_bf16_steps']:.2f}" if "top2_gap" in r else "-"] for r in parted],
      right=[False, False, True, True, True, True, True])
  n = records[0]["n_predict"] if records else _N_PREDICT.value
  text = "\n\n".join([
      f"# Greedy speculative vs target-only: first divergence ({_MODEL.value} drafted by "
      f"{_MODEL_DRAFT.value}, {n} tokens per prompt, "
      f"gamma {records[0]['gamma'] if records else _GAMMA.value})",
      "command: `python " + " ".join(sys.argv) + "`",
      table, "Parting prompts (top-2 gap: the target's logits after the common prefix, "
      "one full forward):", detail if parted else "(none)",
      f"machine: {wd.machine_line(env)}"]) + "\n"
  with open(path, "w") as f:
    f.write(text)
  return text


def run_key(r: dict) -> tuple:
  """What a record answers: both models as given (--model, --model_draft),
  the precision, the prompt, n_predict and gamma. A rerun skips a record
  only when all of them match (records of older runs, without the models,
  are never reused), and the summary shows only this command's."""
  return (r.get("model"), r.get("model_draft"), r["precision"], r["prompt_set"], r["prompt"],
          r["n_predict"], r["gamma"])


def main(argv):
  del argv
  os.makedirs(_OUT_DIR.value, exist_ok=True)
  out = os.path.join(_OUT_DIR.value, "divergence.jsonl")
  done = wd.read_jsonl(out) if os.path.exists(out) else []
  seen = {run_key(r) for r in done}
  env = wd.environment()
  for dtype in _DTYPES.value:
    tcfg, tparams, tok = checkpoint.load_model(_MODEL.value, dtype=dtype)
    dcfg, dparams, _ = checkpoint.load_model(_MODEL_DRAFT.value, dtype=dtype, role="draft")
    plan.check_vocabularies(tcfg, dcfg)
    target, draft = steps.Runner(tcfg, tparams), steps.Runner(dcfg, dparams)
    for kind in _SETS.value:
      texts = pair.shipped_prompts(_N_PROMPTS.value or None, kind=kind)
      for i, text in enumerate(texts):
        head = {"model": _MODEL.value, "model_draft": _MODEL_DRAFT.value,
                "precision": tcfg.precision, "prompt_set": kind, "prompt": i,
                "n_predict": _N_PREDICT.value, "gamma": _GAMMA.value}
        if run_key(head) in seen:
          continue
        t0 = time.perf_counter()
        rec = {**head, "target": tcfg.name, "draft": dcfg.name,
               **run_prompt(target, draft, tok.encode(text)), "git_commit": env["git_commit"]}
        wd.append_jsonl(out, [rec])
        done.append(rec)
        k = rec["first_divergence"]
        print(f"[{tcfg.precision} {kind} {i + 1}/{len(texts)}] "
              + ("equal" if k is None else f"part at {k}, top-2 gap "
                 f"{rec.get('top2_gap_bf16_steps', float('nan')):.2f} bf16 steps")
              + f" ({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
  precisions = [config.canonical_precision(d) for d in _DTYPES.value]
  records = [r for r in done if r["precision"] in precisions and r["prompt_set"] in _SETS.value
             and (not _N_PROMPTS.value or r["prompt"] < _N_PROMPTS.value)
             and run_key(r)[:2] == (_MODEL.value, _MODEL_DRAFT.value)
             and r["n_predict"] == _N_PREDICT.value and r["gamma"] == _GAMMA.value]
  records.sort(key=lambda r: (precisions.index(r["precision"]), r["prompt_set"], r["prompt"]))
  print(write_summary(os.path.join(_OUT_DIR.value, "summary.md"), records, env))


if __name__ == "__main__":
  cli.run(main)
