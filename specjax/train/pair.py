"""The shipped target/draft pair: how it is made, and where it lives.

    python experiments/train.py --config=configs/train.py --workdir=W --export_dir=specjax/assets

Stages corpus, target, draft, distill, alpha (real acceptance of both drafts
by the engine, on the weights as exported) and export (HF directories), each
skipped when its output is complete, and only for the settings it was made
with (recorded beside it; other settings are refused), and resumed from its
last checkpoint when interrupted. The pair loads by name, `--model=stdlib-target
--model_draft=stdlib-draft`. The stages' outputs: docs/training.md, "The
shipped pair"; its figures: docs/drafters.md.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax.train import corpus
from specjax.formats import hf
from specjax.decode import speculative
from specjax.model import steps
from specjax.train import loop as train
from specjax import workdir as wd
from specjax.formats.checkpoint import SHIPPED
from specjax.model.config import ModelConfig
from specjax.errors import ConfigError
from specjax.model.sampling import SamplingParams
from specjax.formats.tokenizer import load_tokenizer

PROMPTS_FILE = "heldout_prompts.json"
EDITING_FILE = "editing_prompts.json"
EDITING_PROMPT_TOKENS = 160  # longest editing prompt (tokens)
PROMPT_FILES = {"continuation": PROMPTS_FILE, "editing": EDITING_FILE}
SUMMARY_FILE = "training.json"
ALPHA_FILE = "alpha.json"
# What each stage's outputs depend on (recorded beside them, workdir.check_stage).
CORPUS_FIELDS = ("vocab_size", "heldout_per_mille", "max_files", "alpha_prompts_saved",
                 "alpha_prompt_tokens")
ALPHA_FIELDS = ("target", "draft", "target_train", "draft_train", "distill_train",
                "export_dtype", "alpha_prompts", "alpha_gamma", "alpha_n_predict", "alpha_temps")
CORPUS_OUTPUTS = ("corpus.json", "train.npy", "heldout.npy", "tokenizer.json", PROMPTS_FILE)


def shipped_prompts(n: int | None = None, kind: str = "continuation") -> list[str]:
  """Held-out prompt texts shipped with the pair: `continuation` (code cut at
  a line end; the sweep's `real` prompts) or `editing` (a function, an
  instruction to rewrite it and its def line again; corpus.editing_prompts)."""
  if kind not in PROMPT_FILES:
    raise ConfigError(f"unknown prompt set {kind!r}; valid: {', '.join(PROMPT_FILES)}")
  file = SHIPPED["stdlib-target"] / PROMPT_FILES[kind]
  if not file.is_file():
    raise ConfigError(f"{file} is missing: the shipped pair is not installed; "
                      "regenerate it with experiments/train.py (see README)")
  texts = [p["text"] for p in wd.read_json(file)]
  return texts[:n] if n else texts


def model_config(name: str, m, vocab_size: int, bos: int, eos: int) -> ModelConfig:
  return ModelConfig(name=name, vocab_size=vocab_size, dim=int(m.dim),
                     n_layers=int(m.n_layers), n_heads=int(m.n_heads),
                     n_kv_heads=int(m.n_kv_heads), ffn_dim=int(m.ffn_dim),
                     max_seq_len=int(m.max_seq_len), tie_embeddings=True,
                     bos_token_id=bos, eos_token_id=eos)


def _stage_corpus(c, work: Path, log) -> dict[str, Any]:
  meta_file = work / "corpus.json"
  if wd.check_stage(work / "corpus.settings.json", train.settings_of(c, CORPUS_FIELDS),
                    [work / f for f in CORPUS_OUTPUTS],
                    f"use a new --workdir, or delete {work} to start over (every stage "
                    f"after it was trained on this corpus)"):
    return wd.read_json(meta_file)
  t0 = time.perf_counter()
  train_files, held_files = corpus.list_files(heldout_per_mille=int(c.heldout_per_mille))
  if int(c.max_files):
    train_files = train_files[:int(c.max_files)]
    held_files = held_files[:max(2, int(c.max_files) // 10)]
  texts = corpus.read_texts(train_files)
  log(f"corpus: {len(train_files)} train files, {len(held_files)} held-out files; "
      f"training a {c.vocab_size}-token BPE")
  corpus.train_tokenizer(texts, int(c.vocab_size), work)
  tok = load_tokenizer(work)
  train_stream = corpus.encode_documents(tok, texts)
  held_stream = corpus.encode_documents(tok, corpus.read_texts(held_files))
  prompts = corpus.heldout_prompts(held_files, tok, int(c.alpha_prompts_saved),
                                   int(c.alpha_prompt_tokens))
  if len(prompts) < int(c.alpha_prompts):
    raise ConfigError(f"only {len(prompts)} held-out prompts found, "
                      f"alpha_prompts={c.alpha_prompts}")
  np.save(work / "train.npy", train_stream)
  np.save(work / "heldout.npy", held_stream)
  wd.write_json(work / PROMPTS_FILE, prompts)
  wd.write_json(work / EDITING_FILE, corpus.editing_prompts(
      held_files, tok, int(c.alpha_prompts_saved), EDITING_PROMPT_TOKENS))
  meta = corpus.describe(train_files, held_files, len(train_stream), len(held_stream),
                         tok.vocab_size, int(c.heldout_per_mille))
  meta["seconds"] = time.perf_counter() - t0
  wd.write_json(meta_file, meta)
  log(f"corpus: {meta['train_tokens']:,} train tokens, {meta['heldout_tokens']:,} "
      f"held-out tokens ({meta['seconds']:.0f} s)")
  return meta


def _round(cfg: ModelConfig, params, dtype: str):
  """Params as exported (rounded to dtype), back in cfg's float32."""
  return jax.tree_util.tree_map(
      lambda x: jnp.asarray(x.astype(dtype), cfg.jnp_param_dtype), params)


def train_seconds(workdir: Path) -> float:
  """Training time of a stage from its metrics (steps only: compile and eval excluded)."""
  total, prev = 0.0, 0
  for r in train.read_metrics(workdir):
    if r.get("tok_s"):
      total += (r["tokens"] - prev) / r["tok_s"]
      prev = r["tokens"]
  return total


def measure_alpha(target: steps.Runner, draft: steps.Runner, prompts: list[list[int]],
                  gamma: int, n_predict: int, temps, seed: int = 0) -> dict[str, Any]:
  """Real acceptance of `draft` against `target`, by the engine, per temperature."""
  out = {}
  for t in temps:
    res = speculative.generate(target, draft, prompts, n_predict, gamma,
                               sp=SamplingParams(float(t)), rule="real", seed=seed)
    s = res.stats
    out[f"{float(t):g}"] = {"alpha": s.alpha, "accept_rate": s.accept_rate,
                            "mean_accepted": s.mean_accepted,
                            "tokens_per_step": s.tokens_per_step,
                            "alpha_at_pos": s.alpha_at_pos, "accept_hist": s.accept_hist,
                            "n_steps": s.n_steps}
  return out


def run(c, workdir: str | os.PathLike, export_dir: str | os.PathLike | None = None,
        progress: bool = True, log: Callable[[str], None] = print) -> dict[str, Any]:
  """Runs (or resumes) every stage; returns the training summary."""
  work = Path(workdir)
  work.mkdir(parents=True, exist_ok=True)
  meta = _stage_corpus(c, work, log)
  tok = load_tokenizer(work)
  train_stream, held_stream = np.load(work / "train.npy"), np.load(work / "heldout.npy")
  mk = lambda name, m: model_config(name, m, tok.vocab_size, tok.bos_id, tok.eos_id)
  tcfg, dcfg = mk("stdlib-target", c.target), mk("stdlib-draft", c.draft)

  def stage(name, cfg, tc, **kw):
    params = train.finished_params(work / name, cfg, tc, kw.get("teacher"))
    if params is None:
      log(f"{name}: {cfg.num_params() / 1e6:.2f} M params, {tc.steps} steps of "
          f"{tc.batch}x{tc.seq_len} tokens")
      params = train.train(cfg, tc, work / name, train_stream, held_stream,
                           progress=progress, log=log, **kw)
    return params, train_seconds(work / name)

  tparams, t_s = stage("target", tcfg, c.target_train)
  d0params, d_s = stage("draft", dcfg, c.draft_train)
  d1params, k_s = stage("distill", dcfg, c.distill_train, teacher=(tcfg, tparams),
                        init=d0params)

  dt = str(c.export_dtype)
  target = steps.Runner(tcfg, _round(tcfg, tparams, dt))
  before = steps.Runner(dcfg, _round(dcfg, d0params, dt))
  after = steps.Runner(dcfg, _round(dcfg, d1params, dt))
  prompts_text = [p["text"] for p in wd.read_json(work / PROMPTS_FILE)]
  prompts = [tok.encode(t) for t in prompts_text[:int(c.alpha_prompts)]]
  alpha_file = work / ALPHA_FILE
  if wd.check_stage(work / "alpha.settings.json",
                    {"corpus": train.settings_of(c, CORPUS_FIELDS),
                     **train.settings_of(c, ALPHA_FIELDS)}, [alpha_file],
                    f"delete {alpha_file} to measure again, or use a new --workdir"):
    alpha = wd.read_json(alpha_file)
  else:
    log("alpha: measuring real acceptance before and after distillation")
    kw = dict(gamma=int(c.alpha_gamma), n_predict=int(c.alpha_n_predict),
              temps=tuple(c.alpha_temps))
    alpha = {"before": measure_alpha(target, before, prompts, **kw),
             "after": measure_alpha(target, after, prompts, **kw),
             "gamma": int(c.alpha_gamma), "n_predict": int(c.alpha_n_predict),
             "prompts": len(prompts)}
    wd.write_json(alpha_file, alpha)

  windows = corpus.eval_windows(held_stream, 64, int(c.target_train.seq_len) + 1)
  ev = lambda m, teacher=None: train.evaluate(m.params, m.cfg, windows, 8, teacher)
  summary = {
      "corpus": meta, "target": tcfg.to_dict(), "draft": dcfg.to_dict(),
      "target_params": tcfg.num_params(), "draft_params": dcfg.num_params(),
      "train": {k: c[k + "_train"].to_dict() for k in ("target", "draft", "distill")},
      "train_seconds": {"target": t_s, "draft": d_s, "distill": k_s},
      "heldout": {"target": ev(target), "draft_before": ev(before, (tcfg, target.params)),
                  "draft_after": ev(after, (tcfg, target.params))},
      "alpha": alpha, "export_dtype": dt,
  }
  wd.write_json(work / SUMMARY_FILE, summary)
  plot_training(work, work / "training.png")
  if export_dir is not None:
    export(work, Path(export_dir), tcfg, target.params, dcfg, after.params, dt, summary)
  return summary


def export(work: Path, out: Path, tcfg: ModelConfig, tparams, dcfg: ModelConfig, dparams,
           dtype: str, summary: dict[str, Any]) -> None:
  """Writes both HF directories (weights in `dtype`), tokenizer and provenance."""
  for name, cfg, params in (("stdlib-target", tcfg, tparams), ("stdlib-draft", dcfg, dparams)):
    d = out / name
    cast = jax.tree_util.tree_map(lambda x: x.astype(dtype), params)
    hf.save_hf(d, cfg.with_dtype(dtype), cast, tokenizer_json=work / "tokenizer.json")
    shutil.copyfile(work / "tokenizer_config.json", d / "tokenizer_config.json")
    wd.write_json(d / SUMMARY_FILE, summary)
  for name in (PROMPTS_FILE, EDITING_FILE):
    if (work / name).is_file():  # workdirs from before the editing set lack it
      shutil.copyfile(work / name, out / "stdlib-target" / name)


def plot_training(work: Path, path: Path) -> None:
  """Training and held-out loss of each stage against tokens seen."""
  plt = wd.pyplot()
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
  draft_tokens = 0.0
  for name, col in (("target", "C0"), ("draft", "C1"), ("distill", "C2")):
    recs = train.read_metrics(work / name)
    tr = [r for r in recs if "loss" in r]
    ev = [r for r in recs if "eval_loss" in r]
    per_step = tr[0]["tokens"] / tr[0]["step"] if tr else 1
    # distillation continues the draft: its curve starts where the draft's ends
    off = draft_tokens if name == "distill" else 0.0
    if name == "draft" and tr:
      draft_tokens = tr[-1]["tokens"]
    ce = "ce" if name == "distill" else "loss"  # distillation: its cross-entropy part
    ax1.plot([(off + r["tokens"]) / 1e6 for r in tr], [r[ce] for r in tr], color=col, lw=1,
             label=f"{name}: train cross-entropy")
    ax1.plot([(off + r["step"] * per_step) / 1e6 for r in ev], [r["eval_loss"] for r in ev],
             "o--", color=col, ms=4, label=f"{name}: held-out")
    if name == "distill":
      ax2.plot([r["tokens"] / 1e6 for r in tr], [r["kl"] for r in tr], color=col, lw=1,
               label="distill: train KL(target || draft)")
      ax2.plot([r["step"] * per_step / 1e6 for r in ev], [r["eval_kl"] for r in ev], "o--",
               color=col, ms=4, label="distill: held-out KL")
  ax1.set_xlabel("tokens seen (M; distillation continues the draft)")
  ax1.set_ylabel("loss (nats/token)")
  ax1.set_title("Next-token loss")
  ax1.grid(alpha=0.3)
  ax1.legend(fontsize=7)
  ax2.set_xlabel("tokens seen in distillation (M)")
  ax2.set_ylabel("KL (nats/token)")
  ax2.set_title("Distillation toward the target")
  ax2.grid(alpha=0.3)
  ax2.legend(fontsize=7)
  wd.save_figure(fig, path)
