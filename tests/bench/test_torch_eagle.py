"""The EAGLE head in PyTorch (torch_eagle.TorchEagleHead) is the JAX
drafter's (drafters/eagle.py): from the same state (the head's cache and
pending pairs after the prompt, ragged rows), the same greedy chain as
EagleDrafter.propose and the same logits as the head teacher-forced on it;
its probe times a proposal and hands the cache back; committed deliberate
bugs each fail."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.bench.backends import torch_eagle as te
from specjax.bench.backends.torch_llama import TorchLlama, rms_norm
from specjax.decode import plan
from specjax.drafters import eagle
from specjax.model import config
from specjax.model import steps

PROMPTS = [[(7 * i + 3) % 256 for i in range(21)], [5, 17, 42, 9, 100]]
FIRST = [11, 200]
GAMMA, CAP = 4, 40


@pytest.fixture(scope="module")
def models(transformers, init_params, tmp_path_factory):
  """(specjax Runner, TorchLlama eager, the head's path) on the tiny target
  with peaked logits (test_torch_streaming.py's) and a random head."""
  del transformers
  cfg = config.get_preset("tiny")
  params = dict(init_params(cfg, 1))
  params["lm_head"] = {"kernel": params["lm_head"]["kernel"] * 40.0}
  hcfg = eagle.head_config(cfg)
  path = eagle.save_head(tmp_path_factory.mktemp("head") / "h", hcfg, eagle.init_head(hcfg, 3),
                         cfg, "tiny")
  return steps.Runner(cfg, params), TorchLlama(cfg, params, compile=False, threads=1), str(path)


@pytest.fixture(scope="module")
def reference(models):
  return chain_of(models[0], models[2])


def chain_of(target, path):
  """The state after the prompt, the JAX drafter's greedy chain from it, and
  the head's logits teacher-forced on that chain (eagle.refresh, head_forward)."""
  drafter = eagle.EagleDrafter(path=path)
  sc = plan.SpecConfig(target.cfg, None, GAMMA, drafter=drafter)
  dparams = drafter.draft_params(target.params, None)
  first = jnp.asarray(FIRST, jnp.int32)
  dstate = drafter.init(sc, target, dparams, PROMPTS, CAP, first)
  _, tcache = target.prefill(PROMPTS, target.new_cache(len(PROMPTS), CAP))
  tail = jnp.asarray([[p[-1], f] for p, f in zip(PROMPTS, FIRST)], jnp.int32)
  n = tcache.lengths + 1
  # as after a verify that kept three tokens: pending pairs from n - 4, the root third
  rng = np.random.RandomState(0)
  p = dstate.pending
  dstate = dstate.replace(pending=p.replace(
      feats=jnp.asarray(rng.randn(*p.feats.shape), p.feats.dtype),
      tokens=jnp.asarray(rng.randint(0, 256, p.tokens.shape), jnp.int32),
      prev=jnp.asarray(rng.randint(0, 256, p.prev.shape), jnp.int32), start=n - 4))
  drafted, _, _ = drafter.propose(dparams, dstate, tcache, tail, n, jnp.ones(n.shape, bool),
                                  jax.random.PRNGKey(0), sc)
  tokens = np.asarray(drafted.tokens)
  hparams, tparams = dparams["head"], dparams["target"]
  hcache, feat = eagle.refresh(tparams, hparams, dstate.hcache, dstate.pending, n, sc,
                               sc.refresh_pairs(len(PROMPTS)))
  logits, prev = [drafter.logits(dparams, feat, sc)], tail[:, 1:]
  for i in range(1, GAMMA):
    tok = jnp.asarray(tokens[:, i - 1:i])
    feat, hcache = eagle.head_forward(hparams, tparams, feat, tok, hcache, sc.draft, sc.target,
                                      prev_tokens=prev)
    logits.append(drafter.logits(dparams, feat, sc))
    prev = tok
  return dstate, n, tokens, np.asarray(jnp.concatenate(logits, 1)), dparams["head"]


def torch_draft(tmodel, dstate, n, hparams):
  """The torch head's chain from the JAX state (its cache and pending pairs)."""
  torch = tmodel.torch
  t = lambda a: torch.from_numpy(np.array(a)).long() if a.dtype == jnp.int32 else \
      torch.from_numpy(np.array(a, np.float32))
  head = te.TorchEagleHead(tmodel, hparams)
  cache = head.new_cache(len(PROMPTS), CAP)
  cache.k[0].copy_(t(dstate.hcache.k[0]))
  cache.v[0].copy_(t(dstate.hcache.v[0]))
  p = dstate.pending
  args = (t(p.feats), t(p.tokens), t(p.prev), t(p.start), t(n), cache, GAMMA)
  tokens, logits = head.propose(*args, logits=True)
  assert cache.lengths.tolist() == (np.asarray(n) - 1).tolist()  # handed back at n - 1
  again = head.propose(*args)  # the timed (argmax) path
  return tokens.numpy(), logits.numpy(), again.numpy()


def test_the_torch_head_is_the_jax_one(models, reference):
  _, tmodel, _ = models
  dstate, n, want_tokens, want_logits, hparams = reference
  tokens, logits, again = torch_draft(tmodel, dstate, n, hparams)
  np.testing.assert_array_equal(tokens, want_tokens)
  np.testing.assert_array_equal(again, want_tokens)
  assert np.max(np.abs(logits - want_logits)) / np.max(np.abs(want_logits)) < 1e-5
  assert len({tuple(r) for r in want_tokens[:, 1:]}) > 1  # the chain is not one token repeated


def test_a_head_that_reads_each_pairs_own_token(models, tmp_path):
  target, tmodel, _ = models
  hcfg = eagle.head_config(target.cfg)
  hp = eagle.init_head(hcfg, 4, prev_token=True)
  dstate, n, want, _, hparams = chain_of(
      target, str(eagle.save_head(tmp_path / "h", hcfg, hp, target.cfg, "tiny")))
  head = te.TorchEagleHead(tmodel, hparams)
  assert head.prev_token
  np.testing.assert_array_equal(torch_draft(tmodel, dstate, n, hparams)[0], want)


def test_the_head_probe_times_a_proposal(models, reference):
  _, tmodel, _ = models
  head = te.TorchEagleHead(tmodel, reference[-1])
  probe = te.TorchHeadProbe(head, 2, CAP, 31, GAMMA, GAMMA + 1, k=1)
  assert probe.times([1], 1)[1].median > 0 and probe.cache.lengths.tolist() == [30, 30]
  with pytest.raises(ValueError, match="T_draft"):
    probe.times([2])


BUGS = {  # name: (attribute of torch_eagle, mutant)
    "the root one pair late": ("root_index", lambda f: lambda n, s, w: f(n + 1, s, w)),
    "each pair written one slot late": (
        "layout", lambda f: lambda lengths, *a, **k: f(lengths + 1, *a, **k)),
    "the predicted feature normed again before the LM head": (
        "TorchEagleHead.logits", lambda f: lambda self, g: f(self, rms_norm(
            g, self.torch.ones(g.shape[-1]), self.cfg.norm_eps))),
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_each_deliberate_bug_fails(models, reference, monkeypatch, bug):
  name, make = BUGS[bug]
  owner = te.TorchEagleHead if "." in name else te
  attr = name.split(".")[-1]
  monkeypatch.setattr(owner, attr, make(getattr(owner, attr)))
  with pytest.raises(AssertionError):
    test_the_torch_head_is_the_jax_one(models, reference)
