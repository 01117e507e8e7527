"""The streaming self-draft in PyTorch (torch_drafts.TorchStreamingDraft) is
the JAX drafter's (drafters/streaming.py): the same greedy drafts and the
same logits on the same weights, ragged rows (one inside its window, one cut
by it), with committed deliberate bugs that must each fail."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.bench.backends import torch_drafts as ts
from specjax.bench.backends import torch_spec
from specjax.bench.backends.torch_llama import Cache, TorchLlama
from specjax.decode import plan
from specjax.decode import speculative
from specjax.drafters import streaming
from specjax.model import config
from specjax.model import kv_cache as kvc
from specjax.model import llama
from specjax.model import steps

PROMPTS = [[(7 * i + 3) % 256 for i in range(21)], [5, 17, 42, 9, 100]]  # 21 > S + W, 5 < S + W
FIRST = [11, 200]
WINDOW, SINKS, GAMMA, CAP = 6, 2, 4, 40


@pytest.fixture(scope="module")
def models(transformers, init_params):
  """(specjax Runner, TorchLlama eager) on one tiny target whose logits are
  peaked (random init is flat: near-ties would make greedy a coin toss)."""
  del transformers
  cfg = config.get_preset("tiny")
  params = dict(init_params(cfg, 1))  # test_torch_spec.py's: one init in the suite
  params["lm_head"] = {"kernel": params["lm_head"]["kernel"] * 40.0}
  return steps.Runner(cfg, params), TorchLlama(cfg, params, compile=False, threads=1)


@pytest.fixture(scope="module")
def reference(models):
  """The JAX drafter's greedy chain and its logits teacher-forced on it."""
  target = models[0]
  drafter = streaming.StreamingDrafter(window=WINDOW, sinks=SINKS)
  sc = plan.SpecConfig(target.cfg, None, GAMMA, drafter=drafter)
  _, tcache = target.prefill(PROMPTS, target.new_cache(len(PROMPTS), CAP))
  tail = jnp.asarray([[p[-1], f] for p, f in zip(PROMPTS, FIRST)], jnp.int32)
  n = tcache.lengths + 1
  dparams = drafter.draft_params(target.params, None)
  drafted, _, _ = drafter.propose(dparams, (), tcache, tail, n, jnp.ones(n.shape, bool),
                                  jax.random.PRNGKey(0), sc)
  fed = jnp.concatenate([tail[:, 1:], drafted.tokens[:, :-1]], 1)
  window = kvc.Window(start=tcache.lengths, sinks=SINKS, size=WINDOW, span=GAMMA)
  logits = llama.forward(target.params, fed, tcache, target.cfg, window=window)[0]
  return np.asarray(drafted.tokens), np.asarray(logits)


def torch_draft(tmodel):
  cache = tmodel.new_cache(len(PROMPTS), CAP)
  tmodel.prefill(PROMPTS, cache)
  start = cache.lengths.clone()
  draft = ts.TorchStreamingDraft(tmodel, WINDOW, SINKS)
  tokens, logits = draft.propose(tmodel.torch.tensor(FIRST), cache, GAMMA, logits=True)
  assert cache.lengths.tolist() == start.tolist()  # handed back as it was
  again = draft.propose(tmodel.torch.tensor(FIRST), cache, GAMMA)  # the timed (argmax) path
  return tokens.numpy(), logits.numpy(), again.numpy()


def test_the_torch_streaming_draft_is_the_jax_one(models, reference):
  target, tmodel = models
  want_tokens, want_logits = reference
  tokens, logits, again = torch_draft(tmodel)
  np.testing.assert_array_equal(tokens, want_tokens)
  np.testing.assert_array_equal(again, want_tokens)
  scale = np.max(np.abs(want_logits))
  assert np.max(np.abs(logits - want_logits)) / scale < 1e-5
  # the window cuts row 0: its draft differs from the full target's
  full = np.asarray(llama.forward(target.params, jnp.asarray(np.concatenate(
      [np.asarray(FIRST)[:, None], want_tokens[:, :-1]], 1), jnp.int32),
      target.prefill(PROMPTS, target.new_cache(2, CAP))[1], target.cfg)[0])
  assert np.max(np.abs(full[0] - want_logits[0])) / scale > 1e-3
  assert np.max(np.abs(full[1] - want_logits[1])) / scale < 1e-5  # inside its window


def test_the_random_cache_and_the_draft_probe(models):
  _, tmodel = models
  cache = tmodel.random_cache(2, CAP, 30, seed=1)
  assert cache.lengths.tolist() == [30, 30]
  assert float(cache.k[0][:, :, :30].abs().sum()) > 0 and float(cache.k[0][:, :, 30:].abs().sum()) == 0
  probe = ts.TorchDraftProbe(ts.TorchStreamingDraft(tmodel, WINDOW, SINKS), 2, CAP, 31, GAMMA, k=1)
  t = probe.times([1], 1)[1]
  assert t.median > 0 and probe.cache.lengths.tolist() == [30, 30]


def test_the_torch_loop_with_the_streaming_draft_equals_target_only(models):
  """TorchSpec's greedy loop with the streaming draft (the target's cache,
  no state of its own) keeps target-only's tokens, from its own prefill and
  from row caches prefilled once, stacked and cloned; its drafts are the
  JAX loop's (the same accepted counts at every row-step)."""
  target, tmodel = models
  engine = torch_spec.TorchSpec(tmodel, ts.TorchStreamingDraft(tmodel, WINDOW, SINKS))
  want = engine.generate_target(PROMPTS, 12, capacity=CAP).tokens
  got = engine.generate(PROMPTS, 12, GAMMA, capacity=CAP)
  assert got.tokens == want and got.stats.alpha > 0
  # the same drafts accepted at every row-step as specjax's loop with the JAX drafter
  # (greedy output is lossless whatever is drafted: this is what checks the drafts)
  jax_run = speculative.generate(target, None, PROMPTS, 12, GAMMA,
                                 drafter=f"streaming:{WINDOW},{SINKS}")
  assert jax_run.tokens == want
  for field in ("n_acc", "step", "row"):
    np.testing.assert_array_equal(getattr(got.records, field), getattr(jax_run.records, field))
  rows = [tmodel.new_cache(1, CAP) for _ in PROMPTS]
  first = tmodel.torch.cat([tmodel.prefill([p], c) for p, c in zip(PROMPTS, rows)])
  cache = Cache.stack(rows)
  assert cache.lengths.tolist() == [len(p) for p in PROMPTS]
  start = lambda *more: (cache.clone(), first) + more
  assert engine.generate_target(PROMPTS, 12, capacity=CAP, start=start()).tokens == want
  assert engine.generate(PROMPTS, 12, GAMMA, capacity=CAP, start=start(None)).tokens == want
  assert cache.lengths.tolist() == [len(p) for p in PROMPTS]  # the clones were written


def test_a_loop_that_drafts_from_the_wrong_token_fails(models, monkeypatch):
  """Committed bug: the loop's draft phase fed the token before the last
  (tail[:, 0]); the output stays target-only's, the accepted counts do not."""
  draft = ts.TorchStreamingDraft.draft
  monkeypatch.setattr(ts.TorchStreamingDraft, "draft",
                      lambda self, tail, *a: draft(self, tail[:, [1, 0]], *a))
  with pytest.raises(AssertionError):
    test_the_torch_loop_with_the_streaming_draft_equals_target_only(models)


BUGS = {
    "the window one slot short": lambda f: lambda s, n, w, span, cap: f(s, n, w - 1, span, cap),
    "the sinks dropped": lambda f: lambda s, n, w, span, cap: f(s, 0, w, span, cap),
    "a slot that is both sink and recent counted twice":
        lambda f: lambda *a: (f(*a)[0], f(*a)[1] | True),
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_each_deliberate_bug_fails(models, reference, monkeypatch, bug):
  monkeypatch.setattr(ts, "window_slots", BUGS[bug](ts.window_slots))
  with pytest.raises(AssertionError):
    test_the_torch_streaming_draft_is_the_jax_one(models, reference)
