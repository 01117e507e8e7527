"""Training an EAGLE-1 head (specjax/drafters/eagle.py) for a frozen target:
the loss (teacher forcing, smooth L1 on the next feature plus cross-entropy to
the target's soft labels, derived in docs/eagle.md), the optax step,
exact resume with orbax through specjax/train/loop.py's helpers, the training
plot, real acceptance against draft models, and the stdlib pipeline that
exports the shipped stdlib-eagle head (experiments/train_eagle.py)."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax import workdir as wd
from specjax.decode import speculative
from specjax.model.sampling import SamplingParams
from specjax.drafters.eagle import (FORMAT, EagleDrafter, head_config, head_forward, init_head,
                                    load_eagle, new_cache, save_head)
from specjax.errors import ConfigError
from specjax.formats import checkpoint
from specjax.model import kv_cache as kvc
from specjax.model import llama as model_lib
from specjax.model import steps
from specjax.model.config import ModelConfig
from specjax.train import corpus, pair
from specjax.train import loop as train_lib


def target_features(tparams, tcfg: ModelConfig, tokens):
  """[B, T] -> (logits [B, T, V], features [B, T, E]) of a fresh target pass
  (masked attention, as training's forward)."""
  tcfg = tcfg.replace(attn_block=0)
  cache = kvc.init_cache(tcfg, tokens.shape[0], tokens.shape[1])
  logits, _, hidden = model_lib.forward(tparams, tokens, cache, tcfg, return_hidden=True)
  return logits, hidden


def eagle_loss(hparams, hcfg: ModelConfig, tparams, tcfg: ModelConfig, batch,
               ce_weight: float, feats=None, tlogits=None):
  """Loss of a window batch [B, T+1]; (loss, {"vloss", "ploss", "acc"}).

  vloss: smooth L1 (Huber, delta 1) of g_i - f_{i+1}, mean over elements;
  ploss: cross-entropy of the head's LM-head distribution to the target's
  softmax at f_{i+1}; acc: argmax agreement of the two (the first draft's
  greedy acceptance under teacher forcing). i = 0..T-1 (module docstring).
  """
  if feats is None:
    tlogits, feats = target_features(tparams, tcfg, batch)
  feats = jax.lax.stop_gradient(feats.astype(jnp.float32))
  tlogits = jax.lax.stop_gradient(tlogits)
  t = batch.shape[1] - 1
  hcfg = hcfg.replace(attn_block=0)
  pred, _ = head_forward(hparams, tparams, feats[:, :-1], batch[:, 1:],
                         new_cache(hcfg, batch.shape[0], t), hcfg, tcfg)
  pred = pred.astype(jnp.float32)
  vloss = optax.huber_loss(pred, feats[:, 1:], delta=1.0).mean()
  logits = model_lib.head_logits(tparams, pred, tcfg)
  p_t = jax.nn.softmax(tlogits[:, 1:], -1)
  ploss = -jnp.sum(p_t * jax.nn.log_softmax(logits, -1), -1).mean()
  acc = jnp.mean(jnp.argmax(logits, -1) == jnp.argmax(tlogits[:, 1:], -1))
  return vloss + ce_weight * ploss, {"vloss": vloss, "ploss": ploss, "acc": acc}


@functools.partial(jax.jit, static_argnames=("hcfg", "tcfg", "opt", "ce_weight"),
                   donate_argnums=(0,))
def train_step(state, batch, tparams, *, hcfg, tcfg, opt, ce_weight):
  """One optimiser step of the head; the frozen target pass is in the same
  program. state = {'step', 'params', 'opt_state'}."""
  params = state["params"]
  (loss, aux), grads = jax.value_and_grad(eagle_loss, has_aux=True)(
      params, hcfg, tparams, tcfg, batch, ce_weight)
  updates, opt_state = opt.update(grads, state["opt_state"], params)
  new = {"step": state["step"] + 1, "params": optax.apply_updates(params, updates),
         "opt_state": opt_state}
  return new, {"loss": loss, "grad_norm": train_lib.global_norm(grads), **aux}


@functools.partial(jax.jit, static_argnames=("hcfg", "tcfg", "ce_weight"))
def eval_step(hparams, batch, tparams, *, hcfg, tcfg, ce_weight):
  return eagle_loss(hparams, hcfg, tparams, tcfg, batch, ce_weight)


def evaluate(hparams, hcfg, tparams, tcfg, windows: np.ndarray, batch: int,
             ce_weight: float) -> dict[str, float]:
  """Held-out losses over fixed windows (means of the per-batch means)."""
  tot: dict[str, list] = {}
  for i in range(0, len(windows), batch):
    loss, aux = eval_step(hparams, jnp.asarray(windows[i:i + batch]), tparams, hcfg=hcfg,
                          tcfg=tcfg, ce_weight=ce_weight)
    for k, v in {"loss": loss, **aux}.items():
      tot.setdefault(k, []).append(float(v))
  return {f"eval_{k}": float(np.mean(v)) for k, v in tot.items()}


@functools.lru_cache(maxsize=8)
def _optimizer(fields: tuple):
  """loop.make_optimizer, one object per setting: the step's static `opt`
  then hits jit's cache when a run is resumed in the same process."""
  import ml_collections  # pylint: disable=import-outside-toplevel
  return train_lib.make_optimizer(ml_collections.ConfigDict(dict(fields)))


def _abstract_state(hcfg: ModelConfig, opt):
  params = jax.eval_shape(lambda: init_head(hcfg))
  return {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": params,
          "opt_state": jax.eval_shape(opt.init, params)}


def train(tcfg: ModelConfig, tparams, tc, workdir: str | os.PathLike,
          train_stream: np.ndarray, eval_stream: np.ndarray, stop_at: int | None = None,
          progress: bool = True, log: Callable[[str], None] = print):
  """Trains (or resumes) an EAGLE head for the frozen target (tcfg, tparams).

  tc: training settings (configs/train.py's fields; ce_weight = the token
  cross-entropy weight w). Batch s is corpus.batch_at(seed, s); the whole
  optimiser state is checkpointed with orbax (train.py's manager), so a
  resumed run equals an uninterrupted one. Returns the head params.
  Metrics: <workdir>/metrics.jsonl, as train.py's plus vloss, ploss, acc.
  """
  train_lib.validate(tc)
  workdir = Path(workdir)
  hcfg = head_config(tcfg)
  want = {**train_lib.train_config(hcfg, tc, (tcfg, None)), "kind": FORMAT}
  train_lib.check_same_run(workdir, want)
  opt, schedule = _optimizer(tuple((k, tc[k]) for k in train_lib.TRAIN_FIELDS))
  params = init_head(hcfg, int(tc.seed))
  state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": opt.init(params)}
  mngr = train_lib.checkpoint_manager(workdir, int(tc.keep))
  metrics_path = workdir / train_lib.METRICS_FILE
  restored, start = train_lib.resume(mngr, _abstract_state(hcfg, opt), metrics_path, log)
  state = state if restored is None else restored
  total = int(tc.steps)
  end = total if stop_at is None else min(total, int(stop_at))
  windows = corpus.eval_windows(eval_stream, int(tc.eval_batches) * int(tc.batch),
                                int(tc.seq_len) + 1)
  ce_weight = float(tc.ce_weight)
  step_fn = functools.partial(train_step, hcfg=hcfg, tcfg=tcfg, opt=opt, ce_weight=ce_weight)
  eval_fn = lambda p: evaluate(p, hcfg, tparams, tcfg, windows, int(tc.batch), ce_weight)
  state = train_lib.run_loop(state, step_fn, tparams, eval_fn, tc, schedule, mngr, metrics_path,
                             train_stream, start, end, progress, workdir.name)
  return state["params"]


def plot_training(workdir: str | os.PathLike, path: str | os.PathLike) -> None:
  """Train and held-out loss (and its parts) against tokens seen."""
  recs = train_lib.read_metrics(workdir)
  tr = [r for r in recs if "loss" in r]
  ev = [r for r in recs if "eval_loss" in r]
  per_step = tr[0]["tokens"] / tr[0]["step"] if tr else 1
  plt = wd.pyplot()
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
  x_tr = [r["tokens"] / 1e6 for r in tr]
  x_ev = [r["step"] * per_step / 1e6 for r in ev]
  for key, col in (("loss", "C0"), ("vloss", "C1"), ("ploss", "C2")):
    ax1.plot(x_tr, [r[key] for r in tr], color=col, lw=1, label=f"train {key}")
    ax1.plot(x_ev, [r[f"eval_{key}"] for r in ev], "o--", color=col, ms=4,
             label=f"held-out {key}")
  ax1.set_yscale("log")
  ax1.set_xlabel("tokens seen (M)")
  ax1.set_ylabel("loss")
  ax1.set_title("EAGLE head: loss = vloss + w ploss")
  ax1.grid(alpha=0.3)
  ax1.legend(fontsize=7)
  ax2.plot(x_tr, [r["acc"] for r in tr], color="C3", lw=1, label="train")
  ax2.plot(x_ev, [r["eval_acc"] for r in ev], "o--", color="C3", ms=4, label="held-out")
  ax2.set_xlabel("tokens seen (M)")
  ax2.set_ylabel("top-1 agreement with the target")
  ax2.set_title("Next-token agreement (teacher-forced features)")
  ax2.grid(alpha=0.3)
  ax2.legend(fontsize=7)
  wd.save_figure(fig, path)


def generate(target: steps.Runner, head: str, prompts, n_predict: int, gamma: int,
             sp: SamplingParams = SamplingParams(), seed: int = 0, **kw):
  """speculative.generate with the head at `head` (a path or 'stdlib-eagle')
  as the drafter."""
  return speculative.generate(target, None, prompts, n_predict, gamma, sp=sp, seed=seed,
                              drafter=EagleDrafter(str(head)), **kw)


# ---------------------------------------------------------------- the pipeline

SUMMARY_FILE = "eagle.json"
ALPHA_FILE = "alpha.json"
# What each stage's outputs depend on (recorded beside them, workdir.check_stage).
STREAM_FIELDS = ("eagle_target", "heldout_per_mille", "max_files")
ALPHA_FIELDS = STREAM_FIELDS + ("eagle_train", "eagle_drafts", "export_dtype", "alpha_prompts",
                                "alpha_gamma", "alpha_n_predict", "alpha_temps")


def _streams(c, tok, work: Path) -> tuple[np.ndarray, np.ndarray]:
  """The stdlib corpus (corpus.py's split) in the target's tokens, cached
for the settings it was made with (others are refused)."""
  if wd.check_stage(work / "corpus.settings.json", train_lib.settings_of(c, STREAM_FIELDS),
                    [work / "train.npy", work / "heldout.npy"],
                    f"use a new --workdir, or delete {work} to start over (the head was "
                    f"trained on this corpus)"):
    return np.load(work / "train.npy"), np.load(work / "heldout.npy")
  train_files, held_files = corpus.list_files(heldout_per_mille=int(c.heldout_per_mille))
  if int(c.max_files):
    train_files = train_files[:int(c.max_files)]
    held_files = held_files[:max(2, int(c.max_files) // 10)]
  tr = corpus.encode_documents(tok, corpus.read_texts(train_files))
  he = corpus.encode_documents(tok, corpus.read_texts(held_files))
  work.mkdir(parents=True, exist_ok=True)
  np.save(work / "train.npy", tr)
  np.save(work / "heldout.npy", he)
  return tr, he


def measure_alpha(target: steps.Runner, head: str, drafts: dict[str, steps.Runner], prompts,
                  gamma: int, n_predict: int, temps, seed: int = 0) -> dict[str, Any]:
  """Real acceptance (the engine, same prompts, gamma, seed) of the head at
  `head` (drafter eagle:PATH) and of each draft model, per temperature."""
  out: dict[str, Any] = {"eagle": {}}
  for t in temps:
    s = generate(target, head, prompts, n_predict, gamma, SamplingParams(float(t)),
                 seed=seed).stats
    out["eagle"][f"{float(t):g}"] = {
        "alpha": s.alpha, "accept_rate": s.accept_rate, "mean_accepted": s.mean_accepted,
        "tokens_per_step": s.tokens_per_step, "alpha_at_pos": s.alpha_at_pos,
        "accept_hist": s.accept_hist, "n_steps": s.n_steps}
  for name, d in drafts.items():
    out[name] = pair.measure_alpha(target, d, prompts, gamma, n_predict, temps, seed)
  return out


def run(c, workdir: str | os.PathLike, export_dir: str | os.PathLike | None = None,
        progress: bool = True, log: Callable[[str], None] = print) -> dict[str, Any]:
  """Trains (or resumes) the head of c.eagle_target on the stdlib corpus,
  plots, measures acceptance against c.eagle_drafts, exports
  <export_dir>/<target>-eagle's files ('stdlib-eagle'). Returns the summary."""
  work = Path(workdir)
  # float32, as the pair was trained (the shipped files are bfloat16)
  tcfg, tparams, tok = checkpoint.load_model(str(c.eagle_target), dtype="float32")
  if tok is None:
    raise ConfigError(f"target {c.eagle_target} has no tokenizer: the corpus needs one")
  train_stream, held_stream = _streams(c, tok, work)
  tc = c.eagle_train
  hcfg = head_config(tcfg)
  log(f"eagle: head of {c.eagle_target}: {model_lib.param_count(jax.eval_shape(lambda: init_head(hcfg))) / 1e6:.2f} M "
      f"params; {tc.steps} steps of {tc.batch}x{tc.seq_len} tokens; corpus "
      f"{len(train_stream):,} / {len(held_stream):,} held-out tokens")
  hparams = train(tcfg, tparams, tc, work / "head", train_stream, held_stream,
                  progress=progress, log=log)
  plot_training(work / "head", work / "training.png")
  dt = str(c.export_dtype)
  name = str(c.eagle_target).replace("-target", "") + "-eagle"
  head_dir = save_head(work / name, hcfg, hparams, tcfg, str(c.eagle_target), dt)
  _, rounded, _ = load_eagle(head_dir)  # measured as shipped: rounded to dt, run in f32
  target = steps.Runner(tcfg, tparams)
  prompts = [tok.encode(t) for t in pair.shipped_prompts(int(c.alpha_prompts))]
  alpha_file = work / ALPHA_FILE
  if wd.check_stage(work / "alpha.settings.json", train_lib.settings_of(c, ALPHA_FIELDS),
                    [alpha_file], f"delete {alpha_file} to measure again, or use a new "
                    f"--workdir"):
    alpha = wd.read_json(alpha_file)
  else:
    log("eagle: measuring real acceptance of the head and the draft(s)")
    drafts = {}
    for dname in c.eagle_drafts:
      dcfg, dparams, _ = checkpoint.load_model(str(dname), dtype="float32", role="draft")
      drafts[dname] = steps.Runner(dcfg, dparams)
    alpha = measure_alpha(target, str(head_dir), drafts, prompts, int(c.alpha_gamma),
                          int(c.alpha_n_predict), tuple(c.alpha_temps))
    alpha.update(gamma=int(c.alpha_gamma), n_predict=int(c.alpha_n_predict),
                 prompts=len(prompts))
    wd.write_json(alpha_file, alpha)
  windows = corpus.eval_windows(held_stream, 64, int(tc.seq_len) + 1)
  recs = train_lib.read_metrics(work / "head")
  tok_s = [r["tok_s"] for r in recs if r.get("tok_s")]
  summary = {"target": str(c.eagle_target), "head": hcfg.to_dict(),
             "head_params": model_lib.param_count(hparams), "train": tc.to_dict(),
             "train_seconds": pair.train_seconds(work / "head"),
             "train_tok_s_median": float(np.median(tok_s)) if tok_s else None,
             "heldout": evaluate(rounded, hcfg, tparams, tcfg, windows, 8,
                                 float(tc.ce_weight)),
             "alpha": alpha, "export_dtype": dt}
  wd.write_json(work / SUMMARY_FILE, summary)
  if export_dir is not None:
    d = save_head(Path(export_dir) / name, hcfg, hparams, tcfg, str(c.eagle_target), dt,
                  {"training": summary})
    summary["exported"] = str(d)
  return summary
