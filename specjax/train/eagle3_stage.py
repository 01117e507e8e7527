"""The EAGLE-3 head's stage of the self-distillation pipeline
(`selfdistill.run(stages=("head3",))`, experiments/train_smollm2.py
--stages=head3): the target's three layers' outputs for every stored
position, the reduced set from the target's replies, the TTT training
(train/eagle3.py), the curves and the export (`smollm2-eagle3`).

The layers' outputs are stored, not recomputed per batch: one frozen target
pass over data.npz's sequences writes `layers.npy` ([N, 3E] float16, 2.0 GB
for the 586 k positions of the SmolLM2 mix; the batches then cost no target
pass). It is derived from data.npz's tokens, so a workdir built before the
stage existed gets it without regenerating anything; its settings (target,
layers, the tokens' digest) are recorded, and other layers or other data
are refused in one line. The set: the target's special tokens and its most
frequent tokens over the training replies (gen/, the only replies the data
stage generates: held-out prompts are never answered). docs/training.md.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax import workdir as wd
from specjax.decode import speculative
from specjax.drafters import eagle
from specjax.drafters import eagle3 as head3
from specjax.drafters import vocab
from specjax.errors import ConfigError
from specjax.model import steps
from specjax.model.config import ModelConfig
from specjax.model.sampling import SamplingParams
from specjax.train import eagle3 as ttt
from specjax.train import loop as train_lib
from specjax.train import pair

LAYERS_FILE = "layers.npy"
LAYERS_RECORD = "layers.settings.json"
RUN_DIR = "head3"          # the training run (orbax checkpoints, metrics.jsonl)
VOCAB_DIR = "head3_vocab"  # the set and its ranking (vocab.VOCAB_FILE)
PLOT_FILE = "training_head3.png"
ALPHA_FILE = "alpha_head3.json"
# What alpha_head3.json depends on besides the data and the head's training.
ALPHA_FIELDS = ("alpha_prompts", "alpha_gamma", "alpha_n_predict", "alpha_temps", "head3_dtype",
                "head3_name", "head3_vocab", "head3_layers", "head3_train", "head3_lm_head",
                "head3_init")
F16_MAX = float(np.finfo(np.float16).max)
# selfdistill's reply batches: first replies, follow-ups, edits (train prompts only)
REPLY_TAGS = ("first", "followup", "edit")

# ---------------------------------------------------------------- the layers' outputs


def spans(starts, n: int) -> list[tuple[int, int]]:
  """The stored sequences as (start, end) position spans of an n-position stream."""
  bounds = [int(s) for s in starts] + [int(n)]
  return list(zip(bounds[:-1], bounds[1:]))


def layer_features(target: steps.Runner, tokens: np.ndarray, starts, layers, batch: int,
                   path: Path, log: Callable[[str], None] = print) -> None:
  """Writes `path` ([N, len(layers) * E] float16): each stored sequence's
  layers' outputs from one target pass, in stream order. Whole or absent:
  written beside it and renamed when complete."""
  seqs = spans(starts, len(tokens))
  width = len(layers) * target.cfg.dim
  tmp = path.with_name(path.name + ".partial.npy")
  out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float16, shape=(len(tokens), width))
  order = sorted(range(len(seqs)), key=lambda i: seqs[i][1] - seqs[i][0])
  for b in range(0, len(order), batch):
    idx = order[b:b + batch]
    rows = [tokens[seqs[i][0]:seqs[i][1]].tolist() for i in idx]
    cache = target.new_cache(len(rows), steps.prefill_bucket(max(map(len, rows))))
    _, _, hidden = target.prefill(rows, cache, return_hidden=True, hidden_layers=tuple(layers))
    hidden = np.asarray(hidden, np.float32)
    for j, i in enumerate(idx):
      s, e = seqs[i]
      part = hidden[j, :e - s]
      if not np.all(np.abs(part) < F16_MAX):
        raise ConfigError(f"layers {list(layers)}: an output beyond float16's range "
                          f"({float(np.abs(part).max()):.3g}); they cannot be stored as float16")
      out[s:e] = part
    if (b // batch) % 50 == 0:
      log(f"layer features: {min(len(order), b + batch)}/{len(order)} sequences")
  out.flush()
  del out
  os.replace(tmp, path)


def tokens_digest(tokens: np.ndarray) -> str:
  return hashlib.sha256(np.ascontiguousarray(tokens, np.int32).tobytes()).hexdigest()[:16]


def stored_layers(c, target: steps.Runner, data, layers, work: Path,
                  log: Callable[[str], None] = print) -> np.ndarray:
  """layers.npy of the workdir (computed when absent), as a read-only map;
  one line when it was made for other layers or other data."""
  want = {"target": str(c.target), "layers": [int(i) for i in layers],
          "positions": int(len(data["tokens"])), "tokens_sha256": tokens_digest(data["tokens"])}
  file = work / LAYERS_FILE
  if not wd.check_stage(work / LAYERS_RECORD, want, [file],
                        f"move {file} aside to compute it for these settings"):
    log(f"layer features: layers {list(layers)} of {len(data['starts'])} sequences")
    layer_features(target, data["tokens"], data["starts"], layers, int(c.feat_batch), file, log)
  return np.load(file, mmap_mode="r")


# ---------------------------------------------------------------- the reduced set


def training_replies(work: Path) -> list[list[int]]:
  """The target's replies the data stage stored (gen/<tag>-NNNN.json of
  REPLY_TAGS: training prompts only; another tag, such as draft_vocab.py's
  'heldout', is never counted)."""
  files = sorted(f for tag in REPLY_TAGS for f in (work / "gen").glob(f"{tag}-*.json"))
  if not files:
    raise ConfigError(f"{work / 'gen'} holds no replies: run the data stage first")
  return [r for f in files for r in wd.read_json(f)]


def reply_set(tok, work: Path, size: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray,
                                                                     list[int], float]:
  """(the sorted set of `size` ids, the full ranking, the special ids, the
  set's coverage of the training replies' tokens)."""
  seqs = training_replies(work)
  counts = vocab.count_tokens(seqs, vocab_size)
  special = [i for i in tok.special_ids() if i < vocab_size]
  ids = vocab.top_ids(counts, int(size), special)
  return ids, vocab.ranking(counts, special), special, vocab.coverage(ids, seqs)


# ---------------------------------------------------------------- the stage


def init_params(hcfg: ModelConfig, tparams, ids, seed: int, lm_head: str = head3.LM_HEAD_OWN,
                warm: str = ""):
  """The head's first params. Random fuse, fc and layer (init_head3); its
  own LM head (LM_HEAD_OWN) starts as the target's rows of the set, and the
  final norm as the target's (the outputs start where the target's final
  states live). `warm`, an EAGLE-1 head (name or path): fc and layer start
  as that head's, fuse as the target's final norm on the third layer (zero
  on the others), the norm as ones, so that with the last layer as the
  third, step 1 ranks tokens as the EAGLE-1 head does (docs/training.md)."""
  params = dict(head3.init_head3(hcfg, len(ids), seed, lm_head))
  scale = jnp.asarray(tparams["final_norm"]["scale"], jnp.float32)
  if lm_head == head3.LM_HEAD_OWN:
    params["lm_head"] = {"table": jnp.asarray(vocab.head_table(tparams, ids), jnp.float32)}
  params["norm"] = {"scale": scale}
  if warm:
    ecfg, eparams, _ = eagle.load_eagle(warm)
    if eagle.reads_prev_token(eparams) or (ecfg.dim, ecfg.ffn_dim) != (hcfg.dim, hcfg.ffn_dim):
      raise ConfigError(f"head3_init {warm!r}: not an EAGLE-1 head of this shape "
                        f"(dim {hcfg.dim}, ffn {hcfg.ffn_dim}, the pair (feature, token))")
    e = hcfg.dim
    fuse = jnp.zeros((3 * e, e), jnp.float32).at[2 * e:].set(jnp.diag(scale))
    params.update(fc=eparams["fc"], block=eparams["block"], fuse={"kernel": fuse},
                  norm={"scale": jnp.ones((e,), jnp.float32)})
  return params


def _layers(c, tcfg: ModelConfig) -> tuple[int, ...]:
  layers = tuple(int(i) for i in c.head3_layers) or head3.default_layers(tcfg.n_layers)
  if len(layers) != 3 or not all(0 <= i < tcfg.n_layers for i in layers):
    raise ConfigError(f"head3_layers {list(layers)}: three layers of the target's "
                      f"{tcfg.n_layers} (or () for 2, L//2, L-3)")
  return layers


def measure_alpha(c, target: steps.Runner, tok, held: list[dict], head_dir: str, data,
                  work: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
  """The saved head's acceptance (the engine, a gamma-alpha_gamma chain) on
  the first alpha_prompts held-out prompts at each of alpha_temps; kept in
  ALPHA_FILE and reused for the same settings and data."""
  file = work / ALPHA_FILE
  want = {**train_lib.settings_of(c, ALPHA_FIELDS), "tokens_sha256": tokens_digest(data["tokens"])}
  if wd.check_stage(work / "alpha_head3.settings.json", want, [file],
                    f"delete {file} to measure again, or use a new --workdir"):
    return wd.read_json(file)
  prompts = [tok.encode_chat(r["messages"]) for r in held[:int(c.alpha_prompts)]]
  log(f"head3: acceptance on {len(prompts)} held-out prompts")
  out: dict[str, Any] = {"gamma": int(c.alpha_gamma), "n_predict": int(c.alpha_n_predict),
                         "prompts": len(prompts)}
  for t in c.alpha_temps:
    s = speculative.generate(target, None, prompts, int(c.alpha_n_predict), int(c.alpha_gamma),
                             sp=SamplingParams(float(t)), seed=0, eos_id=tok.eos_id,
                             drafter=f"eagle3:{head_dir}").stats
    out[f"{float(t):g}"] = {"alpha": s.alpha, "tokens_per_step": s.tokens_per_step,
                            "alpha_at_pos": s.alpha_at_pos, "n_steps": s.n_steps}
  wd.write_json(file, out)
  return out


def run(c, work: Path, target: steps.Runner, tok, data, n_train: int, held: list[dict],
        export_dir: str | os.PathLike | None = None, progress: bool = True,
        log: Callable[[str], None] = print) -> dict[str, Any]:
  """The stage (module docstring) on the stored data (data.npz: positions
  [0, n_train) train) with the held-out prompts `held` for its acceptance;
  returns its part of the summary."""
  tcfg, tparams = target.cfg, target.params
  ttt.check_settings(c.head3_train)
  layers = _layers(c, tcfg)
  ids, ranked, special, cover = reply_set(tok, work, int(c.head3_vocab), tcfg.vocab_size)
  vocab.save(work / VOCAB_DIR, ids, tcfg.vocab_size, special, ranked=ranked)
  cover_held = vocab.coverage(ids, [data["tokens"][n_train:]])
  log(f"head3: {len(ids)} ids ({len(special)} special) cover {cover:.3f} of the training "
      f"replies' tokens, {cover_held:.3f} of the held-out positions; layers {list(layers)}, "
      f"{int(c.head3_train.ttt_steps)} TTT steps")
  feats = stored_layers(c, target, data, layers, work, log)
  hcfg = head3.head_config(tcfg)
  stored = {"tokens": data["tokens"], "layers": feats, "top_i": data["top_i"],
            "top_p": data["top_p"]}
  kind, warm = str(c.head3_lm_head), str(c.head3_init)
  if kind not in (head3.LM_HEAD_OWN, head3.LM_HEAD_TARGET):
    raise ConfigError(f"head3_lm_head {kind!r}: expected {head3.LM_HEAD_OWN!r} (trained, "
                      f"stored) or {head3.LM_HEAD_TARGET!r} (the target's rows, frozen)")
  record = {"layers": list(layers), "set_size": int(len(ids)),
            "set_sha256": tokens_digest(ids), "lm_head": kind, "init": warm}
  init = init_params(hcfg, tparams, ids, int(c.head3_train.seed), kind, warm)
  params = ttt.train(hcfg, init, tcfg,
                     tparams, stored, ids, n_train, c.head3_train, work / RUN_DIR,
                     progress=progress, log=log, run_record=record)
  out = {"params": int(sum(x.size for x in jax.tree_util.tree_leaves(params))),
         "train_seconds": pair.train_seconds(work / RUN_DIR), "layers": list(layers),
         "ttt_steps": int(c.head3_train.ttt_steps),
         "vocab": {"size": int(len(ids)), "special": len(special),
                   "coverage_train_replies": cover, "coverage_heldout_positions": cover_held}}
  plot(work / RUN_DIR, work / PLOT_FILE, int(c.head3_train.ttt_steps))
  dt = str(c.head3_dtype)
  save = lambda d, extra: str(head3.save_head3(d, hcfg, params, layers, ids, tcfg, str(c.target),
                                               special, dt, extra))
  out["saved"] = save(work / str(c.head3_name), None)
  out["alpha"] = measure_alpha(c, target, tok, held, out["saved"], data, work, log)
  if export_dir is not None:
    out["exported"] = save(Path(export_dir) / str(c.head3_name), {"training": out})
  return out


def plot(run_dir: Path, path: Path, k: int) -> None:
  """The TTT loss, and the top-1 agreement at each step j = 1..k (held-out:
  markers), against tokens seen: acceptance along the draft."""
  recs = train_lib.read_metrics(run_dir)
  tr = [r for r in recs if "loss" in r]
  ev = [r for r in recs if "eval_loss" in r]
  if not tr:
    return
  per = tr[0]["tokens"] / tr[0]["step"]
  plt = wd.pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
  axes[0].plot([r["tokens"] / 1e6 for r in tr], [r["loss"] for r in tr], lw=1, label="train")
  axes[0].plot([r["step"] * per / 1e6 for r in ev], [r["eval_loss"] for r in ev], "o--", ms=4,
               label="held-out")
  for j in range(1, k + 1):
    col = f"C{(j - 1) % 10}"
    axes[1].plot([r["tokens"] / 1e6 for r in tr], [r[f"acc_{j}"] for r in tr], color=col, lw=1,
                 alpha=0.6, label=f"step {j}")
    axes[1].plot([r["step"] * per / 1e6 for r in ev], [r[f"eval_acc_{j}"] for r in ev], "o--",
                 color=col, ms=4)
  axes[0].set_ylabel("TTT loss (set cross-entropy, steps weighted)")
  axes[1].set_ylabel("top-1 agreement at TTT step j (o: held-out)")
  for ax in axes:
    ax.set_xlabel("tokens seen (M)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.suptitle("EAGLE-3 head, trained with training-time test on the target's replies")
  wd.save_figure(fig, path)
