"""Speculative decoding as fixed-shape XLA programs.

One step, for every row b of the batch (n = tokens so far, `last` = the last
emitted token, not yet seen by the target):
  draft:   gamma T=1 draft steps in one lax.scan -> drafts [B, G], q [B, G, V]
  verify:  one target forward over [last, d_1..d_G] (T = G+1) -> p [B, G+1, V]
  accept:  k accepted drafts and one target token (acceptance.judge)
  commit:  emit d_1..d_k and that token; set both cache lengths (rollback by
           length, no copy).
Invariant between steps: the target cache holds the sequence minus `last`
(length n-1). The draft cache holds the same, except after a step that
accepted all G drafts: then it lacks d_G too (length n-2), and the next draft
phase first feeds it (a lax.cond), so no token is dropped or duplicated.

Two loops run the same phase functions with the same keys and emit identical
tokens: `device` (one lax.while_loop, one host transfer at the end) and `host`
(a Python loop that times draft, verify and accept separately).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax import acceptance, generation, model, sampling, steps
from specjax import kv_cache as kvc
from specjax.acceptance import AcceptRule
from specjax.config import ModelConfig
from specjax.errors import ConfigError
from specjax.sampling import SamplingParams
from specjax.stats import Records, SpecStats
from specjax.timing import CompileWatch, block


@dataclasses.dataclass(frozen=True)
class SpecConfig:
  """Static settings of a speculative run (a jit static argument)."""
  target: ModelConfig
  draft: ModelConfig
  gamma: int
  sp: SamplingParams = SamplingParams()
  simulated: bool = False  # a simulated rule; its per-position probabilities are traced
  p_min: float = 0.0    # draft early stop: stop when the draft's top prob < p_min

  def __post_init__(self):
    if self.gamma < 1:
      raise ConfigError(f"gamma (draft length) must be >= 1, got {self.gamma}")
    if not 0.0 <= self.p_min <= 1.0:
      raise ConfigError(f"p_min must lie in [0, 1], got {self.p_min}")
    if self.target.vocab_size != self.draft.vocab_size:
      raise ConfigError(
          f"draft and target vocabularies differ: target {self.target.name} has "
          f"{self.target.vocab_size} tokens, draft {self.draft.name} has "
          f"{self.draft.vocab_size}")
  @property
  def needs_q(self) -> bool:
    return not self.simulated and not self.sp.greedy


@struct.dataclass
class SpecState:
  tcache: kvc.KVCache
  dcache: kvc.KVCache
  tail: jax.Array  # [B, 2] the last two emitted tokens (prev, last)
  n: jax.Array     # [B] sequence length so far (prompt + emitted)


def draft_phase(dparams, dcache, tail, n, key, sc: SpecConfig):
  """Drafts G tokens per row. Returns (drafts [B,G], q [B,G,V] or [B,G,0],
  n_drafted [B], dcache with length n-1+G)."""
  cfg, sp = sc.draft, sc.sp

  def catch_up(c):  # feed d_G, left over from a fully accepted step
    c = kvc.rollback(c, n - 2)
    return model.forward(dparams, tail[:, :1], c, cfg)[1]

  dcache = jax.lax.cond(jnp.any(dcache.lengths < n - 1), catch_up, lambda c: c, dcache)

  def body(carry, k):
    tok, c, active = carry
    logits, c = model.forward(dparams, tok[:, None], c, cfg)
    logits = logits[:, 0]
    q = sampling.probs(logits, sp)
    nxt = jnp.argmax(logits, -1).astype(jnp.int32) if sp.greedy else sampling.sample(k, q)
    if sc.p_min > 0:
      top = jnp.max(jax.nn.softmax(logits) if sp.greedy else q, -1)
      active = active & (top >= sc.p_min)
    return (nxt, c, active), (nxt, q if sc.needs_q else q[:, :0], active)

  b = tail.shape[0]
  init = (tail[:, 1], dcache, jnp.ones((b,), bool))
  (_, dcache, _), (drafts, q, active) = jax.lax.scan(
      body, init, jax.random.split(key, sc.gamma))
  n_drafted = jnp.sum(active, 0).astype(jnp.int32)
  return drafts.T, jnp.swapaxes(q, 0, 1), n_drafted, dcache


def verify_phase(tparams, tcache, tail, drafts, sc: SpecConfig):
  """Target distributions p [B, G+1, V] at [last, d_1..d_G]; tcache + G+1."""
  tokens = jnp.concatenate([tail[:, 1:], drafts], 1)  # [B, G+1]
  logits, tcache = model.forward(tparams, tokens, tcache, sc.target)
  return sampling.probs(logits, sc.sp), tcache


def accept_phase(key, accept_probs, p, q, drafts, n_drafted, tail, n, live, sc: SpecConfig):
  """Judges the drafts and advances the sequence bookkeeping.

  Rows that are not `live` (finished) keep their state. Returns a dict with
  n_acc, emitted [B, G+1] (valid up to n_emit), n_emit, tail, n, and the new
  cache lengths t_len / d_len to roll back to.
  """
  g = sc.gamma
  n_acc, nxt = acceptance.judge(key, sc.simulated, accept_probs, sc.sp, drafts, q, p, n_drafted)
  pos = jnp.arange(g + 1)[None, :]
  padded = jnp.concatenate([drafts, drafts[:, :1]], 1)
  emitted = jnp.where(pos == n_acc[:, None], nxt[:, None], padded)
  prev_last = jnp.take_along_axis(drafts, jnp.maximum(n_acc - 1, 0)[:, None], 1)[:, 0]
  prev = jnp.where(n_acc > 0, prev_last, tail[:, 1])
  keep = lambda new, old: jnp.where(live, new, old)
  new_n = n + n_acc + 1
  return dict(
      n_acc=n_acc, emitted=emitted, n_emit=n_acc + 1,
      tail=jnp.where(live[:, None], jnp.stack([prev, nxt], 1), tail),
      n=keep(new_n, n),
      t_len=keep(new_n - 1, n - 1),
      # After the scan the draft cache holds n-1+G entries (s_{n-1}, d_1..d_{G-1});
      # d_G never entered it, so only a fully accepted step leaves it behind.
      d_len=keep(jnp.minimum(new_n - 1, n - 1 + g), n - 1))


@dataclasses.dataclass
class SpecResult:
  tokens: list[list[int]]   # generated ids per row (prompt excluded)
  stats: SpecStats
  prompt_s: float           # prefill of both models
  eval_s: float             # speculative loop
  compile_s: float = 0.0
  records: Records | None = None  # per-step records behind `stats`


def _bookkeep(out, count, done, a, eos_id, n_predict):
  """Writes the emitted tokens at each row's count; stops rows at eos/n_predict."""
  g1 = a["emitted"].shape[1]
  pos = jnp.arange(g1)[None, :]
  valid = pos < a["n_emit"][:, None]
  is_eos = valid & (a["emitted"] == eos_id)
  first_eos = jnp.where(jnp.any(is_eos, 1), jnp.argmax(is_eos, 1) + 1, g1 + 1)
  n_emit = jnp.minimum(a["n_emit"], first_eos)
  n_emit = jnp.where(done, 0, jnp.minimum(n_emit, n_predict - count))
  write = jax.vmap(lambda o, e, c: jax.lax.dynamic_update_slice(o, e, (c,)))
  out = jnp.where(done[:, None], out, write(out, a["emitted"], count))
  count = count + n_emit
  done = done | (count >= n_predict) | (n_emit >= first_eos)
  return out, count, done


@functools.partial(jax.jit, static_argnames=("sc", "n_predict", "eos_id"),
                   donate_argnames=("state",))
def spec_loop(tparams, dparams, state: SpecState, out, key, accept_probs, *, sc: SpecConfig,
              n_predict: int, eos_id: int):
  """The whole speculative generation on device (one lax.while_loop)."""
  b = out.shape[0]
  rec0 = jnp.zeros((n_predict, b), jnp.int32)

  def cond(c):
    i, _, _, _, done, _ = c
    return (i < n_predict) & ~jnp.all(done)

  def body(c):
    i, st, out, count, done, rec = c
    kd, ka = jax.random.split(jax.random.fold_in(key, i))
    drafts, q, m, dcache = draft_phase(dparams, st.dcache, st.tail, st.n, kd, sc)
    p, tcache = verify_phase(tparams, st.tcache, st.tail, drafts, sc)
    a = accept_phase(ka, accept_probs, p, q, drafts, m, st.tail, st.n, ~done, sc)
    st = SpecState(tcache=kvc.rollback(tcache, a["t_len"]),
                   dcache=kvc.rollback(dcache, a["d_len"]), tail=a["tail"], n=a["n"])
    rec = {"n_acc": rec["n_acc"].at[i].set(a["n_acc"]),
           "n_drafted": rec["n_drafted"].at[i].set(m),
           "live": rec["live"].at[i].set((~done).astype(jnp.int32))}
    out, count, done = _bookkeep(out, count, done, a, eos_id, n_predict)
    return i + 1, st, out, count, done, rec

  count = jnp.ones((b,), jnp.int32)
  done = (out[:, 0] == eos_id) | (n_predict <= 1)
  rec = {"n_acc": rec0, "n_drafted": rec0, "live": rec0}
  _, st, out, count, _, rec = jax.lax.while_loop(
      cond, body, (jnp.int32(0), state, out, count, done, rec))
  return out, count, rec, st


draft_jit = jax.jit(draft_phase, static_argnames=("sc",), donate_argnames=("dcache",))
verify_jit = jax.jit(verify_phase, static_argnames=("sc",), donate_argnames=("tcache",))
accept_jit = jax.jit(accept_phase, static_argnames=("sc",))
_bookkeep_jit = jax.jit(_bookkeep, static_argnames=("eos_id", "n_predict"))
_split_jit = jax.jit(lambda key, i: jax.random.split(jax.random.fold_in(key, i)))


def _host_loop(tparams, dparams, st: SpecState, out, key, accept_probs, sc, n_predict, eos_id):
  """The host-driven twin of spec_loop; returns the same plus phase times."""
  b = out.shape[0]
  count = jnp.ones((b,), jnp.int32)
  done = np.asarray((out[:, 0] == eos_id) | (n_predict <= 1))
  recs = {"n_acc": [], "n_drafted": [], "live": []}
  phase = {"draft_s": 0.0, "verify_s": 0.0, "accept_s": 0.0}
  for i in range(n_predict):
    if done.all():
      break
    kd, ka = _split_jit(key, i)
    n_host = np.asarray(st.n)
    kvc.check_capacity(n_host - 1, sc.gamma + 1, st.tcache.capacity)
    t0 = time.perf_counter()
    drafts, q, m, dcache = block(draft_jit(dparams, st.dcache, st.tail, st.n, kd, sc=sc))
    t1 = time.perf_counter()
    p, tcache = block(verify_jit(tparams, st.tcache, st.tail, drafts, sc=sc))
    t2 = time.perf_counter()
    a = block(accept_jit(ka, accept_probs, p, q, drafts, m, st.tail, st.n, jnp.asarray(~done),
                          sc=sc))
    phase["accept_s"] += time.perf_counter() - t2
    phase["draft_s"] += t1 - t0
    phase["verify_s"] += t2 - t1
    st = SpecState(tcache=kvc.rollback(tcache, a["t_len"]),
                   dcache=kvc.rollback(dcache, a["d_len"]), tail=a["tail"], n=a["n"])
    for name, v in (("n_acc", a["n_acc"]), ("n_drafted", m), ("live", ~done)):
      recs[name].append(np.asarray(v, np.int32))
    out, count, done = _bookkeep_jit(out, count, jnp.asarray(done), a,
                                     eos_id=eos_id, n_predict=n_predict)
    done = np.asarray(done)
  rec = {k: np.stack(v) if v else np.zeros((0, b), np.int32) for k, v in recs.items()}
  return out, count, rec, phase


def generate(target: steps.Model, draft: steps.Model, prompts, n_predict: int,
             gamma: int, sp: SamplingParams = SamplingParams(),
             rule: AcceptRule | str = "real", seed: int = 0,
             eos_id: int | None = None, loop: str = "device", p_min: float = 0.0,
             ctx_size: int | None = None, capacity: int | None = None) -> SpecResult:
  """Speculative generation of n_predict tokens after each prompt."""
  if loop not in ("device", "host"):
    raise ConfigError(f"loop must be 'device' or 'host', got {loop!r}")
  rule = acceptance.parse_rule(rule) if isinstance(rule, str) else rule
  rule = rule.resolve(gamma)
  sc = SpecConfig(target.cfg, draft.cfg, gamma, sp, rule.simulated, p_min)
  accept_probs = jnp.asarray(acceptance.position_probs(rule, gamma))
  eos = generation.NO_EOS if eos_id is None else int(eos_id)
  p_len = max(len(p) for p in prompts)
  cap = generation.plan_capacity(target.cfg, p_len, n_predict, extra=gamma + 1,
                                 ctx_size=ctx_size, capacity=capacity)
  key = jax.random.PRNGKey(seed)
  with CompileWatch() as cw:
    t0 = time.perf_counter()
    logits, tcache = target.prefill(prompts, target.new_cache(len(prompts), cap))
    _, dcache = draft.prefill(prompts, draft.new_cache(len(prompts), cap))
    first = generation.sample_jit(jax.random.fold_in(key, 0), logits, sp=sp)
    block((first, dcache))
    prompt_s = time.perf_counter() - t0
    prev = jnp.asarray([p[-1] for p in prompts], jnp.int32)
    st = SpecState(tcache=tcache, dcache=dcache, tail=jnp.stack([prev, first], 1),
                   n=tcache.lengths + 1)
    out = jnp.full((len(prompts), n_predict + gamma + 1), eos, jnp.int32)
    out = out.at[:, 0].set(first)
    step_key = jax.random.fold_in(key, 1)
    t0 = time.perf_counter()
    if loop == "device":
      out, count, rec, _ = block(spec_loop(target.params, draft.params, st, out, step_key,
                                           accept_probs, sc=sc, n_predict=n_predict,
                                           eos_id=eos))
      phase = {}
    else:
      out, count, rec, phase = _host_loop(target.params, draft.params, st, out,
                                          step_key, accept_probs, sc, n_predict, eos)
    eval_s = time.perf_counter() - t0
  out, count = np.asarray(out), np.asarray(count)
  rows = [out[b, :count[b]].tolist() for b in range(len(prompts))]
  records = Records.from_arrays(rec)
  stats = SpecStats.compute(records, gamma=gamma, n_predict=int(count.sum()),
                            eval_s=eval_s, phase_s=phase)
  return SpecResult(tokens=rows, stats=stats, prompt_s=prompt_s, eval_s=eval_s,
                    compile_s=cw.seconds, records=records)
