"""Target-only generation: the baseline every speedup is measured against.

Two loops that emit identical tokens for the same seed:
  * `device`: the whole decode in one `lax.while_loop`, one transfer at the end;
  * `host`: a Python loop of jitted decode steps, each timed on its own.
Token i of the generation is sampled with `fold_in(key, i)` in both.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.model import kv_cache as kvc
from specjax.model import llama as model
from specjax.model import sampling
from specjax.model import sharding
from specjax.model import steps
from specjax.errors import CacheOverflowError, ConfigError
from specjax.model.sampling import SamplingParams
from specjax.metrics.timing import CompileWatch, block

NO_EOS = -1  # eos_id value that never matches a token


def plan_capacity(cfg, prompt_len: int, n_predict: int, extra: int = 0,
                  ctx_size: int | None = None, capacity: int | None = None) -> int:
  """Cache slots for a prompt + n_predict tokens (+ `extra`).

  A speculative run passes extra = gamma: its last verify (gamma + 1 tokens
  after the prompt and n_predict - 2 cached tokens) ends at slot
  prompt + n_predict + gamma - 2, and a row that finished early rides along
  one slot further (speculative.commit), so prompt + n_predict + gamma slots
  are exactly enough.

  Raises CacheOverflowError when the sequence does not fit the context
  (`ctx_size`, default the model's max_seq_len). The capacity is ctx_size +
  extra when a context is given, else what the run needs rounded up
  (kv_cache.round_capacity: fewer distinct shapes to compile); an explicit
  `capacity` is used as is once checked (runs compared side by side share one
  capacity).
  """
  ctx = ctx_size or cfg.max_seq_len
  if n_predict <= 0:
    raise ConfigError(f"n_predict must be positive, got {n_predict}")
  if prompt_len + n_predict > ctx:
    raise CacheOverflowError(
        f"prompt ({prompt_len} tokens) + n_predict ({n_predict}) = "
        f"{prompt_len + n_predict} exceeds the context of {ctx} tokens")
  if capacity is not None:
    if capacity < prompt_len + n_predict + extra:
      raise CacheOverflowError(
          f"cache capacity {capacity} < prompt ({prompt_len}) + n_predict ({n_predict})"
          f" + gamma ({extra})")
    return capacity
  # The prompt's padded bucket fits too, so prefill keeps its one shape.
  if ctx_size:
    return max(ctx_size + extra, steps.prefill_bucket(prompt_len))
  return kvc.round_capacity(max(prompt_len + n_predict + extra,
                                steps.prefill_bucket(prompt_len)))


@functools.partial(jax.jit, static_argnames=("cfg", "sp", "n_predict", "eos_id"),
                   donate_argnames=("cache",))
def decode_loop(params, first_logits, cache, key, *, cfg, sp: SamplingParams,
                n_predict: int, eos_id: int):
  """Samples n_predict tokens on device; returns (tokens [B, n_predict], cache).

  Stops early once every row has emitted eos_id. Rows that finished keep
  running (fixed shapes) but their later tokens are eos_id.
  """
  b = first_logits.shape[0]
  tok = sampling.sample_logits(jax.random.fold_in(key, 0), first_logits, sp)
  out = jnp.full((b, n_predict), eos_id, jnp.int32).at[:, 0].set(tok)

  def cond(state):
    i, _, _, done, _ = state
    return (i < n_predict) & ~jnp.all(done)

  def body(state):
    i, tok, out, done, cache = state
    logits, cache = model.forward(params, tok[:, None], cache, cfg)
    nxt = sampling.sample_logits(jax.random.fold_in(key, i), logits[:, 0], sp)
    nxt = jnp.where(done, eos_id, nxt)
    out = jax.lax.dynamic_update_slice(out, nxt[:, None], (0, i))
    return i + 1, nxt, out, done | (nxt == eos_id), cache

  state = (jnp.int32(1), tok, out, tok == eos_id, cache)
  _, _, out, _, cache = jax.lax.while_loop(cond, body, state)
  return out, cache


sample_jit = jax.jit(sampling.sample_logits, static_argnames=("sp",))


@dataclasses.dataclass
class GenerationResult:
  tokens: list[list[int]]        # generated ids per row, prompt excluded
  n_prompt: int                  # prompt tokens (all rows)
  prompt_s: float                # prefill wall time
  eval_s: float                  # decode wall time (first sampled token excluded)
  n_eval: int                    # decode steps run
  compile_s: float = 0.0         # compile time within this call (excluded above)
  step_s: list[float] = dataclasses.field(default_factory=list)  # host loop only

  @property
  def n_decoded(self) -> int:
    """Tokens the decode steps emitted, summed over rows, each row up to its
    EOS (its first token, the prefill's, excluded): what a speculative run's
    stats.SpecStats.n_kept counts, so the two speeds compare like with like. With EOS
    it is less than n_eval x rows: a row that stopped early is not credited
    with the steps it ran idle."""
    return sum(max(len(r) - 1, 0) for r in self.tokens)


def trim_eos(row, eos_id: int) -> list[int]:
  """The row up to and including the first eos_id."""
  row = [int(t) for t in row]
  return row[:row.index(eos_id) + 1] if eos_id in row else row


def generate(m: steps.Runner, prompts, n_predict: int, sp: SamplingParams = SamplingParams(),
             seed: int = 0, eos_id: int | None = None, loop: str = "device",
             ctx_size: int | None = None, capacity: int | None = None) -> GenerationResult:
  """Generates n_predict tokens after each prompt (a list of token-id lists)."""
  if loop not in ("device", "host"):
    raise ConfigError(f"loop must be 'device' or 'host', got {loop!r}")
  eos = NO_EOS if eos_id is None else int(eos_id)
  p_len = max(len(p) for p in prompts)
  cache = m.new_cache(len(prompts), plan_capacity(m.cfg, p_len, n_predict,
                                                  ctx_size=ctx_size, capacity=capacity))
  key = jax.random.PRNGKey(seed)
  with CompileWatch() as cw:
    t0 = time.perf_counter()
    logits, cache = block(m.prefill(prompts, cache))
    prompt_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    if loop == "device":
      out, cache = block(decode_loop(m.params, logits, cache, key, cfg=m.cfg,
                                     sp=sp, n_predict=n_predict, eos_id=eos))
      step_s = []
    else:
      out, step_s = _host_loop(m, logits, cache, key, sp, n_predict, eos)
    eval_s = time.perf_counter() - t0
  rows = [trim_eos(r, eos) for r in sharding.to_host(out)]
  return GenerationResult(
      tokens=rows, n_prompt=sum(len(p) for p in prompts), prompt_s=prompt_s,
      eval_s=eval_s, n_eval=max(len(r) for r in rows) - 1,
      compile_s=cw.seconds, step_s=step_s)


def _host_loop(m, logits, cache, key, sp, n_predict, eos):
  """The host-driven twin of decode_loop, timing every decode step."""
  lengths = np.asarray(cache.lengths)
  tok = sample_jit(jax.random.fold_in(key, 0), logits, sp=sp)
  done = np.asarray(tok) == eos
  out, step_s = [np.asarray(tok)], []
  for i in range(1, n_predict):
    if done.all():
      break
    t0 = time.perf_counter()
    logits, cache = m.forward(tok[:, None], cache, lengths=lengths)
    tok = block(sample_jit(jax.random.fold_in(key, i), logits[:, 0], sp=sp))
    step_s.append(time.perf_counter() - t0)
    lengths = lengths + 1
    host_tok = np.where(done, eos, np.asarray(tok))
    done |= host_tok == eos
    out.append(host_tok)
  out = np.stack(out, 1)
  pad = np.full((out.shape[0], n_predict - out.shape[1]), eos, np.int32)
  return np.concatenate([out, pad], 1), step_s
