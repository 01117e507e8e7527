"""The cost surface T(B, N, context) (issue 39, part 2): the target's
forward over N tokens per row and one draft step of each drafter, at each
(context, batch), in XLA (decode/probes.py) and in PyTorch (the probes of
torch_spec.py, torch_drafts.py and torch_eagle.py, on the same weights), the
engines and roles alternating within each repetition; medians. Beside each
time: the bytes of weights and of KV the step reads (the roofline's inputs)
and the process's peak resident memory.

The caches hold random K/V at the context (`random_cache`: a step's time
does not depend on the values); parity is checked first on a real prompt.
A point whose caches and activations would not fit is refused in one line
before it runs (`estimate_bytes` against `available_bytes`: the device's
pool on an accelerator, the host's memory on the CPU). The workdir resumes
finished points and refuses other settings. docs/long_context.md.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import workdir as wd
from specjax.bench.backends import base as backends
from specjax.bench.backends import torch_drafts
from specjax.bench.backends import torch_eagle
from specjax.bench.backends import torch_spec
from specjax.bench.memory import (available_bytes, device_memory, peak_rss, release_memory,
                                  reset_peak, rss)
from specjax.bench.studies import roofline
from specjax.decode import plan
from specjax.decode import probes
from specjax.drafters import eagle
from specjax.drafters import registry
from specjax.drafters import streaming
from specjax.errors import ConfigError
from specjax.model import kv_cache as kvc
from specjax.model import llama
from specjax.model import steps

DRAFT_KINDS = ("streaming", "eagle", "model")  # n-gram's step is per row and tiny
SETTINGS = "settings.json"
MEMORY_MARGIN = 0.8  # of the memory available at a point's start


@dataclasses.dataclass(frozen=True)
class Settings:
  """What the records depend on (recorded beside them; a resume must match)."""
  model: str
  dtype: str
  contexts: tuple[int, ...]
  batches: tuple[int, ...]
  ns: tuple[int, ...]
  drafters: tuple[str, ...]
  engines: tuple[str, ...] = ("xla", "torch")
  gamma: int = 4
  reps: int = 3
  k: int = probes.PROBE_REPEATS  # steps (draft proposals) per timed call
  torch_compile: bool = False  # eager by default: torch.compile takes minutes a shape here
  torch_threads: int = 0  # 0: torch's default (the cores)
  model_draft: str | None = None
  attention: str = "auto"  # XLA's kernel (ModelConfig.attention, set by the caller)

  def __post_init__(self):
    if not set(self.engines) <= {"xla", "torch"} or not self.engines:
      raise ConfigError(f"engines {list(self.engines)}: choose among xla, torch")
    for spec in self.drafters:
      d = registry.parse(spec)
      if d.kind not in DRAFT_KINDS:
        raise ConfigError(f"drafter {spec}: the surface times {', '.join(DRAFT_KINDS)}")
      shortened = getattr(d, "vocab", None) or getattr(d, "layers", 0)
      if shortened and d.needs_draft_model:  # CostProbe times the model's own full head
        raise ConfigError(f"drafter {spec}: the surface times a draft model's forward over "
                          "its full vocabulary; drop :vocab=")
      if shortened and "torch" in self.engines:
        raise ConfigError(f"drafter {spec}: PyTorch's drafts run every layer over the full "
                          "vocabulary; time this one with --engines=xla")
      if d.needs_draft_model and not self.model_draft:
        raise ConfigError(f"drafter {spec} needs --model_draft")
    if min(self.ns) < 1 or min(self.batches) < 1 or min(self.contexts) < 2:
      raise ConfigError("ns and batches must be >= 1, contexts >= 2")


def random_cache(cfg, batch: int, capacity: int, depth: int, seed: int = 0) -> kvc.KVCache:
  """A cache whose first `depth` slots per row hold random K/V (not a model's)."""
  cache = kvc.init_cache(cfg, batch, capacity)
  key = jax.random.PRNGKey(seed)
  fill = lambda i, a: jax.random.normal(jax.random.fold_in(key, i), a.shape, a.dtype)
  return jax.block_until_ready(cache.replace(
      k=tuple(fill(2 * i, a) for i, a in enumerate(cache.k)),
      v=tuple(fill(2 * i + 1, a) for i, a in enumerate(cache.v)),
      lengths=jnp.full((batch,), depth, jnp.int32)))


def slot_bytes(cfg, layers: int | None = None) -> int:
  """Bytes of K and V of one slot of one row over `layers` (all) layers."""
  item = np.dtype(cfg.jnp_dtype).itemsize
  return 2 * (cfg.n_layers if layers is None else layers) * cfg.n_kv_heads * cfg.d_head * item


def capacity_of(context: int, s: Settings) -> int:
  return kvc.round_capacity(context + max(max(s.ns), 2 * s.gamma + 2) + 1)

# ---------------------------------------------------------------- memory


def estimate_bytes(cfg, s: Settings, context: int, batch: int, draft_cfgs: dict) -> int:
  """The point's new memory: each engine's caches (the target's probe, a
  streaming draft's own copy of the target's cache, a head's or a draft
  model's cache) and its largest activations (logits of N tokens, torch's
  masked scores over the capacity), x 1.75 for the transient copies (a
  probe's empty cache while its random one is drawn: a point's growth of
  resident memory was 1.6x the sum at context 2048, batch 8, on SmolLM2)."""
  cap, n = capacity_of(context, s), max(s.ns)
  target = batch * cap * slot_bytes(cfg)
  drafts = sum(batch * cap * slot_bytes(c) for c in draft_cfgs.values())
  logits = 3 * batch * n * cfg.vocab_size * 4
  per = {"xla": target + drafts + logits,
         "torch": target + drafts + logits + 3 * batch * cfg.n_heads * n * cap * 4}
  return int(1.75 * sum(per[e] for e in s.engines))

# ---------------------------------------------------------------- parity


def check_parity(target: steps.Runner, tmodel, s: Settings, seed: int = 0, draft=None,
                 tdraft=None) -> dict[str, float]:
  """The torch engine's logits against XLA's on one real prompt (batch 1,
  the longest window plus 16 tokens): the target's and the draft model's
  decode steps, each streaming draft's first feed and each EAGLE head's
  logits. Raises ParityError (one line) past the
  dtype's tolerance (base.PARITY_TOL); returns the errors."""
  cfg, tol = target.cfg, backends.parity_tolerance("torch", s.dtype)
  drafts = [registry.parse(d) for d in s.drafters]
  windows = [d for d in drafts if isinstance(d, streaming.StreamingDrafter)]
  n = 16 + max([d.window + d.sinks for d in windows] + [16])
  prompt = np.random.RandomState(seed).randint(0, cfg.vocab_size, n + 1).tolist()
  ref, other, cache, tcache = decode_logits(target, tmodel, prompt)
  tok, torch_tok = jnp.asarray([[prompt[-1]]], jnp.int32), tmodel.torch.tensor([[prompt[-1]]])
  errs = {"target": backends.check_parity(ref, other, tol,
                                          "torch vs xla, the target's decode step")}
  if tdraft is not None:
    ids = [t % draft.cfg.vocab_size for t in prompt[-33:]]
    errs["model"] = backends.check_parity(*decode_logits(draft, tdraft, ids)[:2], tol,
                                          "torch vs xla, the draft model's decode step")
  for d in windows:
    tcache.lengths.fill_(n)
    window = kvc.Window(start=cache.lengths, sinks=d.sinks, size=d.window, span=1)
    ref = np.asarray(llama.forward(target.params, tok, cache, cfg, window=window)[0])
    other = torch_drafts.TorchStreamingDraft(tmodel, d.window, d.sinks).propose(
        torch_tok[:, 0], tcache, 1, logits=True)[1]
    errs[d.spec] = backends.check_parity(ref, other.numpy(), tol,
                                         f"torch vs xla, {d.spec}'s draft step")
  for d in (d for d in drafts if isinstance(d, eagle.EagleDrafter)):
    errs[d.spec] = backends.check_parity(*head_logits(d.for_target(cfg), target, tmodel,
                                                      prompt[:n]), tol,
                                         f"torch vs xla, {d.spec}'s head")
  return errs


def decode_logits(runner: steps.Runner, tm, prompt):
  """One decode step after prompt[:-1], in XLA and in torch: (XLA's logits,
  torch's [1, 1, V], XLA's cache, torch's cache; both before the step)."""
  cap = kvc.round_capacity(len(prompt) + 1)
  _, cache = runner.prefill([prompt[:-1]], runner.new_cache(1, cap))
  ref = llama.forward(runner.params, jnp.asarray([[prompt[-1]]], jnp.int32), cache, runner.cfg)
  tcache = tm.new_cache(1, cap)
  tm.prefill([prompt[:-1]], tcache)
  other = tm.logits(tm.torch.tensor([[prompt[-1]]]), tcache).numpy()
  tcache.lengths.fill_(len(prompt) - 1)
  return np.asarray(ref[0]), other, cache, tcache


def head_logits(d, target: steps.Runner, tmodel, tokens) -> tuple[np.ndarray, np.ndarray]:
  """An EAGLE head's logits over pairs (random features, `tokens`) from an
  empty head cache: (XLA's, torch's) [1, T, V]."""
  cfg, dparams = target.cfg, d.draft_params(target.params, None)
  hcfg = d.draft_config(cfg, None)
  feats = np.random.RandomState(1).randn(1, len(tokens), cfg.dim).astype(np.float32)
  toks = np.asarray([tokens], np.int32)
  cap = kvc.round_capacity(len(tokens) + 1)
  g, _ = eagle.head_forward(dparams["head"], target.params, jnp.asarray(feats), jnp.asarray(toks),
                            eagle.new_cache(hcfg, 1, cap), hcfg, cfg, prev_tokens=jnp.asarray(toks))
  head, torch = torch_eagle.TorchEagleHead(tmodel, dparams["head"]), tmodel.torch
  tt = torch.from_numpy(toks).long()
  other = head.logits(head.forward(torch.from_numpy(feats), tt, head.new_cache(1, cap), tt))
  return np.asarray(llama.head_logits(target.params, g, cfg)), other.numpy()

# ---------------------------------------------------------------- probes


def xla_draft_probe(drafter, target: steps.Runner, draft: steps.Runner | None, s: Settings,
                    cap: int, context: int, batch: int):
  """XLA's probe of one draft step at (context, batch) on random K/V: a
  draft model's forward (CostProbe), or a whole proposal per token
  (ProposeProbe) with the target's cache (streaming) or the head's
  (eagle, its pending pairs moved to the context's end) at the context."""
  if drafter.needs_draft_model:
    probe = probes.CostProbe(draft, cap, 0, batch=batch, k=s.k)
    probe.holder[0], probe.depth = random_cache(draft.cfg, batch, cap, context), context
    return probe
  probe = probes.ProposeProbe(drafter, target.cfg, s.gamma, cap, 2, target=target, batch=batch,
                              k=s.k)
  probe.n = jnp.full((batch,), context, jnp.int32)
  if isinstance(drafter, streaming.StreamingDrafter):
    probe.tcache = random_cache(target.cfg, batch, cap, context - 1, seed=1)
  else:  # the head's own cache at the context; it reads no target cache
    probe.tcache = None
    st = probe.dstate
    probe.dstate = st.replace(hcache=random_cache(probe.sc.draft, batch, cap, context - 1, 2),
                              pending=st.pending.replace(start=probe.n - 1))
  return probe


def torch_head_probe(d, target: steps.Runner, tmodel, s: Settings, cap: int, context: int,
                     batch: int):
  """PyTorch's probe of an EAGLE head's step, XLA's shape (xla_draft_probe):
  its own cache of random K/V at the context, the refresh as wide as XLA's."""
  d = d.for_target(target.cfg)
  pairs = plan.SpecConfig(target.cfg, None, s.gamma, drafter=d, simulated=True).refresh_pairs(
      batch)
  head = torch_eagle.TorchEagleHead(tmodel, d.draft_params(target.params, None)["head"])
  return torch_eagle.TorchHeadProbe(head, batch, cap, context, s.gamma, pairs, seed=2, k=s.k)


def draft_reads(drafter, cfg, dcfg, context: int, gamma: int) -> tuple[int, int]:
  """(slots per row, bytes per slot) one draft step reads: a streaming
  draft its sinks, window and fed slots over the layers it runs (dcfg's:
  every layer, or its +layerskip:K prefix); a head or a draft model its own
  cache over its layers."""
  del cfg
  window = isinstance(drafter, streaming.StreamingDrafter)
  slots = min(context, drafter.sinks + drafter.window) if window else context
  return slots + gamma, slot_bytes(dcfg)


class Point:
  """The probes of one (context, batch): {(engine, role, n): probe}."""

  def __init__(self, target, tmodel, draft, tdraft, s: Settings, context: int, batch: int):
    cap = capacity_of(context, s)
    self.probes: dict[tuple[str, str, int], Any] = {}
    if "xla" in s.engines:
      tp = probes.CostProbe(target, cap, 0, batch=batch, k=s.k)
      tp.holder[0], tp.depth = random_cache(target.cfg, batch, cap, context), context
      for n in s.ns:
        self.probes["xla", "target", n] = tp
      for spec in s.drafters:
        self.probes["xla", spec, 1] = xla_draft_probe(registry.parse(spec).for_target(target.cfg),
                                                      target, draft, s, cap, context, batch)
    if "torch" in s.engines:
      tp = torch_spec.TorchCostProbe(tmodel, batch, cap, context, k=s.k, random_kv=True)
      for n in s.ns:
        self.probes["torch", "target", n] = tp
      for spec in s.drafters:
        d = registry.parse(spec)
        if isinstance(d, streaming.StreamingDrafter):
          self.probes["torch", spec, 1] = torch_drafts.TorchDraftProbe(
              torch_drafts.TorchStreamingDraft(tmodel, d.window, d.sinks), batch, cap, context,
              s.gamma, seed=1, k=s.k)
        elif isinstance(d, eagle.EagleDrafter):
          self.probes["torch", spec, 1] = torch_head_probe(d, target, tmodel, s, cap, context,
                                                           batch)
        elif d.needs_draft_model:
          self.probes["torch", spec, 1] = torch_spec.TorchCostProbe(tdraft, batch, cap, context,
                                                                    k=s.k, random_kv=True)

  def measure(self, reps: int) -> dict[tuple[str, str, int], list[float]]:
    """Every probe once to warm up (compiles), then `reps` rounds of all,
    the order reversed every other round; seconds per round and key."""
    keys = list(self.probes)
    for key in keys:
      self.probes[key].times([key[2]], 1)
    out: dict = {key: [] for key in keys}
    for r in range(reps):
      for key in (keys if r % 2 == 0 else keys[::-1]):
        out[key].append(self.probes[key].times([key[2]], 1)[key[2]].median)
    return out


def point_records(cfg, dcfgs: dict, weights: dict, s: Settings, context: int, batch: int,
                  times: dict) -> list[wd.Record]:
  """One record per (engine, role, n): the median seconds and their spread,
  the weights' bytes and the KV bytes the step reads (XLA's blocked
  attention reads whole 256-slot blocks up to the length, torch's masked
  pass the whole capacity)."""
  cap, recs = capacity_of(context, s), []
  for (engine, role, n), ts in times.items():
    if role == "target":
      per = slot_bytes(cfg)
      slots = cap if engine == "torch" else roofline.attended_slots(cfg, cap, context + n)
    else:
      d = registry.parse(role)
      slots, per = draft_reads(d, cfg, dcfgs[role], context, s.gamma)
      if engine == "torch" and not isinstance(d, streaming.StreamingDrafter):
        slots = cap  # the masked pass over the own cache's capacity
    recs.append({"context": context, "batch": batch, "engine": engine, "role": role, "n": n,
                 "seconds": float(np.median(ts)), "min_s": float(np.min(ts)),
                 "max_s": float(np.max(ts)), "reps": len(ts), "weight_bytes": weights[role],
                 "kv_slots": int(slots), "kv_bytes": int(batch * slots * per),
                 "gamma": s.gamma if role != "target" else None})
  return recs


def run(work: str | os.PathLike, s: Settings, target: steps.Runner, tmodel, draft=None,
        tdraft=None, log: Callable[[str], None] = print) -> list[wd.Record]:
  """Runs (or resumes) the surface in `work`; returns every record."""
  work = Path(work)
  out = work / wd.RESULTS
  if not wd.check_stage(work / SETTINGS, dataclasses.asdict(s), [out],
                        "use the same settings to resume, or another --workdir"):
    out.unlink(missing_ok=True)
  # a refused point is tried again: the memory available may have changed
  done = [r for r in (wd.read_jsonl(out) if out.exists() else []) if "refused" not in r]
  wd.restart_jsonl(out, done)
  cfg = target.cfg
  drafters = {spec: registry.parse(spec).for_target(cfg) for spec in s.drafters}
  dcfgs = {spec: d.draft_config(cfg, draft and draft.cfg) for spec, d in drafters.items()}
  weights = {"target": llama.param_bytes(target.params)}
  for spec, d in drafters.items():  # what a draft step reads of the weights
    own = d.draft_params(target.params, draft)
    weights[spec] = (llama.param_bytes(own) if not isinstance(d, eagle.EagleDrafter)
                     else llama.param_bytes(own["head"]) + llama.param_bytes(
                         {k: v for k, v in target.params.items() if k == "lm_head"}
                         or target.params["embed"]))
  if "torch" in s.engines:
    log("parity: " + ", ".join(f"{k} {v:.2g}" for k, v in
                               check_parity(target, tmodel, s, draft=draft,
                                            tdraft=tdraft).items()))
  finished = {(r["context"], r["batch"]) for r in done}
  grid = [(c, b) for c in s.contexts for b in s.batches]
  todo = [p for p in grid if p not in finished]
  log(f"{len(grid) - len(todo)} of {len(grid)} points done before, {len(todo)} to run")
  t0 = time.perf_counter()
  for i, (context, batch) in enumerate(todo):
    need, have = estimate_bytes(cfg, s, context, batch, dcfgs), available_bytes()
    if have is not None and need > MEMORY_MARGIN * have:
      line = (f"context {context} batch {batch}: refused, needs about {need / 2**30:.1f} GiB, "
              f"{have / 2**30:.1f} GiB available")
      log(line)
      wd.append_jsonl(out, [{"context": context, "batch": batch, "refused": line}])
      continue
    gc.collect()
    release_memory()
    tracked = reset_peak()
    before = rss()
    times = Point(target, tmodel, draft, tdraft, s, context, batch).measure(s.reps)
    gc.collect()
    release_memory()
    recs = point_records(cfg, dcfgs, weights, s, context, batch, times)
    peak = peak_rss()
    env = {"load_avg": wd.load_avg(), "estimate_bytes": need, "available_bytes": have,
           "peak_rss_bytes": peak, "rss_before_bytes": before,
           "peak_since": "point" if tracked else "process",
           "peak_device_bytes": device_memory().get("peak_bytes_in_use")}
    wd.append_jsonl(out, [{**r, **env} for r in recs])
    left = len(todo) - i - 1
    per = (time.perf_counter() - t0) / (i + 1)
    log(f"[{i + 1}/{len(todo)}] context {context} batch {batch}: " + ", ".join(
        f"{r['engine']} {r['role']} N{r['n']} {1e3 * r['seconds']:.1f} ms" for r in recs)
        + f"; peak {0 if peak is None else peak / 2**30:.2f} GiB; ~{left * per / 60:.0f} min left")
  return wd.read_jsonl(out)


def measured(recs: Sequence[wd.Record]) -> list[wd.Record]:
  """The timed records (refused points left out)."""
  return [r for r in recs if "refused" not in r]
