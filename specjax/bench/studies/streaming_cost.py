"""What the streaming draft costs against the target as the context grows:
one draft step (its whole chain proposal / gamma, probes.draft_probe, on the
target's cache holding the context) next to one target decode step T(1)
(probes.CostProbe), at each (context, batch); the two alternate within each
repetition so that drift in the machine's load hits both alike; medians.
c = T_draft(1) / T_target(1). docs/streaming.md."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from specjax.decode import probes
from specjax.drafters import registry
from specjax.model import kv_cache as kvc
from specjax.model import steps


def streaming_cost(target: steps.Runner, spec: str, contexts: Sequence[int],
                   batches: Sequence[int], gamma: int, reps: int,
                   log: Callable[[str], None] = print) -> list[dict]:
  """One record per (context, batch): T_draft(1), T_target(1), c and the
  spread of c over the repetitions (compile and warm-up untimed)."""
  drafter = registry.parse(spec)
  recs = []
  for context in contexts:
    capacity = kvc.round_capacity(context + gamma + 2)
    for batch in batches:
      tprobe = probes.CostProbe(target, capacity, context, batch=batch)
      dprobe = probes.draft_probe(drafter, target, None, gamma, capacity, context, batch=batch)
      t_target, t_draft = [], []
      for r in range(reps + 1):  # the first round compiles and warms up, untimed
        t, d = tprobe.times([1])[1].median, dprobe.times([1])[1].median
        if r:
          t_target.append(t)
          t_draft.append(d)
      c = np.asarray(t_draft) / np.asarray(t_target)
      recs.append({"drafter": drafter.spec, "context": context, "batch": batch,
                   "gamma": gamma, "t_target_s": float(np.median(t_target)),
                   "t_draft_s": float(np.median(t_draft)), "c": float(np.median(c)),
                   "c_min": float(np.min(c)), "c_max": float(np.max(c)), "reps": reps})
      log(f"context {context} batch {batch}: T_target(1) {1e3 * recs[-1]['t_target_s']:.2f} ms, "
          f"T_draft(1) {1e3 * recs[-1]['t_draft_s']:.2f} ms, c {recs[-1]['c']:.3f} "
          f"({recs[-1]['c_min']:.3f}-{recs[-1]['c_max']:.3f})")
      del tprobe, dprobe  # the two caches of this point
  return recs
