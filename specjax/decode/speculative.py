"""Speculative decoding as fixed-shape XLA programs: the state, the loops.

One step, for every row of the batch (n = tokens so far, `last` = the last
emitted token, not yet in the target cache): propose (the drafter) ->
verify (one target forward over [last, drafts]) -> judge (k accepted, the
target's token) -> keep_tokens (at most n_predict, up to EOS) -> commit
(the verdict rolls the target cache back, the drafter commits its state).
The phases are sc.step's (decode/plan.py picks the chain's or the tree's
once); two loops run them with the same keys and emit identical tokens:
`spec_loop` (one lax.while_loop on device) and the host loop (jitted
phases, timed). Invariant between steps: the target cache holds the kept
sequence minus `last` (length n - 1); a finished row rides along with its
lengths cut to what it kept, its later writes inside the capacity.
Derivation and invariants: ARCHITECTURE.md, docs/trees.md.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.decode import generation
from specjax.decode import plan as plans
from specjax.decode.acceptance import AcceptRule
from specjax.decode.chain_step import Judged
from specjax.decode.plan import Plan, SpecConfig
from specjax.drafters.base import Drafted, Drafter
from specjax.errors import ConfigError
from specjax.metrics.stats import ROW_FIELDS, Records, SpecStats
from specjax.metrics.timing import CompileWatch, block
from specjax.model import kv_cache as kvc
from specjax.model import sharding
from specjax.model import steps
from specjax.model.sampling import SamplingParams


@struct.dataclass
class SpecState:
  tcache: kvc.KVCache
  dcache: Any      # the drafter's state (any pytree): the draft model's KVCache,
                   # the n-gram history [B, S], () for layerskip:N ...
  tail: jax.Array  # [B, 2] the last two kept tokens (prev, last)
  n: jax.Array     # [B] sequence length so far (prompt + kept tokens)
  rows: Any = ()   # the step's per-row state (sc.step.start_rows): per-row lengths'
                   # rows_step.RowAlpha, () otherwise


def keep_tokens(out, count, done, j: Judged, eos_id: int, n_predict: int):
  """Writes the step's tokens at each row's count, at most up to n_predict
  and the first EOS. Returns (out, count, done, kept [B] tokens kept)."""
  g1 = j.emitted.shape[1]
  pos = jnp.arange(g1)[None, :]
  valid = pos < (j.n_acc + 1)[:, None]
  is_eos = valid & (j.emitted == eos_id)
  first_eos = jnp.where(jnp.any(is_eos, 1), jnp.argmax(is_eos, 1) + 1, g1 + 1)
  kept = jnp.minimum(j.n_acc + 1, first_eos)
  kept = jnp.where(done, 0, jnp.minimum(kept, n_predict - count))
  write = jax.vmap(lambda o, e, c: jax.lax.dynamic_update_slice(o, e, (c,)))
  out = jnp.where(done[:, None], out, write(out, j.emitted, count))
  count = count + kept
  done = done | (count >= n_predict) | (kept >= first_eos)
  return out, count, done, kept


def commit(tcache, dcache, tail, j: Judged, kept, live, drafter: Drafter,
           features=None, rows=()) -> SpecState:
  """The state after a step: the target cache rolled back to what the row
  kept (by the verdict), the drafter's state committed.

  A step emits n_acc + 1 tokens; when n_predict or EOS cuts it short, the
  tokens past `kept` are dropped from the sequence, from both caches and from
  the tail, so a finished row's state is exactly its output, and its later
  (ignored) writes land past it and inside the capacity.
  """
  dropped = jnp.where(live, j.n_acc + 1 - kept, 0)
  n = j.n - dropped
  n_prev = jnp.where(live, j.n - j.n_acc - 1, j.n)
  tcache, features = j.commit_target(tcache, kept, dropped, live, features)
  c = j.committed(n_prev=n_prev, n=n, kept=jnp.where(live, kept, 0), live=live,
                  features=features)
  # [last, e_1 .. e_{gamma+1}]: the kept tail is (ext[kept - 1], ext[kept])
  ext = jnp.concatenate([tail[:, 1:], j.emitted], 1)
  at = lambda i: jnp.take_along_axis(ext, jnp.maximum(i, 0)[:, None], 1)[:, 0]
  cut_tail = jnp.stack([at(kept - 1), at(kept)], 1)
  return SpecState(tcache=tcache, dcache=drafter.commit(dcache, c),
                   tail=jnp.where((dropped > 0)[:, None], cut_tail, j.tail), n=n,
                   rows=j.observe(rows, live))


# stats.Records + live + leaf (the block index of the last accepted node, 0: none; a
# chain's n_acc): a static tree's accepted path, hence its per-rank tries and
# accepts (tree_theory.rank_counts), for --tree=auto's estimate of p
# + stats.ROW_FIELDS (per-row lengths' records; Judged.row_record)
REC_FIELDS = ("n_acc", "n_drafted", "kept", "caught_up", "live", "leaf", *ROW_FIELDS)
FLOAT_FIELDS = ("alpha", "weight")


def _record_row(j: Judged, d: Drafted, kept, live) -> dict[str, jax.Array]:
  """One step's per-row record (see stats.Records)."""
  leaf = j.leaf
  return {"n_acc": j.n_acc, "n_drafted": d.n_drafted, "kept": kept,
          "caught_up": d.caught_up.astype(jnp.int32), "live": live.astype(jnp.int32),
          "leaf": leaf.astype(jnp.int32), **j.row_record(d)}


@dataclasses.dataclass
class SpecResult:
  tokens: list[list[int]]   # generated ids per row (prompt excluded)
  stats: SpecStats
  prompt_s: float           # prefill of both models
  eval_s: float             # speculative loop
  compile_s: float = 0.0
  records: Records | None = None  # per-step records behind `stats`
  state: SpecState | None = None  # final state (caches), when asked for


def _steps(key, i, tparams, dparams, st: SpecState, done, accept_probs, sc):
  """The phases of step i, in order (shared by both loops through jit)."""
  kd, ka = jax.random.split(jax.random.fold_in(key, i))
  step = sc.step
  d, dcache, tcache = step.draft(dparams, st, ~done, kd, sc)
  p, tcache, feats = step.verify(tparams, tcache, st.tail, d, sc)
  j = step.judge(ka, accept_probs, p, d, st.tail, st.n, ~done, sc)
  return d, dcache, tcache, j, feats


def _run_steps(tparams, dparams, st: SpecState, out, count, done, i, rec, key, accept_probs,
               stop, sc: SpecConfig, n_predict: int, eos_id: int):
  """Steps i, i+1, .. of the loop until step `stop` or every row is done
  (a tails-only config's from a settled state: Drafter.settle)."""
  if sc.tails_only(out.shape[0]):
    st = st.replace(dcache=sc.drafter.settle(dparams, st.dcache, st.n, sc))

  def cond(c):
    i, _, _, _, done, _ = c
    return (i < stop) & ~jnp.all(done)

  def body(c):
    i, st, out, count, done, rec = c
    d, dcache, tcache, j, feats = _steps(key, i, tparams, dparams, st, done, accept_probs, sc)
    out, count, new_done, kept = keep_tokens(out, count, done, j, eos_id, n_predict)
    row = _record_row(j, d, kept, ~done)
    rec = {k: rec[k].at[i].set(row[k]) for k in REC_FIELDS}
    st = commit(tcache, dcache, st.tail, j, kept, ~done, sc.drafter, feats, st.rows)
    return i + 1, st, out, count, new_done, rec

  return jax.lax.while_loop(cond, body, (jnp.asarray(i, jnp.int32), st, out, count, done, rec))


def loop_start(out, eos_id: int, n_predict: int):
  """(count, done, records) before step 0; out [B, W] holds the first tokens."""
  b = out.shape[0]
  count = jnp.ones((b,), jnp.int32)
  done = (out[:, 0] == eos_id) | (n_predict <= 1)
  return count, done, {k: jnp.zeros((n_predict, b), jnp.float32 if k in FLOAT_FIELDS else jnp.int32)
                       for k in REC_FIELDS}


@functools.partial(jax.jit, static_argnames=("sc", "n_predict", "eos_id"),
                   donate_argnames=("state",))
def spec_loop(tparams, dparams, state: SpecState, out, key, accept_probs, *, sc: SpecConfig,
              n_predict: int, eos_id: int):
  """The whole speculative generation on device (one lax.while_loop).

  Returns (out [B, n_predict + gamma + 1], count [B], records, final state).
  """
  count, done, rec = loop_start(out, eos_id, n_predict)
  _, st, out, count, _, rec = _run_steps(tparams, dparams, state, out, count, done, 0, rec, key,
                                         accept_probs, n_predict, sc, n_predict, eos_id)
  return out, count, rec, st


@functools.partial(jax.jit, static_argnames=("sc", "n_predict", "eos_id"),
                   donate_argnames=("state", "rec"))
def spec_chunk(tparams, dparams, state: SpecState, out, count, done, i, rec, key, accept_probs,
               n_steps, *, sc: SpecConfig, n_predict: int, eos_id: int):
  """At most n_steps steps of spec_loop from step i (both traced: chunks of
  any length share one program) and a given (state, out, count, done,
  records): a host loop may switch gamma between chunks (SpecState does not
  depend on gamma; `out` must be at least n_predict + max gamma wide).
  Returns (i, state, out, count, done, rec)."""
  stop = jnp.minimum(i + n_steps, n_predict)
  return _run_steps(tparams, dparams, state, out, count, done, i, rec, key, accept_probs, stop,
                    sc, n_predict, eos_id)


def _propose(dparams, dcache, tcache, tail, n, live, key, sc: SpecConfig):
  return sc.step.propose(dparams, dcache, tcache, tail, n, live, key, sc)


def _verify(tparams, tcache, tail, drafted, sc: SpecConfig):
  return sc.step.verify(tparams, tcache, tail, drafted, sc)


def _judge(key, accept_probs, p, drafted, tail, n, live, sc: SpecConfig):
  return sc.step.judge(key, accept_probs, p, drafted, tail, n, live, sc)


draft_jit = jax.jit(_propose, static_argnames=("sc",), donate_argnames=("dcache", "tcache"))
verify_jit = jax.jit(_verify, static_argnames=("sc",), donate_argnames=("tcache",))
accept_jit = jax.jit(_judge, static_argnames=("sc",))


@functools.partial(jax.jit, static_argnames=("eos_id", "n_predict", "drafter"),
                   donate_argnames=("tcache", "dcache"))
def _keep_and_commit(out, count, done, j, d, tcache, dcache, tail, feats, *, eos_id, n_predict,
                     drafter):
  """The host loop's bookkeeping: keep_tokens, commit and the step's record."""
  out, count, new_done, kept = keep_tokens(out, count, done, j, eos_id, n_predict)
  st = commit(tcache, dcache, tail, j, kept, ~done, drafter, feats)
  return out, count, new_done, st, _record_row(j, d, kept, ~done)


_split_jit = jax.jit(lambda key, i: jax.random.split(jax.random.fold_in(key, i)))


def _host_loop(tparams, dparams, st: SpecState, out, key, accept_probs, sc, n_predict, eos_id):
  """The host-driven twin of spec_loop; returns the same plus phase times."""
  b = out.shape[0]
  count = jnp.ones((b,), jnp.int32)
  done = np.asarray((out[:, 0] == eos_id) | (n_predict <= 1))
  recs = {k: [] for k in REC_FIELDS}
  phase = {"draft_s": 0.0, "verify_s": 0.0, "accept_s": 0.0}
  for i in range(n_predict):
    if done.all():
      break
    kd, ka = _split_jit(key, i)
    # live rows only: a finished row writes past its kept tokens, in range
    kvc.check_capacity(np.asarray(st.n)[~done] - 1, sc.block, st.tcache.capacity)
    live = jnp.asarray(~done)
    t0 = time.perf_counter()
    d, dcache, tcache = block(draft_jit(dparams, st.dcache, st.tcache, st.tail, st.n, live, kd,
                                        sc=sc))
    t1 = time.perf_counter()
    p, tcache, feats = block(verify_jit(tparams, tcache, st.tail, d, sc=sc))
    t2 = time.perf_counter()
    j = block(accept_jit(ka, accept_probs, p, d, st.tail, st.n, live, sc=sc))
    phase["draft_s"] += t1 - t0
    phase["verify_s"] += t2 - t1
    phase["accept_s"] += time.perf_counter() - t2
    out, count, done, st, row = _keep_and_commit(out, count, ~live, j, d, tcache, dcache,
                                                 st.tail, feats, eos_id=eos_id,
                                                 n_predict=n_predict, drafter=sc.drafter)
    for k in REC_FIELDS:
      recs[k].append(np.asarray(row[k]))
    done = np.asarray(done)
  rec = {k: np.stack(v) if v else np.zeros((0, b)) for k, v in recs.items()}
  return out, count, rec, st, phase


def prefill(target: steps.Runner, dparams, prompts, capacity: int, key,
            sc: SpecConfig) -> tuple[SpecState, jax.Array]:
  """The target's cache filled with the prompts, the first token sampled from
  the target (fold_in(key, 0), as target-only generation draws it), and the
  drafter's initial state (the draft model's prefilled cache, ...).
  Returns (state, first tokens [B])."""
  logits, tcache = target.prefill(prompts, target.new_cache(len(prompts), capacity))
  return start(target, dparams, prompts, logits, tcache, key, sc)


def start(target: steps.Runner, dparams, prompts, logits, tcache, key,
          sc: SpecConfig) -> tuple[SpecState, jax.Array]:
  """`prefill`'s state from the prompts' prefilled cache and last-token logits
  [B, V] (a cache prefilled once can start many runs: experiments/long_batch_check.py)."""
  first = generation.sample_jit(jax.random.fold_in(key, 0), logits, sp=sc.sp)
  dstate = sc.drafter.init(sc, target, dparams, prompts, tcache.capacity, first)
  prev = jnp.asarray([p[-1] for p in prompts], jnp.int32)
  st = SpecState(tcache=tcache, dcache=dstate, tail=jnp.stack([prev, first], 1),
                 n=tcache.lengths + 1, rows=sc.step.start_rows(len(prompts)))
  return block(st), first


def run(target: steps.Runner, draft: steps.Runner | None, prompts, n_predict: int,
        plan: Plan, seed: int = 0, eos_id: int | None = None, loop: str = "device",
        ctx_size: int | None = None, capacity: int | None = None,
        keep_state: bool = False) -> SpecResult:
  """Speculative generation of n_predict tokens after each prompt with a
  fixed plan's one config (plan.resolve); `draft` is the draft model of the
  `model` drafter (None for the others). `keep_state` returns the final
  caches in SpecResult.state (tests read them); otherwise they are freed."""
  if loop not in ("device", "host"):
    raise ConfigError(f"loop must be 'device' or 'host', got {loop!r}")
  sc = plan.sc
  if loop == "host" and sc.per_row:
    raise ConfigError("--gamma=auto:rows runs the device loop: no --loop=host")
  dparams = sc.drafter.draft_params(target.params, draft)
  accept_probs = jnp.asarray(plan.accept_probs())
  eos = generation.NO_EOS if eos_id is None else int(eos_id)
  cap = plan.capacity(max(len(p) for p in prompts), n_predict, ctx_size, capacity)
  key = jax.random.PRNGKey(seed)
  with CompileWatch() as cw:
    t0 = time.perf_counter()
    st, first = prefill(target, dparams, prompts, cap, key, sc)
    prompt_s = time.perf_counter() - t0
    out = jnp.full((len(prompts), n_predict + sc.gamma + 1), eos, jnp.int32)
    out = out.at[:, 0].set(first)
    step_key = jax.random.fold_in(key, 1)
    t0 = time.perf_counter()
    if loop == "device":
      out, count, rec, st = block(spec_loop(target.params, dparams, st, out, step_key,
                                            accept_probs, sc=sc, n_predict=n_predict,
                                            eos_id=eos))
      phase = {}
    else:
      out, count, rec, st, phase = _host_loop(target.params, dparams, st, out,
                                              step_key, accept_probs, sc, n_predict, eos)
    eval_s = time.perf_counter() - t0
  tokens, records = outputs(out, count, rec)
  if sc.per_row:  # each entry's alpha against the length it was given
    records = dataclasses.replace(records, gamma=records.n_drafted)
  stats = SpecStats.compute(records, gamma=sc.gamma, n_predict=sum(map(len, tokens)),
                            eval_s=eval_s, phase_s=phase)
  return SpecResult(tokens=tokens, stats=stats, prompt_s=prompt_s, eval_s=eval_s,
                    compile_s=cw.seconds, records=records,
                    state=st if keep_state else None)


def outputs(out, count, rec, steps_run: int | None = None) -> tuple[list[list[int]], Records]:
  """The loop's outputs on the host: each row's tokens and the live records
  (of the first `steps_run` steps, when given)."""
  out, count = sharding.to_host(out), sharding.to_host(count)
  rec = {k: np.asarray(sharding.to_host(v))[:steps_run] for k, v in rec.items()}
  return [out[b, :count[b]].tolist() for b in range(out.shape[0])], Records.from_arrays(rec)


def generate(target: steps.Runner, draft: steps.Runner | None, prompts, n_predict: int,
             gamma: int = 4, sp: SamplingParams = SamplingParams(),
             rule: AcceptRule | str = "real", drafter: Drafter | str = "model",
             tree=None, siblings: str = "topk", p_min: float = 0.0, **kw) -> SpecResult:
  """`run` with its plan resolved here from the flags (plan.resolve: drafter
  spec, gamma, rule, tree spec or Tree, siblings); kw: run's."""
  return run(target, draft, prompts, n_predict,
             plans.resolve(target.cfg, draft and draft.cfg, drafter=drafter, gamma=gamma,
                           rule=rule, tree=tree, siblings=siblings, sp=sp, p_min=p_min), **kw)
