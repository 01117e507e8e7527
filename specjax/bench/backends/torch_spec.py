"""Batched greedy speculative decoding in PyTorch, on the weights of an HF
`LlamaForCausalLM` (`hf.to_torch_model`: the one conversion), the PyTorch
side of the XLA-vs-PyTorch comparison at batch > 1.

The model is a small functional LLaMA forward (`TorchLlama`) over the HF
model's weight tensors, written like specjax's `model.forward`: a static
(preallocated) KV cache per layer [B, K, S, D], explicit per-row `lengths`
[B], writes at slots lengths[b] .. lengths[b] + T - 1, a query at position p
attends to slots <= p (one masked pass over the capacity S, as specjax's
`attend_masked`), rolling back = setting `lengths`. Its one timed call, a
forward over T new tokens per row followed by the argmax of its logits, is
`torch.compile`d (`compile=True`) per static shape: T = 1 (decode, draft) and
T = gamma + 1 (verify). Prefill runs eager (untimed, as specjax's).

`TorchSpec` runs, at batch B with ragged prompts:
  target-only greedy generation of n_predict tokens per row, and
  speculative greedy generation (`speculative.py`'s step, phase by phase, in
  a host loop): draft gamma tokens (after the catch-up feed of d_gamma when
  the last step accepted every draft), verify gamma + 1 on the target,
  accept (`real`: while draft == target argmax; simulated rules
  `bernoulli:P` (a torch.Generator seeded per run), `fraction:F`, `always`,
  emitting the target's argmax at the first rejected position), keep at most
  n_predict tokens per row, commit by cache lengths. Rows that finished ride
  along with their lengths cut back to what they kept; the loop ends when
  the slowest row has n_predict tokens. Greedy only (temperature 0).
Every row's tokens equal batch-1 target-only generation's and specjax's
(tests/test_torch_spec.py); the per-step records and statistics are
specjax's (`stats.Records`, `stats.SpecStats`).

Timing (`time_point`, `TorchCostProbe`): the shape of specjax's sweep
(`sweep.run_group`: target-only and speculative alternating, medians,
compile / warm-up excluded and reported apart) and of `probes.CostProbe`
(T(n): k forwards from the same cache state, time per forward), with the
batch as a dimension. torch is imported on first use.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any, Sequence

import numpy as np

from specjax.decode import acceptance
from specjax.decode import generation
from specjax.formats import hf
from specjax.metrics import timing
from specjax.model import kv_cache as kvc
from specjax.bench.backends.pytorch import import_torch
from specjax.model.config import ModelConfig
from specjax.errors import CacheOverflowError, ConfigError
from specjax.metrics.stats import Records, SpecStats
from specjax.bench.backends.base import first_line

REPEATS = 8  # forwards per timed repetition of a cost probe (probes.REPEATS)


def _dynamo_graphs() -> int:
  """Graphs torch.compile has built so far in this process (recompiles count)."""
  import_torch()
  from torch._dynamo.utils import counters  # pylint: disable=import-outside-toplevel
  return int(counters["stats"]["unique_graphs"])


def _forward(w: dict[str, Any], tokens, lengths, ks: list, vs: list, n_heads: int,
             n_kv_heads: int, eps: float, logits: bool = False, tree=None):
  """T new tokens per row against the cache; the caches are written in place.

  w: weights (torch layout, [out, in]); tokens [B, T] int64; lengths [B]
  int64 (row b is written at slots lengths[b]..); ks, vs: L x [B, K, S, D].
  tree: None (a chain: causal), or (mask [T, T] bool, depths [T] int64) of a
  token tree's verify block (model.tree.Tree.mask, block_depths): RoPE at
  lengths + depth, attention to the cache's slots < lengths and to the
  block's slots the mask allows (an additive mask over [cache; block]).
  Returns the argmax [B, T] of the logits (or the f32 logits [B, T, V]).
  """
  torch = import_torch()
  b, t = tokens.shape
  h, k = n_heads, n_kv_heads
  s_cap = ks[0].shape[2]
  slots = lengths[:, None] + torch.arange(t, device=tokens.device)[None, :]  # [B, T]
  rows = torch.arange(b, device=tokens.device)[:, None]  # [B, 1]
  cols = torch.arange(s_cap, device=tokens.device)[None, None, :]  # [1, 1, S]
  if tree is None:
    positions, mask = slots, cols <= slots[:, :, None]
  else:
    positions = lengths[:, None] + tree[1][None, :]
    j = cols - lengths[:, None, None]  # [B, 1, S] block index of each slot
    allowed = tree[0][None].expand(b, t, t).gather(2, j.clamp(0, t - 1).expand(b, t, s_cap))
    mask = (j < 0) | ((j < t) & allowed)
  bias = torch.zeros(mask.shape, dtype=torch.float32, device=tokens.device)
  bias = bias.masked_fill(~mask, float("-inf"))[:, None, None]  # [B, 1, 1, T, S]
  freqs = positions[..., None].float() * w["inv_freq"]  # [B, T, D/2]
  emb = torch.cat([freqs, freqs], -1)[:, :, None, :]    # [B, T, 1, D]
  cos, sin = emb.cos(), emb.sin()

  def norm(x, scale):  # RMSNorm in f32 (HF's LlamaRMSNorm)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return scale * x32.to(x.dtype)

  def rope(x):  # x [B, T, N, D], HF's rotate_half
    x1, x2 = x.chunk(2, -1)
    return x * cos.to(x.dtype) + torch.cat([-x2, x1], -1) * sin.to(x.dtype)

  lin = torch.nn.functional.linear
  x = w["embed"][tokens]  # [B, T, E]
  for i, (kc, vc) in enumerate(zip(ks, vs)):
    lw = w["layers"][i]
    y = norm(x, lw["attn_norm"])
    d = kc.shape[3]
    q = rope(lin(y, lw["wq"]).view(b, t, h, d))
    kk = rope(lin(y, lw["wk"]).view(b, t, k, d))
    vv = lin(y, lw["wv"]).view(b, t, k, d)
    kc[rows, :, slots] = kk.to(kc.dtype)  # write first: the new tokens see themselves
    vc[rows, :, slots] = vv.to(vc.dtype)
    qg = q.view(b, t, k, h // k, d).permute(0, 2, 3, 1, 4)  # [B, K, G, T, D]
    scores = torch.matmul(qg.float(), kc[:, :, None].transpose(-1, -2).float())
    scores = scores / math.sqrt(d) + bias  # [B, K, G, T, S]
    probs = torch.softmax(scores, -1).to(x.dtype)
    out = torch.matmul(probs, vc[:, :, None])  # [B, K, G, T, D]
    out = out.permute(0, 3, 1, 2, 4).reshape(b, t, h * d)
    x = x + lin(out, lw["wo"])
    y = norm(x, lw["mlp_norm"])
    x = x + lin(torch.nn.functional.silu(lin(y, lw["w_gate"])) * lin(y, lw["w_up"]),
                lw["w_down"])
  out = lin(norm(x, w["final_norm"]), w["lm_head"]).float()
  return out if logits else torch.argmax(out, -1)


class TorchLlama:
  """A LLaMA model in torch over an HF LlamaForCausalLM's weights, with a
  static cache. `step(tokens, cache)` is the timed call (forward + argmax;
  `torch.compile`d when `compile`), `logits` the same forward eager."""

  def __init__(self, cfg: ModelConfig, params=None, model=None, compile: bool = True,
               threads: int | None = None):
    torch = self.torch = import_torch()
    if threads:
      torch.set_num_threads(threads)
    self.cfg = cfg
    if model is None:
      model = hf.to_torch_model(cfg, params)
    self.model = model
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    layer = lambda i, n: sd[f"model.layers.{i}.{n}.weight"]
    self.w = {
        "embed": sd["model.embed_tokens.weight"],
        "final_norm": sd["model.norm.weight"],
        "lm_head": sd.get("lm_head.weight", sd["model.embed_tokens.weight"]),
        "inv_freq": model.model.rotary_emb.inv_freq.detach().float(),
        "layers": [{"attn_norm": layer(i, "input_layernorm"),
                    "wq": layer(i, "self_attn.q_proj"), "wk": layer(i, "self_attn.k_proj"),
                    "wv": layer(i, "self_attn.v_proj"), "wo": layer(i, "self_attn.o_proj"),
                    "mlp_norm": layer(i, "post_attention_layernorm"),
                    "w_gate": layer(i, "mlp.gate_proj"), "w_up": layer(i, "mlp.up_proj"),
                    "w_down": layer(i, "mlp.down_proj")} for i in range(cfg.n_layers)]}
    if float(getattr(model.model.rotary_emb, "attention_scaling", 1.0)) != 1.0:
      raise ConfigError(f"{cfg.name}: RoPE attention scaling != 1 is not supported")
    self.dtype = self.w["embed"].dtype
    self.compiled = bool(compile)
    self.compile_note = None
    kw = dict(n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, eps=cfg.norm_eps)
    eager = lambda w, tok, lens, ks, vs, tree=None: _forward(w, tok, lens, ks, vs, **kw, tree=tree)
    self._eager_logits = lambda w, tok, lens, ks, vs, tree=None: _forward(
        w, tok, lens, ks, vs, **kw, logits=True, tree=tree)
    self._eager = eager
    self._fn = eager
    if self.compiled:
      for limit in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, limit):  # pylint: disable=protected-access
          setattr(torch._dynamo.config, limit, 256)  # pylint: disable=protected-access
      self._fn = torch.compile(eager, dynamic=False)

  def new_cache(self, batch: int, capacity: int) -> "Cache":
    if capacity <= 0 or batch <= 0:
      raise CacheOverflowError(f"cache needs batch>0 and capacity>0, got "
                                   f"batch={batch}, capacity={capacity}")
    torch, c = self.torch, self.cfg
    shape = (batch, c.n_kv_heads, capacity, c.d_head)  # [B, K, S, D]
    zeros = lambda: [torch.zeros(shape, dtype=self.dtype) for _ in range(c.n_layers)]
    return Cache(zeros(), zeros(), torch.zeros((batch,), dtype=torch.int64))

  def _check(self, tokens, cache: "Cache", live=None) -> None:
    lens = cache.lengths.numpy()
    kvc.check_capacity(lens if live is None else lens[live], tokens.shape[1], cache.capacity)

  def step(self, tokens, cache: "Cache", live=None, tree=None):
    """argmax [B, T] of a forward over tokens [B, T]; lengths += T. Capacity
    is checked first (for the `live` rows when given: the others ride
    along, their writes inside the capacity by construction)."""
    self._check(tokens, cache, live)
    with self.torch.inference_mode():
      try:
        out = self._fn(self.w, tokens, cache.lengths, cache.k, cache.v, tree)
      except Exception as e:  # pylint: disable=broad-except
        if not self.compiled:
          raise
        # torch.compile broken here: record why, go on eager.
        self.compile_note = f"torch.compile failed, eager fallback: {first_line(e)}"
        self.compiled, self._fn = False, self._eager
        out = self._fn(self.w, tokens, cache.lengths, cache.k, cache.v, tree)
    cache.lengths += tokens.shape[1]
    return out

  def logits(self, tokens, cache: "Cache", tree=None):
    """f32 logits [B, T, V] of the same forward, eager (`tree`: a tree
    verify, see _forward); lengths += T."""
    self._check(tokens, cache)
    with self.torch.inference_mode():
      out = self._eager_logits(self.w, tokens, cache.lengths, cache.k, cache.v, tree)
    cache.lengths += tokens.shape[1]
    return out

  def prefill(self, prompts: Sequence[Sequence[int]], cache: "Cache"):
    """Writes each row's prompt at slots 0..len-1 (right-padded batch, eager);
    returns the argmax [B] at each row's last prompt token."""
    torch = self.torch
    lens = torch.tensor([len(p) for p in prompts], dtype=torch.int64)
    pad = max(len(p) for p in prompts)
    ids = torch.tensor([list(p) + [0] * (pad - len(p)) for p in prompts], dtype=torch.int64)
    cache.lengths.zero_()
    logits = self.logits(ids, cache)
    cache.lengths.copy_(lens)  # padding slots are past the lengths: never attended
    return torch.argmax(logits[torch.arange(len(prompts)), lens - 1], -1)


@dataclasses.dataclass
class Cache:
  k: list   # L x [B, K, S, D]
  v: list
  lengths: Any  # [B] int64

  @property
  def capacity(self) -> int:
    return self.k[0].shape[2]


def check_prompts(prompts, vocab_size: int) -> None:
  """Empty batch, empty prompt or an id outside the vocabulary -> ConfigError."""
  if not len(prompts):
    raise ConfigError("no prompts")
  for i, p in enumerate(prompts):
    if not len(p):
      raise ConfigError(f"prompt {i} is empty")
    bad = [t for t in p if not 0 <= int(t) < vocab_size]
    if bad:
      raise ConfigError(f"prompt {i}: token id {bad[0]} outside the vocabulary "
                        f"[0, {vocab_size})")


@dataclasses.dataclass
class TorchGenResult:
  tokens: list[list[int]]  # generated ids per row, prompt excluded
  prompt_s: float          # prefill wall time
  eval_s: float            # decode loop wall time (first token excluded)
  n_eval: int              # decode steps per row


@dataclasses.dataclass
class TorchSpecResult:
  tokens: list[list[int]]
  stats: SpecStats
  records: Records
  prompt_s: float
  eval_s: float
  n_loop: int              # loop iterations (verify calls of the batch)


class TorchSpec:
  """Target-only and speculative greedy generation at batch B (see module)."""

  def __init__(self, target: TorchLlama, draft: TorchLlama | None = None):
    self.target, self.draft = target, draft
    if draft is not None and draft.cfg.vocab_size != target.cfg.vocab_size:
      raise ConfigError(f"draft and target vocabularies differ: {target.cfg.vocab_size} "
                        f"vs {draft.cfg.vocab_size}")
    self.torch = target.torch

  def _capacity(self, prompts, n_predict, extra, capacity):
    check_prompts(prompts, self.target.cfg.vocab_size)
    return generation.plan_capacity(self.target.cfg, max(len(p) for p in prompts),
                                    n_predict, extra=extra, capacity=capacity)

  def generate_target(self, prompts, n_predict: int,
                      capacity: int | None = None) -> TorchGenResult:
    """n_predict greedy tokens per row from the target alone."""
    torch = self.torch
    cap = self._capacity(prompts, n_predict, 0, capacity)
    cache = self.target.new_cache(len(prompts), cap)
    t0 = time.perf_counter()
    tok = self.target.prefill(prompts, cache)
    prompt_s = time.perf_counter() - t0
    out = [tok]
    t0 = time.perf_counter()
    for _ in range(n_predict - 1):
      tok = self.target.step(tok[:, None], cache)[:, 0]
      out.append(tok)
    eval_s = time.perf_counter() - t0
    return TorchGenResult(torch.stack(out, 1).tolist(), prompt_s, eval_s, n_predict - 1)

  def generate(self, prompts, n_predict: int, gamma: int, rule="real", seed: int = 0,
               capacity: int | None = None) -> TorchSpecResult:
    """n_predict greedy tokens per row, speculatively (speculative.py's step)."""
    torch = self.torch
    if self.draft is None:
      raise ConfigError("speculative generation needs a draft model")
    if int(gamma) < 1:
      raise ConfigError(f"gamma (draft length) must be >= 1, got {gamma}")
    rule = acceptance.parse_rule(rule) if isinstance(rule, str) else rule
    rule = rule.resolve(gamma)
    probs = torch.from_numpy(acceptance.position_probs(rule, gamma))
    gen = torch.Generator().manual_seed(int(seed))
    cap = self._capacity(prompts, n_predict, gamma, capacity)
    b = len(prompts)
    tcache, dcache = self.target.new_cache(b, cap), self.draft.new_cache(b, cap)
    t0 = time.perf_counter()
    first = self.target.prefill(prompts, tcache)
    self.draft.prefill(prompts, dcache)
    prompt_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    out, count, rec, n_loop = self._loop(tcache, dcache, prompts, first, n_predict, gamma,
                                         rule.simulated, probs, gen)
    eval_s = time.perf_counter() - t0
    tokens = [out[i, :count[i]].tolist() for i in range(b)]
    records = Records.from_arrays(rec)
    stats = SpecStats.compute(records, gamma=gamma, n_predict=int(count.sum()), eval_s=eval_s)
    return TorchSpecResult(tokens, stats, records, prompt_s, eval_s, n_loop)

  def _loop(self, tcache: Cache, dcache: Cache, prompts, first, n_predict, gamma,
            simulated, probs, gen):
    """speculative.spec_loop's steps in a host loop; returns (out [B, n_predict +
    gamma + 1], count [B], records {field: [steps, B]}, steps)."""
    torch = self.torch
    b = len(prompts)
    ar = torch.arange(b)
    pos = torch.arange(gamma + 1)[None, :]
    tail = torch.stack([torch.tensor([p[-1] for p in prompts]), first], 1)  # [B, 2]
    n = tcache.lengths + 1  # [B] sequence length so far
    out = torch.full((b, n_predict + gamma + 1), -1, dtype=torch.int64)
    out[:, 0] = first
    count = torch.ones((b,), dtype=torch.int64)
    done = count >= n_predict
    recs: dict[str, list] = {k: [] for k in ("n_acc", "n_drafted", "kept", "caught_up", "live")}
    i = 0
    while i < n_predict and not bool(done.all()):
      live = ~done
      live_np = live.numpy()
      # draft: catch-up (feed d_gamma, left over from a fully accepted step), gamma steps
      behind = live & (dcache.lengths < n - 1)
      if bool(behind.any()):
        dcache.lengths.copy_(n - 2)
        self.draft.step(tail[:, :1], dcache, live_np)
      tok, drafts = tail[:, 1], []
      for _ in range(gamma):
        tok = self.draft.step(tok[:, None], dcache, live_np)[:, 0]
        drafts.append(tok)
      drafts = torch.stack(drafts, 1)  # [B, gamma]
      # verify: the target's argmax at [last, d_1..d_gamma]
      targ = self.target.step(torch.cat([tail[:, 1:], drafts], 1), tcache, live_np)
      # accept
      if simulated:
        ok = torch.rand((b, gamma), generator=gen) < probs[None, :]
      else:
        ok = drafts == targ[:, :gamma]
      n_acc = torch.cumprod(ok.long(), 1).sum(1)  # [B]
      nxt = targ[ar, n_acc]
      padded = torch.cat([drafts, drafts[:, :1]], 1)
      emitted = torch.where(pos == n_acc[:, None], nxt[:, None], padded)  # [B, gamma+1]
      prev_last = drafts[ar, (n_acc - 1).clamp(min=0)]
      prev = torch.where(n_acc > 0, prev_last, tail[:, 1])
      new_n = torch.where(live, n + n_acc + 1, n)
      t_len = new_n - 1
      d_len = torch.where(live, torch.minimum(new_n - 1, n - 1 + gamma), n - 1)
      new_tail = torch.where(live[:, None], torch.stack([prev, nxt], 1), tail)
      # keep at most n_predict tokens per row
      kept = torch.where(live, torch.minimum(n_acc + 1, n_predict - count), 0)
      for r in np.nonzero(live_np)[0]:
        out[r, count[r]:count[r] + gamma + 1] = emitted[r]
      count = count + kept
      done = done | (count >= n_predict)
      # commit: cut what n_predict dropped from the sequence, both caches, the tail
      dropped = torch.where(live, n_acc + 1 - kept, 0)
      n = new_n - dropped
      ext = torch.cat([tail[:, 1:], emitted], 1)  # [last, e_1 .. e_{gamma+1}]
      cut = torch.stack([ext[ar, (kept - 1).clamp(min=0)], ext[ar, kept]], 1)
      tail = torch.where((dropped > 0)[:, None], cut, new_tail)
      tcache.lengths.copy_(t_len - dropped)
      dcache.lengths.copy_(torch.minimum(d_len, n - 1))
      for k, v in (("n_acc", n_acc), ("n_drafted", torch.full((b,), gamma)), ("kept", kept),
                   ("caught_up", behind.long()), ("live", live.long())):
        recs[k].append(v.numpy().astype(np.int32))
      i += 1
    rec = {k: np.stack(v) if v else np.zeros((0, b), np.int32) for k, v in recs.items()}
    return out, count, rec, i

# ---------------------------------------------------------------- timing


def _median(xs):
  return statistics.median(xs)


def time_point(engine: TorchSpec, prompts, n_predict: int, gamma: int, rule: str,
               reps: int = 3, seed: int = 0, capacity: int | None = None) -> dict[str, Any]:
  """Target-only and speculative tokens/s at batch B = len(prompts), summed
  over rows (first token excluded, as specjax's), each repetition running
  both, the order alternating; medians over repetitions, speedup the median
  of each repetition's ratio (sweep.run_group's pairing). The first call of
  each (warm-up: torch.compile) is timed apart (`warmup_s`); a graph built
  during the timed repetitions raises (shapes changed)."""
  cap = capacity or generation.plan_capacity(
      engine.target.cfg, max(len(p) for p in prompts), n_predict, extra=gamma)
  base = lambda: engine.generate_target(prompts, n_predict, capacity=cap)
  spec = lambda: engine.generate(prompts, n_predict, gamma, rule=rule, seed=seed, capacity=cap)
  graphs0 = _dynamo_graphs()
  t0 = time.perf_counter()
  base(), spec()
  warmup_s = time.perf_counter() - t0
  graphs = _dynamo_graphs()
  rows, res, _ = paired_reps(base, spec, reps, len(prompts))
  if _dynamo_graphs() != graphs:
    raise RuntimeError(f"{_dynamo_graphs() - graphs} torch.compile graph(s) built inside "
                       f"the timed repetitions: shapes changed between runs")
  return {"engine": "torch" + ("-compile" if engine.target.compiled else "-eager"),
          "batch": len(prompts), "gamma": gamma, "accept_rule": str(rule),
          "n_predict": n_predict, "capacity": cap, "reps": reps, "seed": seed,
          **point_fields(rows, res.stats), "n_loop": res.n_loop, "warmup_s": warmup_s,
          "graphs_built": graphs - graphs0, "compile_note": engine.target.compile_note}


def paired_reps(base, spec, reps: int, n_rows: int):
  """`reps` repetitions of target-only and speculative generation, the order
  alternating (sweep.run_group's pairing). Returns (rows of per-token
  seconds {base_s, spec_s}, the last speculative result, the last
  target-only result); any engine whose results carry eval_s, n_eval and
  stats.n_kept."""
  rows, res, b = [], None, None
  for rep in range(reps):
    if rep % 2:
      res, b = spec(), base()
    else:
      b, res = base(), spec()
    rows.append({"base_s": b.eval_s / (n_rows * b.n_eval),
                 "spec_s": res.eval_s / res.stats.n_kept})
  return rows, res, b


def point_fields(rows, st) -> dict[str, Any]:
  """A point's speeds (medians over the paired repetitions; speedup the
  median of each repetition's ratio) and acceptance counts."""
  speedups = [r["base_s"] / r["spec_s"] for r in rows]
  return {"baseline_tps": 1 / _median([r["base_s"] for r in rows]),
          "spec_tps": 1 / _median([r["spec_s"] for r in rows]),
          "speedup": _median(speedups), "speedup_reps": speedups,
          "n_steps": st.n_steps, "n_kept": st.n_kept, "n_accept": st.n_accept,
          "n_drafted": st.n_drafted, "n_catchup": st.n_catchup, "accept_rate": st.accept_rate,
          "mean_accepted": st.mean_accepted, "tokens_per_step": st.tokens_per_step}


class TorchCostProbe:
  """T(B, n): one forward over n new tokens per row (with the argmax of its
  logits, as the runs consume them) against a cache of `capacity` slots
  holding `depth` tokens per row; `k` forwards per repetition from the same
  state (lengths set back), time per forward (probes.CostProbe's shape, with
  the batch as a dimension; here each forward is a host call, as in the
  torch loop)."""

  def __init__(self, m: TorchLlama, batch: int, capacity: int, depth: int, seed: int = 0,
               k: int = REPEATS):
    self.m, self.batch, self.capacity, self.depth, self.k = m, batch, capacity, depth, k
    self.rng = np.random.RandomState(seed)
    self.cache = m.new_cache(batch, capacity)
    if depth:
      m.prefill(self.rng.randint(0, m.cfg.vocab_size, (batch, depth)).tolist(), self.cache)
    self.warm: set[int] = set()

  def times(self, ns: Sequence[int], reps: int = 3) -> dict[int, timing.Timing]:
    torch = self.m.torch
    kvc.check_capacity([self.depth], max(ns), self.capacity)
    out = {}
    for n in sorted(set(ns)):
      tokens = torch.from_numpy(self.rng.randint(0, self.m.cfg.vocab_size, (self.batch, n)))

      def run(tokens=tokens):
        for _ in range(self.k):
          self.cache.lengths.fill_(self.depth)
          self.m.step(tokens, self.cache)

      warm_s = 0.0
      if n not in self.warm:
        t0 = time.perf_counter()
        run()
        warm_s = time.perf_counter() - t0
        self.warm.add(n)
      times = []
      for _ in range(reps):
        t0 = time.perf_counter()
        run()
        times.append((time.perf_counter() - t0) / self.k)
      out[n] = timing.Timing(times=times, compile_s=warm_s)
    return out


def make_engine(tcfg: ModelConfig, tparams, dcfg: ModelConfig | None = None, dparams=None,
                compile: bool = True, threads: int | None = None) -> TorchSpec:
  """A TorchSpec on the same weights as specjax's params (hf.to_torch_model)."""
  target = TorchLlama(tcfg, tparams, compile=compile, threads=threads)
  draft = (None if dcfg is None
           else TorchLlama(dcfg, dparams, compile=compile, threads=threads))
  return TorchSpec(target, draft)

