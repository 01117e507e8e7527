"""specjax's own backends: `xla` (one host-dispatched forward_step per call)
and `xla-loop` (probes.CostProbe: k forwards in one jitted loop, no dispatch).
`xla` is the parity reference of every other backend."""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp
import numpy as np

from specjax.bench.studies import llama_bench as bench
from specjax.decode import probes
from specjax.model import steps
from specjax.metrics import timing
from specjax.bench.backends.base import Backend, CpuUse, Sample
from specjax.model.config import ModelConfig


def xla_threads() -> int:
  """Threads XLA:CPU computes with: its Eigen pool spans every core unless
  XLA_FLAGS turns multi-threaded Eigen off."""
  if "--xla_cpu_multi_thread_eigen=false" in os.environ.get("XLA_FLAGS", ""):
    return 1
  return os.cpu_count() or 1


class XlaBackend(Backend):
  """specjax's forward_step, one host-dispatched call per forward."""
  name = "xla"

  def __init__(self, cfg: ModelConfig, params):
    self.m, self.threads = steps.Runner(cfg, params), xla_threads()

  def prepare(self, prefix, capacity, max_n):
    b, d = prefix.shape
    self.capacity = capacity
    cache = self.m.new_cache(b, capacity)
    self.holder = [timing.block(self.m.prefill(prefix.tolist(), cache)[1])]
    self.depth = np.full((b,), d, np.int32)

  def runner(self, tokens):
    return bench.pp_runner(self.m, self.holder, jnp.asarray(tokens, jnp.int32), self.depth)

  def logits(self, tokens):
    return np.asarray(self.runner(tokens)(), np.float32)


class XlaLoopBackend(Backend):
  """probes.CostProbe: k forwards inside one jitted loop, time per forward.
  Same model code as xla, so it is not checked for parity separately."""
  name = "xla-loop"
  max_batch = 1
  parity = False

  def __init__(self, xla: XlaBackend, k: int, seed: int):
    self.xla, self.k, self.seed, self.threads = xla, k, seed, xla.threads

  def prepare(self, prefix, capacity, max_n):
    # The probe fills its own cache with depth random tokens (values do not
    # change the cost).
    self.probe = probes.CostProbe(self.xla.m, capacity, prefix.shape[1],
                                 self.seed, self.k)

  def measure(self, tokens, reps, first):
    # The probe warms up (and compiles) on a new N only; each repetition is
    # k forwards, so a thread-pool switch is spread over k.
    n, warm = tokens.shape[1], None
    if n not in self.probe.tokens:  # compile and warm up outside CpuUse
      warm = self.probe.times([n], reps=1)[n]
    with CpuUse() as cpu:
      t = self.probe.times([n], reps=reps)[n]
    if warm:
      t = dataclasses.replace(t, compile_s=warm.compile_s, n_compiles=warm.n_compiles)
    return Sample(t, None, cpu.util)

  def close(self):
    self.probe = None
