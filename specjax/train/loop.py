"""Next-token training and draft distillation of specjax LLaMAs with optax.

    params = train(model_cfg, tc, workdir, train_stream, eval_stream)
    params = train(draft_cfg, tc, workdir, ..., teacher=(target_cfg, target_params))

The model is the inference model itself (`llama.forward`), so what is
trained is what the engine runs. One jitted step: loss (`lm`, or `distill`:
forward KL to the teacher's soft labels plus `ce_weight` x cross-entropy),
gradient, clipping, AdamW with warm-up and cosine decay. Invariant: batch s
is a pure function of (seed, s) and the whole optimiser state is
checkpointed, so an interrupted and resumed run takes exactly the steps of
an uninterrupted one. The losses and the workdir layout: docs/training.md.
"""

from __future__ import annotations

import functools
import math
import os
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax.formats import checkpoint
from specjax.train import corpus
from specjax import workdir as wd
from specjax.model import kv_cache as kvc
from specjax.model import llama as model_lib
from specjax.model.config import ModelConfig
from specjax.errors import CheckpointError, ConfigError

CKPT_DIR = "ckpt"
METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "train_config.json"
TRAIN_FIELDS = ("steps", "batch", "seq_len", "lr", "warmup", "min_lr_ratio", "weight_decay",
                "clip", "b1", "b2", "seed", "ce_weight", "eval_every", "eval_batches",
                "ckpt_every", "log_every", "keep")


def validate(tc) -> None:
  """Bad training settings -> one ConfigError naming the field."""
  for name in ("steps", "batch", "seq_len", "eval_every", "eval_batches", "ckpt_every",
               "log_every", "keep"):
    if int(tc[name]) < 1:
      raise ConfigError(f"train.{name} must be >= 1, got {tc[name]}")
  if not 0 < float(tc.lr) < 1:
    raise ConfigError(f"train.lr must be in (0, 1), got {tc.lr}")
  if not 0 <= int(tc.warmup) < int(tc.steps):
    raise ConfigError(f"train.warmup must be in [0, steps), got {tc.warmup}")
  for name in ("min_lr_ratio", "b1", "b2"):
    if not 0 <= float(tc[name]) <= 1:
      raise ConfigError(f"train.{name} must be in [0, 1], got {tc[name]}")
  for name in ("weight_decay", "clip", "ce_weight"):
    if float(tc[name]) < 0:
      raise ConfigError(f"train.{name} must be >= 0, got {tc[name]}")


def make_optimizer(tc) -> tuple[optax.GradientTransformation, Callable]:
  """Clip by global norm, then AdamW (no decay on norm scales); the schedule."""
  lr = float(tc.lr)
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, lr, int(tc.warmup), int(tc.steps), end_value=lr * float(tc.min_lr_ratio))
  decay_mask = lambda params: jax.tree_util.tree_map(lambda x: x.ndim >= 2, params)
  opt = optax.chain(
      optax.clip_by_global_norm(float(tc.clip)),
      optax.adamw(schedule, b1=float(tc.b1), b2=float(tc.b2),
                  weight_decay=float(tc.weight_decay), mask=decay_mask))
  return opt, schedule


def logits_of(params, cfg: ModelConfig, tokens):
  """[B, T] -> [B, T, V] float32 logits, through the inference forward (its
  masked attention: the blocked one is a loop reverse mode cannot take)."""
  cfg = cfg.replace(attn_block=0)
  cache = kvc.init_cache(cfg, tokens.shape[0], tokens.shape[1])
  logits, _ = model_lib.forward(params, tokens, cache, cfg)
  return logits


def lm_loss(params, cfg: ModelConfig, batch):
  """Mean next-token cross-entropy of batch [B, T+1]."""
  logits = logits_of(params, cfg, batch[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def kl_to_teacher(teacher_logits, student_logits):
  """Mean forward KL(p_teacher || p_student) per position, in nats."""
  lp_t = jax.nn.log_softmax(teacher_logits, -1)
  lp_s = jax.nn.log_softmax(student_logits, -1)
  return jnp.sum(jnp.exp(lp_t) * (lp_t - lp_s), -1).mean()


def distill_loss(params, cfg: ModelConfig, batch, teacher_logits, ce_weight: float):
  """KL to the teacher's soft labels (+ ce_weight x cross-entropy); (loss, (kl, ce))."""
  logits = logits_of(params, cfg, batch[:, :-1])
  kl = kl_to_teacher(teacher_logits, logits)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
  return kl + ce_weight * ce, (kl, ce)


def global_norm(tree):
  return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree_util.tree_leaves(tree)))


@functools.partial(jax.jit, static_argnames=("cfg", "opt", "tcfg", "ce_weight"),
                   donate_argnums=(0,))
def train_step(state, batch, teacher_params, *, cfg, opt, tcfg=None, ce_weight=0.0):
  """One optimiser step; state = {'step', 'params', 'opt_state'}."""
  params = state["params"]
  if tcfg is None:
    loss, grads = jax.value_and_grad(lm_loss)(params, cfg, batch)
    extra = {}
  else:
    teacher = jax.lax.stop_gradient(logits_of(teacher_params, tcfg, batch[:, :-1]))
    (loss, (kl, ce)), grads = jax.value_and_grad(distill_loss, has_aux=True)(
        params, cfg, batch, teacher, ce_weight)
    extra = {"kl": kl, "ce": ce}
  updates, opt_state = opt.update(grads, state["opt_state"], params)
  new = {"step": state["step"] + 1, "params": optax.apply_updates(params, updates),
         "opt_state": opt_state}
  return new, {"loss": loss, "grad_norm": global_norm(grads), **extra}


@functools.partial(jax.jit, static_argnames=("cfg", "tcfg"))
def eval_step(params, batch, teacher_params, *, cfg, tcfg=None):
  """(sum of token losses, sum of token KLs (0 without a teacher), tokens)."""
  logits = logits_of(params, cfg, batch[:, :-1])
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:])
  n = ce.size
  if tcfg is None:
    return ce.sum(), jnp.zeros(()), n
  teacher = logits_of(teacher_params, tcfg, batch[:, :-1])
  return ce.sum(), kl_to_teacher(teacher, logits) * n, n


def evaluate(params, cfg: ModelConfig, windows: np.ndarray, batch: int,
             teacher=None) -> dict[str, float]:
  """Held-out loss and perplexity (and KL to the teacher) over fixed windows."""
  tcfg, tparams = teacher if teacher is not None else (None, None)
  tot_ce = tot_kl = tot_n = 0.0
  for i in range(0, len(windows), batch):
    ce, kl, n = eval_step(params, jnp.asarray(windows[i:i + batch]), tparams, cfg=cfg,
                          tcfg=tcfg)
    tot_ce, tot_kl, tot_n = tot_ce + float(ce), tot_kl + float(kl), tot_n + int(n)
  out = {"eval_loss": tot_ce / tot_n, "eval_ppl": math.exp(min(tot_ce / tot_n, 50.0))}
  if teacher is not None:
    out["eval_kl"] = tot_kl / tot_n
  return out


def train_config(cfg: ModelConfig, tc, teacher) -> dict[str, Any]:
  """What makes two runs the same run (teacher: (cfg, params) or None)."""
  return {"model": cfg.to_dict(), "train": {k: tc[k] for k in TRAIN_FIELDS},
          "teacher": None if teacher is None else teacher[0].to_dict()}


def settings_of(c, keys) -> dict[str, Any]:
  """The config's values under `keys`, plain (nested ConfigDicts as dicts):
  what a resumable stage records of the settings it depends on
  (workdir.check_stage)."""
  return {k: c[k].to_dict() if hasattr(c[k], "to_dict") else c[k] for k in keys}


def check_same_run(workdir: Path, want: dict[str, Any]) -> None:
  file = workdir / CONFIG_FILE
  if file.is_file():
    have = wd.read_json(file)
    # Model configs compare through ModelConfig, so a field added since the
    # run (with its default) does not make it a different run.
    for key in ("model", "teacher"):
      if have.get(key) is not None:
        have[key] = ModelConfig.from_dict(have[key]).to_dict()
    if wd.normalised(have) != wd.normalised(want):
      raise ConfigError(f"{workdir} holds a training run with a different config "
                        f"({file}); use a new workdir or delete it")
  else:
    workdir.mkdir(parents=True, exist_ok=True)
    wd.write_json(file, want)


def trim_metrics(path: Path, last_step: int) -> None:
  """Drops records past the restored step (written after the last checkpoint)."""
  if path.exists():
    wd.restart_jsonl(path, [r for r in wd.read_jsonl(path) if r.get("step", 0) <= last_step])


def checkpoint_manager(workdir: Path, keep: int):
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  return ocp.CheckpointManager(
      (workdir / CKPT_DIR).absolute(),
      options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))


def _save(mngr, step: int, state) -> None:
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  mngr.save(step, args=ocp.args.StandardSave(state), force=True)


def _abstract_state(cfg: ModelConfig, opt):
  """Shapes and dtypes of the training state: what orbax restores into."""
  params = checkpoint.abstract_params(cfg)
  return {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": params,
          "opt_state": jax.eval_shape(opt.init, params)}


def _restore_step(mngr, step: int, abstract):
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  where = f"training checkpoint {step} in {mngr.directory}"
  item = Path(mngr.directory) / str(step) / "default"  # StandardSave's item
  gaps = checkpoint.orbax_gaps(item) if item.is_dir() else None
  if gaps:  # before orbax, whose failure here prints asyncio tracebacks
    raise CheckpointError(f"{where}: {gaps}")
  try:
    return mngr.restore(step, args=ocp.args.StandardRestore(abstract))
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(f"cannot restore {where}: {str(e).splitlines()[0][:300]}") from e


def restore(mngr, step: int, abstract):
  """The training state saved at `step`. When it cannot be restored, the
  CheckpointError says which older step is intact and how to resume from it
  (the broken one is left for the user to look at, never deleted here)."""
  try:
    return _restore_step(mngr, step, abstract)
  except CheckpointError as e:
    for older in sorted((s for s in mngr.all_steps() if s < step), reverse=True):
      try:
        _restore_step(mngr, older, abstract)
      except CheckpointError:
        continue
      raise CheckpointError(f"{e}; step {older} is intact: move {mngr.directory}/{step} "
                            f"out of {mngr.directory} to resume from it") from None
    raise CheckpointError(f"{e}; no older checkpoint is intact") from None


def resume(mngr, abstract, metrics_path: Path, log: Callable[[str], None]):
  """(state, step) to continue a run from: its last checkpoint, or (None, 0)
  without one. metrics.jsonl is cut back to that step either way: rows past
  it were written after the last checkpoint committed (or by a run killed
  before its first), and the resumed run writes them again."""
  start = mngr.latest_step() or 0
  state = restore(mngr, start, abstract) if start else None
  trim_metrics(metrics_path, start)
  if start:
    log(f"resumed {metrics_path.parent} at step {start}")
  return state, start


def finished_params(workdir: str | os.PathLike, cfg: ModelConfig, tc, teacher=None):
  """The final params of a finished run in `workdir`, or None.

  Raises ConfigError when the workdir's run had a different config.
  """
  workdir = Path(workdir)
  if not (workdir / CKPT_DIR).is_dir():
    return None
  check_same_run(workdir, train_config(cfg, tc, teacher))
  mngr = checkpoint_manager(workdir, int(tc.keep))
  if mngr.latest_step() != int(tc.steps):
    return None
  opt, _ = make_optimizer(tc)
  return restore(mngr, int(tc.steps), _abstract_state(cfg, opt))["params"]


def train(cfg: ModelConfig, tc, workdir: str | os.PathLike, train_stream: np.ndarray,
          eval_stream: np.ndarray, teacher=None, init=None, stop_at: int | None = None,
          progress: bool = True, log: Callable[[str], None] = print):
  """Trains (or resumes) one model; returns its params after the last step run.

  Args:
    cfg: the model (compute in cfg.dtype; train in float32).
    tc: training settings (configs/train.py: steps, batch, seq_len, lr, ...).
    workdir: checkpoints, metrics and the run's config.
    train_stream, eval_stream: token streams (corpus.encode_documents).
    teacher: (cfg, params) of the target; makes this a distillation run.
    init: starting params (e.g. the draft trained with cross-entropy);
      default: random from tc.seed.
    stop_at: stop after this step (an interruption, for tests); the run
      resumes from its last checkpoint when called again.
  """
  validate(tc)
  workdir = Path(workdir)
  check_same_run(workdir, train_config(cfg, tc, teacher))
  opt, schedule = make_optimizer(tc)
  # A copy of `init`: the step donates its state, the caller keeps its arrays.
  params = (jax.tree_util.tree_map(jnp.copy, init) if init is not None
            else model_lib.init_params(cfg, int(tc.seed)))
  state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": opt.init(params)}
  mngr = checkpoint_manager(workdir, int(tc.keep))
  metrics_path = workdir / METRICS_FILE
  restored, start = resume(mngr, _abstract_state(cfg, opt), metrics_path, log)
  state = state if restored is None else restored
  total = int(tc.steps)
  end = total if stop_at is None else min(total, int(stop_at))
  windows = corpus.eval_windows(eval_stream, int(tc.eval_batches) * int(tc.batch),
                                int(tc.seq_len) + 1)
  tcfg, tparams = teacher if teacher is not None else (None, None)
  step_fn = functools.partial(train_step, cfg=cfg, opt=opt, tcfg=tcfg,
                              ce_weight=float(tc.ce_weight))
  eval_fn = lambda params: evaluate(params, cfg, windows, int(tc.batch), teacher)
  state = run_loop(state, step_fn, tparams, eval_fn, tc, schedule, mngr, metrics_path,
                   train_stream, start, end, progress, workdir.name)
  return state["params"]


def run_loop(state, step_fn, aux, eval_fn, tc, schedule, mngr, metrics_path, train_stream,
             start: int, end: int, progress: bool, name: str):
  """Steps start..end-1 of a training run: batch s = batch_at(stream, s)
  (so a resume continues exactly), `step_fn(state, batch, aux)`, metrics
  JSONL every log_every steps (tokens/s without the first step's compile),
  `eval_fn(params)` every eval_every steps, an orbax checkpoint every
  ckpt_every steps and at `end`. Shared by the LM / distillation training
  and the EAGLE head's. Returns the final state."""
  total = int(tc.steps)
  bar = _bar(total, start, progress, name)
  acc: dict[str, list] = {}
  t_last, tokens_last, compile_s = time.perf_counter(), 0, None
  for step in range(start, end):
    batch = jnp.asarray(corpus.batch_at(train_stream, step, int(tc.batch),
                                        int(tc.seq_len) + 1, int(tc.seed)))
    t0 = time.perf_counter()
    state, m = step_fn(state, batch, aux)
    if compile_s is None:  # the first step compiles: keep it out of tok/s
      jax.block_until_ready(m)
      compile_s = time.perf_counter() - t0
      t_last = time.perf_counter()
      tokens_last = 0
    for k, v in m.items():
      acc.setdefault(k, []).append(v)
    tokens_last += int(tc.batch) * int(tc.seq_len)
    done = step + 1
    if done % int(tc.log_every) == 0 or done == end:
      vals = {k: float(np.mean(jax.device_get(v))) for k, v in acc.items()}
      dt = time.perf_counter() - t_last
      rec = {"step": done, **vals, "lr": float(schedule(done - 1)),
             "tokens": done * int(tc.batch) * int(tc.seq_len),
             "tok_s": tokens_last / dt if dt > 0 else None, "compile_s": compile_s}
      wd.append_jsonl(metrics_path, [rec])
      bar.set_postfix(loss=f"{vals['loss']:.3f}", tok_s=f"{rec['tok_s'] or 0:.0f}")
      acc, t_last, tokens_last = {}, time.perf_counter(), 0
    if done % int(tc.eval_every) == 0 or done == total:
      ev = eval_fn(state["params"])
      wd.append_jsonl(metrics_path, [{"step": done, **ev}])
      bar.write(f"{name} step {done}: " + ", ".join(f"{k} {v:.4f}" for k, v in ev.items()))
      t_last = time.perf_counter()  # eval time is not training time
    if done % int(tc.ckpt_every) == 0 or done == end:
      _save(mngr, done, state)
    bar.update(1)
  mngr.wait_until_finished()
  bar.close()
  return state


def _bar(total: int, initial: int, enabled: bool, desc: str):
  from tqdm import tqdm  # pylint: disable=import-outside-toplevel
  return tqdm(total=total, initial=initial, disable=not enabled, desc=desc,
              unit="step", dynamic_ncols=True)


def read_metrics(workdir: str | os.PathLike) -> list[dict[str, Any]]:
  return wd.read_jsonl(Path(workdir) / METRICS_FILE)
