"""The sparse-KV self-draft (drafters/streaming.py): its specs; its logits
against an independent reference (the target's tree-mask forward over the
whole sequence, each fed token's row masked to the sinks, the window and its
fed ancestors, at its absolute position), equal to the full target's while
the kept length is <= S + W and not beyond; greedy speculative == greedy
target-only (chain, static tree, a dynamic tree with layer skip) with
prompts the window cuts; the sampled law at T = 1; the cost probe; and the
committed deliberate bugs (the window one slot short, the sinks dropped,
a fed token seeing stale scratch slots, the draft's lengths leaking into
the verify)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.decode import generation
from specjax.decode import probes
from specjax.decode import speculative
from specjax.drafters import registry
from specjax.drafters import streaming
from specjax.errors import ConfigError
from specjax.model import config
from specjax.model import kv_cache as kvc
from specjax.model import layers
from specjax.model import llama
from specjax.model import steps
from specjax.model import tree as trees
from specjax.model.sampling import SamplingParams

import lawcheck
from lawcheck import pair  # noqa: F401  (the V = 6 target)

CFG = config.get_preset("tiny").replace(name="tiny-stream")
S, W = 2, 4
CAP = 32
# the fed block: the root, its two children, a grandchild under the first (BFS),
# fed level by level as a drafted tree is; a chain is the same tokens one by one
ANC = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], bool)
LEVELS = [(0, 1), (1, 3), (3, 4)]
CHAIN = np.tril(np.ones((4, 4), bool))
SHORT, LONG = S + W, S + W + 5  # kept lengths: the window covers all, or cuts 5 slots
PROMPTS = [list(range(3, 3 + 14)), [7, 7, 9]]  # 14 > S + W; the short row grows past it
EXACT_TREE = trees.from_paths([[0], [1], [0, 0], [1, 0], [0, 0, 0]])


@pytest.fixture(scope="module")
def target(init_params):
  return steps.Runner(CFG, init_params(CFG, 5))


def test_specs_round_trip_and_bad_ones_are_one_line():
  for spec in ["streaming:256,4", "streaming:8,0", "streaming:8,2+layerskip:1",
               "streaming:8,2:vocab=full"]:
    d = registry.parse(spec)
    assert d.spec == spec and registry.parse(d.spec) == d
  assert registry.parse("streaming:64") == streaming.StreamingDrafter(64, 4)
  for spec, match in [("streaming", "needs a window"), ("streaming:0", "W must be >= 1"),
                      ("streaming:8,-1", "S must be >= 0"), ("streaming:8.5", "not an integer"),
                      ("streaming:8,x", "not an integer"), ("streaming:8,2,1", "not an integer"),
                      ("streaming:8+layerskip:0-3", "layerskip:K only"),
                      ("streaming:8+ngram", "layerskip:K only"),
                      ("streaming:8+layerskip:0", "at least one layer")]:
    with pytest.raises(ConfigError, match=match):
      registry.parse(spec)
  with pytest.raises(ConfigError, match="keeps 3 layers"):
    registry.parse("streaming:8+layerskip:3").draft_config(CFG, None)


# ---------------------------------------------------------------- the draft's logits


_fill = jax.jit(lambda p, t: llama.forward(p, t, kvc.init_cache(CFG, 1, CAP), CFG)[1])
_masked = jax.jit(lambda p, t, pos, mask: llama.forward(
    p, t, kvc.init_cache(CFG, 1, t.shape[1]), CFG, positions=pos, tree_mask=mask)[0])


def cache_at(target, kept, garbage):
  """The target's cache holding `kept`, its scratch slots past it holding the
  K/V of `garbage` (what an earlier step's verify leaves there)."""
  return kvc.rollback(_fill(target.params, jnp.asarray([kept + garbage])), len(kept))


def draft_logits(target, block, anc):
  """The streaming drafter's logits [m, V] for the fed block (anc None: a
  chain, one token a feed) on a cache, from begin / feed as the walkers call
  them: one compiled function for every cache."""
  d = streaming.StreamingDrafter(W, S)
  sc = type("SC", (), {"draft": d.draft_config(CFG, None)})

  def run(params, cache, tokens):
    n = cache.lengths + 1
    fst, _ = d.begin(params, (), cache, None, n, None, sc, len(block))
    out = []
    for lo, hi in (LEVELS if anc is not None else [(i, i + 1) for i in range(len(block))]):
      logits, fst = d.feed(params, fst, tokens[:, lo:hi], lo,
                           None if anc is None else anc[lo:hi, :hi], None, sc)
      out.append(logits)
    return jnp.concatenate(out, 1)[0]

  params, tokens, run = d.draft_params(target.params, None), jnp.asarray([block]), jax.jit(run)
  return lambda cache: np.asarray(run(params, cache, tokens))


_REFERENCE: dict = {}  # (kept, block, anc, window) -> logits: no engine code under test in it


def reference_logits(target, kept, block, anc, window: bool):
  """The same from the target's tree-mask forward over kept + block: the
  kept tokens causal, fed token f at position len(kept) + depth seeing its
  ancestors-or-self and, of the kept slots, every one (window False) or the
  first S and the last W (window True)."""
  key = (tuple(kept), tuple(block), anc.tobytes(), window)
  if key in _REFERENCE:
    return _REFERENCE[key]
  base, m = len(kept), len(block)
  mask = np.tril(np.ones((base + m, base + m), bool))
  slots = np.arange(base)
  mask[base:, :base] = (slots < S) | (slots >= base - W) if window else True
  mask[base:, base:] = anc
  pos = np.concatenate([np.arange(base), base + anc.sum(1) - 1])
  logits = _masked(target.params, jnp.asarray([kept + block]), jnp.asarray([pos]), jnp.asarray(mask))
  _REFERENCE[key] = np.asarray(logits[0, base:])
  return _REFERENCE[key]


def logit_gaps(target, shapes=("chain", "tree")) -> dict[str, float]:
  """max |draft - reference| per (kept length, shape, reference), with
  stale scratch slots past the kept length."""
  rng = np.random.RandomState(0)
  block, garbage = rng.randint(0, 256, 4).tolist(), rng.randint(0, 256, 8).tolist()
  kepts = {base: rng.randint(0, 256, base).tolist() for base in (SHORT, LONG)}
  caches = {base: cache_at(target, kept, garbage) for base, kept in kepts.items()}
  gaps = {}
  for shape in shapes:
    anc = ANC if shape == "tree" else None
    draft = draft_logits(target, block, anc)
    for base, kept in kepts.items():
      got = draft(caches[base])
      for window in (False, True):
        want = reference_logits(target, kept, block, CHAIN if anc is None else anc, window)
        gaps[(base, shape, window)] = float(np.max(np.abs(got - want)))
  return gaps


def test_the_draft_is_the_window_and_the_target_within_it(target, shapes=("chain", "tree")):
  gaps = logit_gaps(target, shapes)
  for (base, shape, window), gap in gaps.items():
    if base == SHORT or window:  # the window covers everything, or the windowed reference
      assert gap < 2e-5, (base, shape, window, gap)
    else:  # the window is real: the draft is not the full target
      assert gap > 1e-3, (base, shape, window, gap)


# ---------------------------------------------------------------- exactness


@pytest.mark.parametrize("spec,tree", [(f"streaming:{W},{S}", None),
                                       (f"streaming:{W},{S}", EXACT_TREE),
                                       (f"streaming:{W},{S}+layerskip:1",
                                        trees.DynamicTree(2, 3, 5))])
def test_greedy_streaming_equals_target_only(target, spec, tree):
  want = generation.generate(target, PROMPTS, 10).tokens
  got = speculative.generate(target, None, PROMPTS, 10, 3, drafter=spec, tree=tree)
  assert got.tokens == want
  assert np.sum(got.records.n_acc) > 0  # it drafts something the target keeps


def attentive(m: steps.Runner, factor: float) -> steps.Runner:
  """m with its attention's values and output scaled: what a token attends
  to then moves its logits, so the window's cut moves q away from p (with
  lawcheck's target as it is, the draft is nearly the target and a wrong q
  goes unseen: adjusted p 0.01 for q x 0.6, against 1e-52 here)."""
  params = {k: dict(v) for k, v in m.params.items()}
  attn = dict(params["layers_0"]["attn"])
  for w in ("wv", "wo"):
    attn[w] = {"kernel": attn[w]["kernel"] * factor}
  params["layers_0"]["attn"] = attn
  return steps.Runner(m.cfg, params)


def test_sampled_streaming_drafts_follow_the_target(pair):  # noqa: F811  (the fixture)
  """T = 1 on lawcheck's V = 6 target (attentive), a window of 1 slot and
  1 sink: the prompts (2 to 5 tokens) and their continuations are cut by it."""
  target = attentive(pair[0], 4.0)
  ps = lawcheck.output_pvalues(target, None, SamplingParams(1.0), 5, gamma=2,
                               drafter="streaming:1,1")
  assert lawcheck.adjusted(ps) > lawcheck.ALPHA, {k: v for k, v in ps.items()
                                                  if v * len(ps) <= lawcheck.ALPHA}


def test_the_cost_probe_times_the_proposal_on_the_target_cache(target):
  """probes.draft_probe: the streaming draft's whole proposal per token, at
  the batch asked, on the target's prefilled cache (carried, not copied)."""
  probe = probes.draft_probe(registry.parse(f"streaming:{W},{S}"), target, None, 2, CAP, 12,
                             batch=2, k=2)
  assert probe.tcache.lengths.tolist() == [11, 11]
  assert probe.times([1])[1].median > 0
  assert probe.tcache.lengths.tolist() == [11, 11]


# ---------------------------------------------------------------- deliberate bugs


BUGS = {
    "the window one slot short": (kvc.Window, "slots", "start - self.size +",
                                  "start - self.size + 1 +", "logits"),
    "the sinks dropped": (kvc.Window, "slots", "[sinks < cut,", "[sinks < 0,", "logits"),
    "a fed token sees stale scratch slots": (
        layers, "attend_window", "mask = cache_mask(positions, k_cache.shape[2], tree, slots) &",
        "mask = (slots >= 0)[:, None, :] &", "logits"),
    "the draft's lengths leak into the verify": (
        streaming.StreamingDrafter, "end", "tcache.replace(k=",
        "tcache.replace(lengths=fst.cache.lengths, k=", "greedy"),
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_each_deliberate_bug_fails(target, monkeypatch, bug):
  owner, name, old, new, check = BUGS[bug]
  monkeypatch.setattr(owner, name, lawcheck.mutant(getattr(owner, name), old, new))
  jax.clear_caches()  # the programs were compiled without the bug
  try:
    with pytest.raises(AssertionError):
      if check == "logits":
        test_the_draft_is_the_window_and_the_target_within_it(target, ("chain",))
      else:
        test_greedy_streaming_equals_target_only(target, f"streaming:{W},{S}", None)
  finally:
    monkeypatch.undo()
    jax.clear_caches()
