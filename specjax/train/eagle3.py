"""Training the EAGLE-3-style head (drafters/eagle3.py) with training-time
test (TTT): the head runs k steps over a window, step 1 on the target's
fused features, each later step on its own outputs, and a loss at every step.

Step 1 is teacher-forced: pair t = (fuse(target layers at t), x_{t+1}) ->
h^1_t. Step j > 1 feeds pair t the head's own output h^{j-1}_{t-1} with the
true token x_{t+1}: the chain rooted at pair r = t - j + 1, as drafting runs
it. Its query attends to step 1's keys at pairs s <= t - j + 1 (the true
prefix) and to step i's key at pair t - j + i for i = 2..j (its own chain,
EAGLE-3's diagonal), RoPE at each key's pair slot; one softmax over the
union. The loss at step j: cross-entropy of the head's logits over its
reduced set to the target's stored top-K soft labels of x_{t+2} (mass
outside the set ignored), over the pairs whose root exists (t >= j - 1);
the steps weighted decay^(j-1). Invariant: step j's logits at pair t equal a
drafted chain's from root t - j + 1. Derivation: docs/training.md.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import flax.linen as nn
import optax

from specjax.drafters import eagle3 as head3
from specjax.drafters import vocab as vocab_lib
from specjax.errors import ConfigError
from specjax.model import layers
from specjax.model import llama as model_lib
from specjax.model.config import ModelConfig
from specjax.train import corpus
from specjax.train import loop as train_lib

WINDOW_KEYS = ("tokens", "layers", "top_i", "top_p")  # the stored data a window reads
TTT_FIELDS = ("ttt_steps", "ttt_decay")  # head3_train's settings beyond loop.TRAIN_FIELDS

# ---------------------------------------------------------------- the TTT attention


def prefix_mask(n: int, j: int) -> np.ndarray:
  """[n, n] bool: step j's query at pair t sees step 1's key at pair s <= t - j + 1."""
  t, s = np.arange(n)[:, None], np.arange(n)[None, :]
  return s <= t - j + 1


def shift(x, n: int):
  """x [B, T, ...] moved n pairs later along T (x'[t] = x[t - n]), zeros before."""
  if n == 0:
    return x
  pad = jnp.zeros(x.shape[:1] + (n,) + x.shape[2:], x.dtype)
  return jnp.concatenate([pad, x[:, :-n]], 1)[:, :x.shape[1]]


def diagonal(kvs: list, j: int) -> list:
  """Step j's own-chain keys (or values) for each pair t: step i's at pair
  t - j + i, i = 2..j (the last, i = j, is the pair's own); a list of
  [B, T, K, D], each with the pairs t >= j - i valid."""
  return [shift(kvs[i - 1], j - i) for i in range(2, j + 1)]


def step_features(hidden):
  """Step j+1's input features: pair t reads h^j_{t-1} (zeros at pair 0)."""
  return shift(hidden, 1)


def ttt_attention(q, ks: list, vs: list, j: int, dtype):
  """Step j's attention (module docstring): q [B, T, K, G, D]; ks, vs the
  keys and values of steps 1..j, each [B, T, K, D]. Returns [B, T, K, G, D]."""
  n, d = q.shape[1], q.shape[-1]
  prefix = jnp.einsum("btkgd,bskd->bkgts", q, ks[0],
                      preferred_element_type=jnp.float32) / math.sqrt(d)
  prefix = jnp.where(jnp.asarray(prefix_mask(n, j)), prefix, -jnp.inf)
  dk, dv = diagonal(ks, j), diagonal(vs, j)
  valid = [jnp.arange(n) >= j - i for i in range(2, j + 1)]  # pair t - j + i exists
  diag = [jnp.where(ok, jnp.einsum("btkgd,btkd->bkgt", q, k,
                                   preferred_element_type=jnp.float32) / math.sqrt(d), -jnp.inf)
          for ok, k in zip(valid, dk)]
  scores = jnp.concatenate([prefix] + [s[..., None] for s in diag], -1)  # [B, K, G, T, T + j-1]
  probs = jax.nn.softmax(scores, -1).astype(dtype)
  out = jnp.einsum("bkgts,bskd->btkgd", probs[..., :n], vs[0].astype(dtype))
  for i, v in enumerate(dv):
    out = out + jnp.einsum("bkgt,btkd->btkgd", probs[..., n + i], v.astype(dtype))
  return out


# ---------------------------------------------------------------- the head over k steps


def _dense(cfg: ModelConfig, params, x, features: int):
  return layers.dense(cfg, features, "w").apply({"params": params}, x)


def _norm(cfg: ModelConfig, params, x):
  return layers.RMSNorm(cfg).apply({"params": params}, x)


def _qkv(hcfg: ModelConfig, block, x, positions):
  """The block's normed input -> q [B, T, K, G, D], k, v [B, T, K, D] (RoPE at `positions`)."""
  b, t, _ = x.shape
  h, kh, d = hcfg.n_heads, hcfg.n_kv_heads, hcfg.d_head
  a, x = block["attn"], _norm(hcfg, block["attn_norm"], x)
  inv = layers.rope_inv_freq(hcfg)
  q = layers.apply_rope(_dense(hcfg, a["wq"], x, h * d).reshape(b, t, h, d), positions, inv)
  k = layers.apply_rope(_dense(hcfg, a["wk"], x, kh * d).reshape(b, t, kh, d), positions, inv)
  v = _dense(hcfg, a["wv"], x, kh * d).reshape(b, t, kh, d)
  return q.reshape(b, t, kh, h // kh, d), k, v


def ttt_hidden(hparams, tparams, target_feats, tokens, hcfg: ModelConfig, tcfg: ModelConfig,
               k: int) -> list:
  """The head's outputs h^1..h^k [B, T, E] over T pairs (target_feats
  [B, T, 3E] of positions 0..T-1, tokens [B, T] = x_1..x_T), each step
  attending as drafting does (module docstring)."""
  b, t = tokens.shape
  blk = hparams["block"]
  positions = jnp.broadcast_to(jnp.arange(t)[None], (b, t))
  embeds = model_lib.embed_tokens(tparams, tokens, tcfg).astype(hcfg.jnp_dtype)
  feats = head3.fuse(hparams, target_feats)
  ks, vs, out = [], [], []
  for j in range(1, k + 1):
    x = nn.Dense(hcfg.dim, use_bias=True, dtype=hcfg.jnp_dtype,
                 param_dtype=hcfg.jnp_param_dtype).apply(
                     {"params": hparams["fc"]},
                     jnp.concatenate([embeds, feats.astype(hcfg.jnp_dtype)], -1))
    q, kk, vv = _qkv(hcfg, blk, x, positions)
    ks.append(kk)
    vs.append(vv)
    att = ttt_attention(q, ks, vs, j, hcfg.jnp_dtype).reshape(b, t, -1)
    x = x + _dense(hcfg, blk["attn"]["wo"], att, hcfg.dim)
    x = x + layers.MLP(hcfg).apply({"params": blk["mlp"]}, _norm(hcfg, blk["mlp_norm"], x))
    out.append(x)
    feats = step_features(x)
  return out


# ---------------------------------------------------------------- the loss


def set_index(ids, vocab_size: int) -> np.ndarray:
  """[vocab_size] int32: each target id's column in the reduced set, -1 outside it."""
  index = np.full(vocab_size, -1, np.int32)
  index[np.asarray(ids)] = np.arange(len(ids), dtype=np.int32)
  return index


def set_ce(logits, index, top_i, top_p):
  """Per-pair cross-entropy [..] of logits over the set [.., V_d] to the
  target's top-K soft labels (target ids top_i, probs top_p [.., K]); the
  labels outside the set (index -1) count nothing."""
  col = index[top_i]
  logq = jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32), -1),
                             jnp.maximum(col, 0), -1)
  return -jnp.sum(jnp.where(col >= 0, top_p.astype(jnp.float32) * logq, 0.0), -1)


def ttt_loss(hparams, hcfg: ModelConfig, tparams, tcfg: ModelConfig, w, vocab, k: int,
             decay: float):
  """The TTT loss of windows w (WINDOW_KEYS, [B, T+1]) and its per-step
  metrics (ce_j, acc_j: argmax over the set == the target's argmax, over
  the pairs t >= j - 1); vocab = {"ids": [V_d], "index": set_index}."""
  hs = ttt_hidden(hparams, tparams, w["layers"][:, :-1], w["tokens"][:, 1:], hcfg, tcfg, k)
  top_i, top_p = w["top_i"][:, 1:], w["top_p"][:, 1:]  # pair t predicts x_{t+2}
  n = top_i.shape[1]
  total, weights, m = 0.0, 0.0, {}
  for j, h in enumerate(hs, 1):
    logits = head3.head_logits3(hparams, h)
    ok = jnp.broadcast_to(jnp.arange(n)[None] >= j - 1, top_i.shape[:2])  # the root exists
    count = jnp.maximum(jnp.sum(ok), 1)
    ce = jnp.sum(jnp.where(ok, set_ce(logits, vocab["index"], top_i, top_p), 0.0)) / count
    hit = vocab["ids"][jnp.argmax(logits, -1)] == top_i[..., 0]
    m[f"ce_{j}"], m[f"acc_{j}"] = ce, jnp.sum(ok & hit) / count
    total, weights = total + decay ** (j - 1) * ce, weights + decay ** (j - 1)
  return total / weights, {**m, "acc": m["acc_1"]}


def gather(data, pos):
  return {key: data[key][pos] for key in WINDOW_KEYS}


@functools.partial(jax.jit, static_argnames=("cfg", "tcfg", "opt", "k", "decay"),
                   donate_argnums=(0,))
def train_step(state, pos, aux, *, cfg, tcfg, opt, k, decay):
  """One optimiser step on the windows of positions pos [B, T+1]."""
  loss_fn = lambda p: ttt_loss({**p, **aux["frozen"]}, cfg, aux["target"], tcfg,
                               gather(aux["data"], pos), aux["vocab"], k, decay)
  (loss, m), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
  updates, opt_state = opt.update(grads, state["opt_state"], state["params"])
  new = {"step": state["step"] + 1, "params": optax.apply_updates(state["params"], updates),
         "opt_state": opt_state}
  return new, {"loss": loss, "grad_norm": train_lib.global_norm(grads), **m}


@functools.partial(jax.jit, static_argnames=("cfg", "tcfg", "k", "decay"))
def _eval_step(params, pos, aux, *, cfg, tcfg, k, decay):
  loss, m = ttt_loss({**params, **aux["frozen"]}, cfg, aux["target"], tcfg,
                     gather(aux["data"], pos), aux["vocab"], k, decay)
  return {"loss": loss, **m}


def evaluate(params, cfg, tcfg, aux, windows: np.ndarray, batch: int, k: int, decay: float
             ) -> dict[str, float]:
  """The held-out loss and per-step metrics, means over fixed windows."""
  tot: dict[str, list] = {}
  for i in range(0, len(windows), batch):
    m = _eval_step(params, jnp.asarray(windows[i:i + batch]), aux, cfg=cfg, tcfg=tcfg, k=k,
                   decay=decay)
    for key, v in m.items():
      tot.setdefault(key, []).append(float(v))
  return {f"eval_{key}": float(np.mean(v)) for key, v in tot.items()}


def check_settings(tc) -> tuple[int, float]:
  """(k, decay) of head3_train, or one line naming the bad field."""
  train_lib.validate(tc)
  k, decay = int(tc.ttt_steps), float(tc.ttt_decay)
  if not 1 <= k <= int(tc.seq_len):
    raise ConfigError(f"head3_train.ttt_steps must be in [1, seq_len], got {k}")
  if not 0.0 < decay <= 1.0:
    raise ConfigError(f"head3_train.ttt_decay must be in (0, 1], got {decay}")
  return k, decay


def train(cfg: ModelConfig, init, tcfg: ModelConfig, tparams, data, ids, n_train: int, tc,
          workdir: Path, stop_at: int | None = None, progress: bool = True,
          log: Callable[[str], None] = print, run_record: dict | None = None):
  """Trains (or resumes) the head on the stored data (WINDOW_KEYS): positions
  [0, n_train) train, the rest is held out; `ids` is its reduced set.
  run_record: what else makes two runs the same (the layers, the set's
  digest). A head without its own table (head3.LM_HEAD_TARGET) trains
  against the target's rows of the set, frozen. Returns the params after
  the last step run (as `init`: without the frozen table)."""
  k, decay = check_settings(tc)
  want = {**train_lib.train_config(cfg, tc, (tcfg, None)), "kind": "selfdistill-head3",
          "n_train": int(n_train), "n_data": int(len(data["tokens"])),
          **{f: tc[f] for f in TTT_FIELDS}, **(run_record or {})}
  train_lib.check_same_run(workdir, want)
  opt, schedule = train_lib.make_optimizer(tc)
  init = jax.tree_util.tree_map(jnp.copy, init)  # the step donates its state, not the caller's
  state = {"step": jnp.zeros((), jnp.int32), "params": init, "opt_state": opt.init(init)}
  mngr = train_lib.checkpoint_manager(workdir, int(tc.keep))
  metrics_path = workdir / train_lib.METRICS_FILE
  restored, start = train_lib.resume(mngr, jax.eval_shape(lambda: state), metrics_path, log)
  state = state if restored is None else restored
  end = int(tc.steps) if stop_at is None else min(int(tc.steps), int(stop_at))
  n = len(data["tokens"])
  if n - n_train <= int(tc.seq_len) + 1:
    raise ConfigError(f"held-out data of {n - n_train} positions is shorter than one window")
  windows = corpus.eval_windows(np.arange(n_train, n), int(tc.eval_batches) * int(tc.batch),
                                int(tc.seq_len) + 1)
  frozen = {} if "lm_head" in init else {
      "lm_head": {"table": jnp.asarray(vocab_lib.head_table(tparams, ids), jnp.float32)}}
  aux = {"data": {key: jnp.asarray(data[key]) for key in WINDOW_KEYS}, "target": tparams,
         "frozen": frozen,
         "vocab": {"ids": jnp.asarray(ids, jnp.int32),
                   "index": jnp.asarray(set_index(ids, tcfg.vocab_size))}}
  step_fn = functools.partial(train_step, cfg=cfg, tcfg=tcfg, opt=opt, k=k, decay=decay)
  eval_fn = lambda p: evaluate(p, cfg, tcfg, aux, windows, int(tc.batch), k, decay)
  state = train_lib.run_loop(state, step_fn, aux, eval_fn, tc, schedule, mngr, metrics_path,
                             np.arange(n_train), start, end, progress, workdir.name)
  return state["params"]
