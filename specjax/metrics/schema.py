"""The record of a speculative run, defined once.

Every output that describes a speculative run uses these fields, with these
meanings: experiments/speculative.py's --json_out, the sweep's results.jsonl,
results.csv and plots. `run_record` builds one and refuses a field that is
not defined here, so a name cannot drift between outputs (as `accept` once
meant the rule in one place and the rate in another).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from specjax.metrics.stats import SpecStats

# 2: accept_rule / accept_rate named apart; tokens_per_step and speed count
# the same (kept) tokens; catch-up steps counted; accept cost per point.
SCHEMA_VERSION = 2

_STATS = {f.name: "stats.SpecStats (see its docstring)" for f in dataclasses.fields(SpecStats)}

FIELDS: dict[str, str] = {
    # what ran
    "target": "target model name",
    "draft": "draft model name (the model the drafter runs; none for ngram)",
    "drafter": "what drafted: model | ngram:A-B | layerskip:N | layerskip:LIST | eagle "
               "(drafters.parse)",
    "precision": "compute precision of both models: float32, bfloat16, bf16-mixed, ...",
    "accept_rule": "acceptance rule: real | always | bernoulli:P | fraction:F | mean_length:L",
    "temperature": "sampling temperature of both models (0 = greedy)",
    "top_k": "top-k filter of both models (0 = off)",
    "top_p": "top-p filter of both models (1 = off)",
    "p_min": "draft early stop: stop drafting when the draft's top probability is below it",
    "seed": "sampling seed",
    "loop": "device (one lax.while_loop) or host (a Python loop of timed phases)",
    "capacity": "KV cache slots per row (both models, both runs)",
    "n_prompts": "prompts run one after another (statistics pooled)",
    "prompt_set": "the shipped held-out prompts used: continuation | editing (pair.shipped_prompts)",
    "reps": "timed repetitions (target-only and speculative alternating); speeds are medians",
    "prompt_tokens": "prompt token ids (single-prompt runs)",
    "tokens": "speculative output token ids (single-prompt runs)",
    "baseline_tokens": "target-only output token ids (single-prompt runs)",
    "rows": "batch runs: per row its prompt_ids, tokens and baseline_tokens (cli.row_records)",
    "first_divergence": "greedy runs of the real rule with a target-only baseline (per row in "
                        "`rows` too): the 0-based index of the first output token where the "
                        "speculative and target-only tokens differ (the shorter list's length "
                        "if one is a prefix of the other), null when they are equal; absent "
                        "otherwise (no equality is claimed). float32: null (tested); bfloat16 "
                        "can part at a near-tie (divergence.py, docs/results.md)",
    # acceptance and step statistics
    **_STATS,
    # speed
    "baseline_tps": "target-only decode tokens/s (first token excluded), median",
    "baseline_tps_reps": "each repetition's target-only tokens/s (the sweep's noise check)",
    "spec_tps": "speculative decode tokens/s (first token excluded), median",
    "speedup": "speculative over target-only speed: same prompts, same cache capacity, "
               "same run (the sweep: median over repetitions of each repetition's ratio)",
    "prompt_s": "prefill seconds (both models)",
    "compile_s": "compilation seconds, excluded from every timing",
    # measured costs (costs.py), seconds, medians
    "t_target_s": "T_target(1): one target-only decode step",
    "t_target_s_reps": "each repetition's T_target(1) probe (the sweep's noise check)",
    "t_target_gamma_s": "T_target(gamma)",
    "t_verify_s": "T_target(gamma+1): the verify",
    "t_draft_s": "T_draft(1)",
    "t_accept_s": "one accept phase and its bookkeeping",
    "c": "T_draft(1) / T_target(1)",
    "verify_ratio": "T_target(gamma+1) / T_target(1)",
    # predictions (costs.predict) and how the measurement compares
    "predicted_step_s": "the cost model's seconds per step",
    "predicted_measured_cost": "the measured-cost model's speedup",
    "predicted_leviathan": "Leviathan et al. Theorem 3.8 at the measured alpha and c",
    "predicted_thread": "ggerganov's approximation in llama.cpp #3649",
    "efficiency": "speedup / predicted_measured_cost (the sweep: median over repetitions, "
                  "each repetition's runs against the probes taken right after them)",
    "efficiency_reps": "each repetition's efficiency",
    "draft_share": "share of the host loop's step time in the draft phase",
    "verify_share": "... in the verify phase",
    "accept_share": "... in the accept phase",
    "rest_share": "... elsewhere (bookkeeping, dispatch)",
    "geometric": "accepted lengths against the capped geometric law (stats.geometric_check)",
    "env": "workdir.environment(): versions, device, CPU model and flags, load, commit",
    # batches (the sweep's `batches`; absent = 1) and the tail effect
    "batch": "rows per generate call (ragged prompts, sweep.batch_prompts); speeds sum the rows",
    "loop_steps": "loop steps, summed over the point's runs (a batch runs until its slowest row is done)",
    "steps_measured": "loop steps per run, measured",
    "steps_predicted": "loop steps per run, the tail model's expectation "
                       "(theory.expected_batch_steps at the rule's law / the measured alpha)",
    "catchup_any_share": "share of loop steps whose draft phase fed some row's d_gamma first",
    "predicted_tail": "the measured-cost model with the tail model's expected steps",
    "efficiency_tail": "speedup / predicted_tail (median over repetitions)",
    # gamma chosen at run time (autogamma; gamma = 'auto')
    "auto_set": "the gammas an auto point chooses from",
    "auto_every": "steps between choices (chunks of 1, 2, 4, .. up to this)",
    "auto_step_s": "seconds per loop step at each gamma, timed after warm-up (what it chose from)",
    "gammas_used": "steps run at each gamma of the set",
    "auto_alpha": "the alpha estimate at the last choice, per run",
    # token trees (issue 25; bench/tree_sweep.py, decode/autotree.py)
    "tree": "the point's tree spec (chain:G, kary:K,D, sequoia:N,D, auto:..)",
    "tree_nodes": "draft nodes N of the point's tree (a verify of 1 + N tokens)",
    "auto_trees": "the candidate trees an auto tree run chose from",
    "trees_used": "steps run with each candidate tree",
    "p_by_rank": "positional acceptance by sibling rank, measured (accepts / tries per rank)",
    "tokens_per_step_predicted": "tree_theory.tokens_per_step at the measured (or the rule's) p",
    # per-row lengths (issue 40; gamma = 'auto:rows,max=G[,budget=N|auto]', bench/sweep/rows.py)
    "gamma_max": "per-row lengths: the longest draft a row may get (G)",
    "budget": "per-row lengths: the verify budget N (tokens per step), or 'auto' (chosen "
              "between chunks)",
    "budgets_used": "budget=auto: loop steps run at each candidate budget N",
    "rows_step_s": "budget=auto: seconds per loop step at each budget N, timed after warm-up "
                   "(the measured T(N) it chose from)",
    "t_packed_s": "T_packed(B, N): the target's packed verify of the N-token block",
    "rows_theory": "per-row lengths' tokens per loop step (all rows), measured beside the "
                   "geometric model's (decode/rows_theory.py: measured, kept, predicted = the "
                   "allocator's, oracle = each row's fitted alpha known, uniform = the same "
                   "budget split evenly; budget, rows, drafts per step, each row's alpha)",
    "predicted_rows": "the speedup each theory's tokens per step gives at the measured step "
                      "cost (predicted, oracle, uniform); budget=auto: at each step's "
                      "calibrated T(N) against target-only's seconds a token",
    "row_given": "per row (of each run in turn): mean draft length given per step",
    "row_proposed": "per row: mean drafts the drafter proposed per step",
    "row_accepted": "per row: mean drafts accepted per step",
    "row_categories": "a mixed batch (task suite 'mixed'): each row's category",
}

# The CSV's columns, in order (everything scalar a reader compares).
CSV_COLUMNS = (
    "drafter", "gamma", "accept_rule", "temperature", "top_k", "top_p", "baseline_tps", "spec_tps",
    "speedup", "accept_rate", "mean_accepted", "tokens_per_step", "alpha", "n_steps",
    "n_catchup", "c", "verify_ratio", "t_target_s", "t_verify_s", "t_draft_s", "t_accept_s",
    "predicted_leviathan", "predicted_thread", "predicted_measured_cost", "efficiency",
    "draft_share", "verify_share", "accept_share", "rest_share", "compile_s", "batch",
    "steps_measured", "steps_predicted", "predicted_tail", "efficiency_tail")


def run_record(stats: SpecStats | None = None, **fields: Any) -> dict[str, Any]:
  """A run's record: the statistics' fields plus `fields`, every name
  checked against FIELDS."""
  unknown = sorted(set(fields) - set(FIELDS))
  if unknown:
    raise KeyError(f"fields not in specjax.metrics.schema.FIELDS: {unknown}")
  rec = stats.to_dict() if stats is not None else {}
  rec.update(fields)
  return rec
