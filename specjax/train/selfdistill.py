"""Drafts for a pretrained target, trained here on the target's own replies
(issue 27): an EAGLE head and a distilled draft model, their held-out
acceptance, and their export (experiments/train_smollm2.py,
configs/train.py:smollm2 for SmolLM2-135M-Instruct).

The data (`replies.py`: a prompt mix in the target's chat template, its
replies, follow-ups, stdlib documents) is passed through the target once,
storing each position's feature and top-K soft label; training never runs
the target again. Both losses read batches of positions through
`loop.run_loop`; the draft's embedding starts as the target's projected on
its principal directions. Every stage resumes (`run`). The mix, the losses,
the initialisation and the workdir: docs/training.md, "Self-distillation
for a pretrained target"; the figures: docs/taskbench.md.
"""

from __future__ import annotations

import functools
import os
import random
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax import workdir as wd
from specjax.decode import speculative
from specjax.drafters.eagle import (EagleDrafter, head_config, head_forward, init_head, load_eagle,
                                    reads_prev_token)
from specjax.drafters.eagle import new_cache as new_head_cache
from specjax.drafters.eagle import save_head
from specjax.errors import ConfigError
from specjax.formats import checkpoint, hf
from specjax.model import llama as model_lib
from specjax.model import steps
from specjax.model.config import ModelConfig
from specjax.model.sampling import SamplingParams
from specjax.train import corpus, eagle3_stage, pair, replies
from specjax.train import loop as train_lib

DATA_FILE = "data.npz"
DATA_CONFIG_FILE = "data_config.json"
# What makes two workdirs' data the same (replies, data.npz): a resume with
# other values is refused rather than mixing the two.
DATA_FIELDS = ("target", "seed", "max_files", "mix", "heldout_every", "followups", "n_new",
               "gen_batch", "stdlib_tokens", "doc_len", "eval_share", "top_k")
PROMPTS_FILE = "prompts.json"
SUMMARY_FILE = "summary.json"
ALPHA_FILE = "alpha.json"
# What alpha.json depends on besides the data (recorded beside it, workdir.check_stage).
ALPHA_FIELDS = ("head_name", "head_train", "draft", "draft_train", "export_dtype",
                "alpha_prompts", "alpha_gamma", "alpha_n_predict", "alpha_temps")

# ---------------------------------------------------------------- the two losses


def soft_ce(logits, top_i, top_p):
  """Cross-entropy of logits [..., V] to truncated soft labels (ids, probs [..., K])."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
  return -jnp.sum(top_p.astype(jnp.float32) * jnp.take_along_axis(logp, top_i, -1), -1).mean()


def _gather(data, pos):
  return {k: data[k][pos] for k in ("tokens", "feats", "top_i", "top_p")}


def head_loss(hparams, hcfg: ModelConfig, tparams, tcfg: ModelConfig, w, ce_weight: float,
              noise: float = 0.0, key=None):
  """EAGLE loss of a window of stored data (module docstring); (loss, aux).

  noise > 0: the head's input features get uniform noise in [-noise, noise]
  (drawn from key), the targets stay clean, as EAGLE trains its head to
  run on its own slightly wrong features at the deeper draft levels."""
  hcfg = hcfg.replace(attn_block=0)  # masked attention: reverse mode cannot take the blocked loop
  feats = w["feats"].astype(jnp.float32)
  t = feats.shape[1] - 1
  inp = feats[:, :-1]
  if noise > 0:
    inp = inp + jax.random.uniform(key, inp.shape, jnp.float32, -noise, noise)
  pred, _ = head_forward(hparams, tparams, inp, w["tokens"][:, 1:],
                         new_head_cache(hcfg, feats.shape[0], t), hcfg, tcfg,
                         prev_tokens=w["tokens"][:, :-1])
  pred = pred.astype(jnp.float32)
  vloss = optax.huber_loss(pred, feats[:, 1:], delta=1.0).mean()
  logits = model_lib.head_logits(tparams, pred, tcfg)
  ploss = soft_ce(logits, w["top_i"][:, 1:], w["top_p"][:, 1:])
  acc = jnp.mean(jnp.argmax(logits, -1) == w["top_i"][:, 1:, 0])
  return vloss + ce_weight * ploss, {"vloss": vloss, "ploss": ploss, "acc": acc}


def draft_loss(params, cfg: ModelConfig, w, ce_weight: float):
  """Distillation loss of a window of stored data (module docstring); (loss, aux)."""
  logits = train_lib.logits_of(params, cfg, w["tokens"][:, :-1])
  kl = soft_ce(logits, w["top_i"][:, :-1], w["top_p"][:, :-1])
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, w["tokens"][:, 1:]).mean()
  acc = jnp.mean(jnp.argmax(logits, -1) == w["top_i"][:, :-1, 0])
  return kl + ce_weight * ce, {"kl": kl, "ce": ce, "acc": acc}


def _loss_fn(kind: str, cfg: ModelConfig, tcfg: ModelConfig, ce_weight: float,
             noise: float = 0.0, key=None):
  if kind == "head":
    return lambda p, aux, w: head_loss(p, cfg, aux["target"], tcfg, w, ce_weight, noise, key)
  return lambda p, aux, w: draft_loss(p, cfg, w, ce_weight)


@functools.partial(jax.jit, static_argnames=("kind", "cfg", "tcfg", "opt", "ce_weight", "noise",
                                             "seed"), donate_argnums=(0,))
def train_step(state, pos, aux, *, kind, cfg, tcfg, opt, ce_weight, noise=0.0, seed=0):
  """One optimiser step on the windows of positions pos [B, T+1]; the
  feature noise's key is (seed, step), so a resumed run draws the same."""
  key = jax.random.fold_in(jax.random.PRNGKey(seed), state["step"])
  loss_fn = _loss_fn(kind, cfg, tcfg, ce_weight, noise, key)
  params = state["params"]
  (loss, m), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, aux,
                                                               _gather(aux["data"], pos))
  updates, opt_state = opt.update(grads, state["opt_state"], params)
  new = {"step": state["step"] + 1, "params": optax.apply_updates(params, updates),
         "opt_state": opt_state}
  return new, {"loss": loss, "grad_norm": train_lib.global_norm(grads), **m}


@functools.partial(jax.jit, static_argnames=("kind", "cfg", "tcfg", "ce_weight"))
def _eval_step(params, pos, aux, *, kind, cfg, tcfg, ce_weight):
  loss, m = _loss_fn(kind, cfg, tcfg, ce_weight)(params, aux, _gather(aux["data"], pos))
  return {"loss": loss, **m}


def evaluate(kind: str, params, cfg, tcfg, aux, windows: np.ndarray, batch: int,
             ce_weight: float) -> dict[str, float]:
  tot: dict[str, list] = {}
  for i in range(0, len(windows), batch):
    m = _eval_step(params, jnp.asarray(windows[i:i + batch]), aux, kind=kind, cfg=cfg,
                   tcfg=tcfg, ce_weight=ce_weight)
    for k, v in m.items():
      tot.setdefault(k, []).append(float(v))
  return {f"eval_{k}": float(np.mean(v)) for k, v in tot.items()}


def train(kind: str, cfg: ModelConfig, init, tcfg: ModelConfig, tparams, data, n_train: int,
          tc, workdir: Path, stop_at: int | None = None, progress: bool = True,
          log: Callable[[str], None] = print):
  """Trains (or resumes) the head (kind 'head', cfg its layer config) or the
  draft ('draft') on the stored data: positions [0, n_train) train, the rest
  is held out. Returns the params after the last step run."""
  train_lib.validate(tc)
  noise = float(tc.get("feature_noise", 0.0)) if kind == "head" else 0.0
  if not 0.0 <= noise < 10.0:
    raise ConfigError(f"head_train.feature_noise must be in [0, 10), got {noise}")
  want = {**train_lib.train_config(cfg, tc, (tcfg, None)), "kind": f"selfdistill-{kind}",
          "n_train": int(n_train), "n_data": int(len(data["tokens"]))}
  if noise:  # only then: runs from before the setting stay the same run
    want["feature_noise"] = noise
  if kind == "head" and reads_prev_token(init):  # likewise
    want["prev_token"] = True
  train_lib.check_same_run(workdir, want)
  opt, schedule = train_lib.make_optimizer(tc)
  state = {"step": jnp.zeros((), jnp.int32), "params": init, "opt_state": opt.init(init)}
  mngr = train_lib.checkpoint_manager(workdir, int(tc.keep))
  metrics_path = workdir / train_lib.METRICS_FILE
  restored, start = train_lib.resume(mngr, jax.eval_shape(lambda: state), metrics_path, log)
  state = state if restored is None else restored
  total = int(tc.steps)
  end = total if stop_at is None else min(total, int(stop_at))
  n = len(data["tokens"])
  if n - n_train <= int(tc.seq_len) + 1:
    raise ConfigError(f"held-out data of {n - n_train} positions is shorter than one window")
  windows = corpus.eval_windows(np.arange(n_train, n), int(tc.eval_batches) * int(tc.batch),
                                int(tc.seq_len) + 1)
  aux = {"data": {k: jnp.asarray(data[k]) for k in ("tokens", "feats", "top_i", "top_p")},
         "target": tparams}
  ce_weight = float(tc.ce_weight)
  step_fn = functools.partial(train_step, kind=kind, cfg=cfg, tcfg=tcfg, opt=opt,
                              ce_weight=ce_weight, noise=noise, seed=int(tc.seed))
  eval_fn = lambda p: evaluate(kind, p, cfg, tcfg, aux, windows, int(tc.batch), ce_weight)
  state = train_lib.run_loop(state, step_fn, aux, eval_fn, tc, schedule, mngr, metrics_path,
                             np.arange(n_train), start, end, progress, workdir.name)
  return state["params"]


# ---------------------------------------------------------------- the draft model


def draft_config(tcfg: ModelConfig, m) -> ModelConfig:
  """The distilled draft: the target's vocabulary, special ids, RoPE and
  norms at the config's width and depth, tied embeddings."""
  return tcfg.replace(name=str(m.name), dim=int(m.dim), n_layers=int(m.n_layers),
                      n_heads=int(m.n_heads), n_kv_heads=int(m.n_kv_heads),
                      ffn_dim=int(m.ffn_dim), head_dim=None, tie_embeddings=True,
                      max_seq_len=int(m.max_seq_len), quant=None)


def init_draft(tcfg: ModelConfig, tparams, cfg: ModelConfig, seed: int):
  """Random layers; the embedding = the target's projected on its top
  cfg.dim principal directions (module docstring)."""
  params = model_lib.init_params(cfg, seed)
  table = np.asarray(tparams["embed"]["embedding"], np.float32)[:cfg.padded_vocab]
  u, s, _ = np.linalg.svd(table, full_matrices=False)
  proj = u[:, :cfg.dim] * s[:cfg.dim]
  proj *= float(np.std(np.asarray(params["embed"]["embedding"]))) / float(np.std(proj))
  params = dict(params)
  params["embed"] = {"embedding": jnp.asarray(proj, cfg.jnp_param_dtype)}
  return params


# ---------------------------------------------------------------- the pipeline


def validate(c, tcfg: ModelConfig) -> None:
  """One line for a setting the pipeline cannot run."""
  if int(c.heldout_every) < 2:
    raise ConfigError(f"heldout_every must be >= 2 (every k-th prompt held out), "
                      f"got {c.heldout_every}")
  if not 0.0 < float(c.eval_share) < 0.5:
    raise ConfigError(f"eval_share must be in (0, 0.5), got {c.eval_share}")
  if not 1 <= int(c.top_k) <= tcfg.vocab_size:
    raise ConfigError(f"top_k must be in [1, {tcfg.vocab_size}], got {c.top_k}")
  if not 1 <= int(c.draft.dim) <= tcfg.dim:
    raise ConfigError(f"draft.dim must be in [1, {tcfg.dim}] (the embedding starts from the "
                      f"target's top principal directions), got {c.draft.dim}")
  bad = {k: v for k, v in c.mix.items() if int(v) < 0}
  if bad:
    raise ConfigError(f"mix counts must be >= 0 (prompts per kind), got {bad}")
  if int(c.n_new) < 1 or int(c.gen_batch) < 1:
    raise ConfigError(f"n_new and gen_batch must be >= 1, got {c.n_new}, {c.gen_batch}")


def _check_same_data(c, work: Path) -> None:
  want = {k: (c[k].to_dict() if hasattr(c[k], "to_dict") else c[k]) for k in DATA_FIELDS}
  # a kind at 0 is no kind: a mix from before a kind existed stays the same data
  want["mix"] = {k: v for k, v in want["mix"].items() if int(v)}
  # the mix's templates and split (replies.MIX_VERSION): a workdir from an older one is other data
  want["mix_version"] = replies.MIX_VERSION
  file = work / DATA_CONFIG_FILE
  if file.is_file():
    if wd.normalised(wd.read_json(file)) != wd.normalised(want):
      raise ConfigError(f"{work} holds data made with other settings ({file}); use a new "
                        f"workdir or delete it")
  else:
    work.mkdir(parents=True, exist_ok=True)
    wd.write_json(file, want)


def _load_data(path: Path) -> dict[str, np.ndarray]:
  try:
    with np.load(path) as z:
      return {k: z[k] for k in z.files}
  except Exception as e:  # pylint: disable=broad-except
    raise ConfigError(f"{path} is unreadable ({type(e).__name__}); delete it to rebuild "
                      f"it from the stored replies") from None


def _data(c, target: steps.Runner, tok, work: Path, log) -> tuple[dict, int, list[dict]]:
  """Builds (or reads) data.npz; returns (data, n_train positions, held-out prompts)."""
  _check_same_data(c, work)
  mix_file = work / PROMPTS_FILE
  if mix_file.is_file():
    mix = wd.read_json(mix_file)
  else:
    mix = replies.prompt_mix(dict(c.mix), int(c.seed), int(c.heldout_every), int(c.max_files))
    work.mkdir(parents=True, exist_ok=True)
    wd.write_json(mix_file, mix)
  held = [r for r in mix if r["heldout"]]
  train_convs = [r for r in mix if not r["heldout"]]
  if (work / DATA_FILE).is_file():
    data = _load_data(work / DATA_FILE)
    return data, int(data["n_train"]), held
  log(f"data: {len(train_convs)} training prompts ({len(held)} held out); the target's "
      f"replies, {int(c.n_new)} tokens at most")
  # The edits are answered in batches of their own ("edit-NNNN"), so adding
  # them to a mix keeps the stored replies of the rest.
  base = [r for r in train_convs if r["kind"] != "edit"]
  edits = [r for r in train_convs if r["kind"] == "edit"]
  first = replies.generate_replies(target, tok, base, int(c.n_new), int(c.gen_batch),
                             work / "gen", "first", log)
  follow = replies.with_followups(base, first, tok, int(c.followups), int(c.seed))
  f_replies = replies.generate_replies(target, tok, follow, int(c.n_new), int(c.gen_batch),
                               work / "gen", "followup", log)
  e_replies = replies.generate_replies(target, tok, edits, int(c.n_new), int(c.gen_batch),
                                       work / "gen", "edit", log) if edits else []
  seqs = [tok.encode_chat(r["messages"]) + rep
          for r, rep in zip(base + follow + edits, first + f_replies + e_replies)]
  seqs += replies.stdlib_documents(tok, int(c.stdlib_tokens), int(c.doc_len), int(c.max_files),
                                   exclude=replies.heldout_files(mix))
  random.Random(int(c.seed)).shuffle(seqs)
  n_held = max(1, int(len(seqs) * float(c.eval_share)))
  data = replies.features(target, seqs[n_held:] + seqs[:n_held], int(c.top_k),
                          int(c.feat_batch), log)
  data["n_train"] = np.asarray(int(data["starts"][len(seqs) - n_held]))
  tmp = work / (DATA_FILE + ".partial.npz")
  np.savez(tmp, **data)
  os.replace(tmp, work / DATA_FILE)  # whole or absent: an interrupted write is redone
  return data, int(data["n_train"]), held


def measure_alpha(target: steps.Runner, tok, prompts: list[list[int]], head_dir: Path | None,
                  draft: steps.Runner | None, gamma: int, n_predict: int, temps, seed: int = 0
                  ) -> dict[str, Any]:
  """Real acceptance (the engine) of the head and the draft on held-out prompts."""
  out: dict[str, Any] = {}
  for name in ("eagle", "draft"):
    if (name == "draft" and draft is None) or (name == "eagle" and head_dir is None):
      continue
    out[name] = {}
    for t in temps:
      kw = ({"drafter": EagleDrafter(str(head_dir))} if name == "eagle" else {"rule": "real"})
      s = speculative.generate(target, None if name == "eagle" else draft, prompts, n_predict,
                               gamma, sp=SamplingParams(float(t)), seed=seed,
                               eos_id=tok.eos_id, **kw).stats
      out[name][f"{float(t):g}"] = {"alpha": s.alpha, "tokens_per_step": s.tokens_per_step,
                                    "alpha_at_pos": s.alpha_at_pos, "n_steps": s.n_steps}
  return out


def plot(work: Path, path: Path) -> None:
  """Both runs: held-out loss and top-1 agreement against tokens seen."""
  plt = wd.pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
  for kind, col in (("head", "C0"), ("draft", "C1")):
    if not (work / kind / train_lib.METRICS_FILE).is_file():
      continue
    recs = train_lib.read_metrics(work / kind)
    tr = [r for r in recs if "loss" in r]
    ev = [r for r in recs if "eval_loss" in r]
    per = tr[0]["tokens"] / tr[0]["step"] if tr else 1
    axes[0].plot([r["tokens"] / 1e6 for r in tr], [r["loss"] for r in tr], color=col, lw=1,
                 label=f"{kind} train")
    axes[0].plot([r["step"] * per / 1e6 for r in ev], [r["eval_loss"] for r in ev], "o--",
                 color=col, ms=4, label=f"{kind} held-out")
    axes[1].plot([r["tokens"] / 1e6 for r in tr], [r["acc"] for r in tr], color=col, lw=1,
                 label=f"{kind} train")
    axes[1].plot([r["step"] * per / 1e6 for r in ev], [r["eval_acc"] for r in ev], "o--",
                 color=col, ms=4, label=f"{kind} held-out")
  axes[0].set_ylabel("loss (head: vloss + w ploss; draft: soft CE + w CE)")
  axes[1].set_ylabel("top-1 agreement with the target")
  for ax in axes:
    ax.set_xlabel("tokens seen (M)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.suptitle("Drafts for SmolLM2-135M-Instruct, trained on its own replies")
  wd.save_figure(fig, path)


def run(c, workdir: str | os.PathLike, export_dir: str | os.PathLike | None = None,
        progress: bool = True, log: Callable[[str], None] = print,
        stages: tuple[str, ...] = ("head", "draft")) -> dict[str, Any]:
  """The whole pipeline (module docstring) for the target c.target; exports
  <export_dir>/<c.head_name> and <c.draft.name>. Returns the summary."""
  work = Path(workdir)
  for path, what in ((work, "--workdir"), (export_dir, "--export_dir")):
    if path is not None:  # refused before hours of work, not after
      wd.check_output_dir(path, what)
  tcfg, tparams, tok = checkpoint.load_model(str(c.target), dtype="float32")
  if tok is None or tok.chat is None:
    raise ConfigError(f"target {c.target}: the prompt mix needs its tokenizer and chat template")
  validate(c, tcfg)
  target = steps.Runner(tcfg, tparams)
  data, n_train, held = _data(c, target, tok, work, log)
  log(f"data: {len(data['tokens']):,} positions ({n_train:,} train)")
  dt = str(c.export_dtype)
  summary: dict[str, Any] = {"target": str(c.target), "positions": int(len(data["tokens"])),
                             "train_positions": n_train, "export_dtype": dt}
  head_dir = draft_runner = None
  if "head" in stages:
    hcfg = head_config(tcfg)
    init = init_head(hcfg, int(c.head_train.seed), bool(c.head_train.get("prev_token", False)))
    hparams = train("head", hcfg, init, tcfg, tparams, data,
                    n_train, c.head_train, work / "head", progress=progress, log=log)
    head_dir = save_head(work / str(c.head_name), hcfg, hparams, tcfg, str(c.target), dt)
    summary["head"] = {"params": model_lib.param_count(hparams),
                       "train_seconds": pair.train_seconds(work / "head")}
  if "draft" in stages:
    dcfg = draft_config(tcfg, c.draft)
    dparams = train("draft", dcfg, init_draft(tcfg, tparams, dcfg, int(c.draft_train.seed)),
                    tcfg, tparams, data, n_train, c.draft_train, work / "draft",
                    progress=progress, log=log)
    cast = jax.tree_util.tree_map(lambda x: x.astype(dt), dparams)
    hf.save_hf(work / dcfg.name, dcfg.with_dtype(dt), cast)
    rcfg, rparams, _ = checkpoint.load_model(str(work / dcfg.name), "float32", role="draft")
    draft_runner = steps.Runner(rcfg, rparams)
    summary["draft"] = {"config": dcfg.to_dict(), "params": model_lib.param_count(dparams),
                        "init": "target embedding, top principal directions",
                        "train_seconds": pair.train_seconds(work / "draft")}
  if "head3" in stages:  # the EAGLE-3 head: trained, measured, saved and exported there
    summary["head3"] = eagle3_stage.run(c, work, target, tok, data, n_train, held, export_dir,
                                        progress, log)
  if {"head", "draft"} & set(stages):
    plot(work, work / "training.png")
  prompts = [tok.encode_chat(r["messages"]) for r in held[:int(c.alpha_prompts)]]
  alpha_file = work / ALPHA_FILE
  reuse = wd.check_stage(work / "alpha.settings.json",
                         train_lib.settings_of(c, DATA_FIELDS + ALPHA_FIELDS), [alpha_file],
                         f"delete {alpha_file} to measure again, or use a new --workdir")
  alpha = wd.read_json(alpha_file) if reuse else {}
  missing_head = head_dir if head_dir is not None and "eagle" not in alpha else None
  missing_draft = draft_runner if draft_runner is not None and "draft" not in alpha else None
  if missing_head is not None or missing_draft is not None:
    log(f"acceptance on {len(prompts)} held-out prompts")
    alpha.update(measure_alpha(target, tok, prompts, missing_head, missing_draft,
                               int(c.alpha_gamma), int(c.alpha_n_predict),
                               tuple(c.alpha_temps)))
    alpha.update(gamma=int(c.alpha_gamma), n_predict=int(c.alpha_n_predict),
                 prompts=len(prompts))
    wd.write_json(alpha_file, alpha)
  summary["alpha"] = alpha
  for kind in stages:
    recs = [r for r in train_lib.read_metrics(work / kind) if "eval_loss" in r]
    summary.setdefault(kind, {})["heldout"] = recs[-1] if recs else None
  wd.write_json(work / SUMMARY_FILE, summary)
  if export_dir is not None:
    out = Path(export_dir)
    if head_dir is not None:
      _, hp, _ = load_eagle(head_dir)
      summary["exported_head"] = str(save_head(out / str(c.head_name), head_config(tcfg), hp,
                                               tcfg, str(c.target), dt, {"training": summary}))
    if draft_runner is not None:
      d = out / str(c.draft.name)
      hf.save_hf(d, draft_runner.cfg.with_dtype(dt), jax.tree_util.tree_map(
          lambda x: x.astype(dt), draft_runner.params))
      wd.write_json(d / "training.json", summary)
      summary["exported_draft"] = str(d)
  return summary
