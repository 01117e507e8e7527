"""The chi-square machinery of the exactness tests, shared by the decode and
drafter tests: exact output and acceptance laws by enumeration over a tiny
vocabulary (V = 6) from the models' logits and an independent NumPy
implementation of the warpers, never from specjax.model.sampling; see
tests/decode/test_lossless.py for what each law sees."""


import __future__
import dataclasses
import functools
import inspect
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.model import config
from specjax.model import llama as model
from specjax.decode import speculative
from specjax.model import steps
from specjax.model.sampling import SamplingParams

scipy_stats = pytest.importorskip("scipy.stats")

V = 6
PROMPTS = [[1, 2], [3, 0, 5], [2, 4, 1, 0, 3]]  # a ragged batch of three rows
ROWS = 1500           # rows per prompt in the batch (tiled: 3 x ROWS rows)
ALPHA = 1e-4          # family-wise level of one configuration
TIE = 1e-6            # float32 rounding of a cumulative probability, generously
GAMMAS = (1, 2, 4)
SAMPLINGS = {
    "T1": SamplingParams(1.0),
    "T0.7": SamplingParams(0.7),
    "top_k3": SamplingParams(1.0, top_k=3),
    "top_p0.8": SamplingParams(1.0, top_p=0.8),
    "top_k4_top_p0.8": SamplingParams(0.7, top_k=4, top_p=0.8),
}


def sharpen(m: steps.Runner, factor: float) -> steps.Runner:
  params = dict(m.params)
  params["lm_head"] = {"kernel": m.params["lm_head"]["kernel"] * factor}
  return steps.Runner(m.cfg, params)


def perturbed(m: steps.Runner, scale: float, seed: int) -> steps.Runner:
  leaves, tree = jax.tree_util.tree_flatten(m.params)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  noisy = [x + scale * jnp.std(x) * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
  return steps.Runner(m.cfg, jax.tree_util.tree_unflatten(tree, noisy))


@pytest.fixture(scope="module")
def pair():
  cfg = config.ModelConfig(name="v6", vocab_size=V, dim=32, n_layers=1, n_heads=2,
                           n_kv_heads=1, ffn_dim=64, max_seq_len=32)
  target = sharpen(steps.Runner(cfg, model.init_params(cfg, 11)), 4.0)
  return target, perturbed(target, 0.6, 12)

# ---------------------------------------------------------------- reference


def warp(logits: np.ndarray, sp: SamplingParams, tie_shift: float = 0.0) -> np.ndarray:
  """HF's TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper, in
  that order, then softmax (float64). `tie_shift` moves the top-p boundary:
  with it, a test checks that tokens sitting within float32 rounding of the
  boundary (some of the 10^5 distributions have them) do not matter."""
  x = logits.astype(np.float64) / sp.temperature
  if sp.top_k:
    kth = np.sort(x, -1)[..., -sp.top_k][..., None]
    x = np.where(x < kth, -np.inf, x)
  if sp.top_p < 1.0:
    order = np.argsort(x, -1)  # ascending
    p_sorted = np.take_along_axis(softmax(x), order, -1)
    cum = np.cumsum(p_sorted, -1)
    drop_sorted = cum <= 1 - sp.top_p + tie_shift
    drop_sorted[..., -1] = False  # min_tokens_to_keep = 1
    drop = np.zeros_like(drop_sorted)
    np.put_along_axis(drop, order, drop_sorted, -1)
    x = np.where(drop, -np.inf, x)
  return softmax(x)


def softmax(x):
  e = np.exp(x - np.max(x, -1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


_LOGITS: dict = {}
N_MAX = max(GAMMAS) + 2  # the longest continuation any window needs


def next_token_logits(m: steps.Runner, prompt: list[int], n: int) -> list[np.ndarray]:
  """[L_0, ..., L_n]: L_j [V^j, V] the logits of the token after the prompt
  and each of the V^j continuations of length j (lexicographic order), level
  by level down the tree of continuations: the prompt's cache, then each
  level's rows repeated V times and fed one token each (memoised per model;
  a full forward over all V^N_MAX sequences did 8-10x the work)."""
  key = (id(m.params), tuple(prompt))
  if len(_LOGITS.get(key, ())) <= n:
    cap = max(16, len(prompt) + n - 1 + V)  # one shape for the prompts up to 5 tokens
    logits, cache = steps.forward_step(m.params, jnp.asarray([prompt], jnp.int32),
                                       m.new_cache(1, cap), cfg=m.cfg)
    levels = [np.asarray(logits[:, -1])]
    for j in range(n):
      if j == n - 1:
        levels.append(np.asarray(_leaves(m.params, cache, m.cfg)))
      else:
        logits, cache = _branch(m.params, cache, m.cfg)
        levels.append(np.asarray(logits))
    _LOGITS[key] = levels
  return _LOGITS[key][:n + 1]


@functools.partial(jax.jit, static_argnums=2)
def _branch(params, cache, cfg):
  """The next level of continuations: each row's cache repeated V times
  (row r -> rows r V .. r V + V - 1) and fed tokens 0 .. V - 1 in turn."""
  cache = jax.tree_util.tree_map(lambda x: jnp.repeat(x, V, 0), cache)
  toks = jnp.tile(jnp.arange(V, dtype=jnp.int32), cache.lengths.shape[0] // V)
  logits, cache = steps.forward_step(params, toks[:, None], cache, cfg=cfg)
  return logits[:, 0], cache


@functools.partial(jax.jit, static_argnums=2)
def _leaves(params, cache, cfg):
  """The last level's logits without its caches: tokens 0 .. V - 1 as V
  siblings after each row (a tree verify, each seeing the cache and itself)."""
  rows = cache.lengths.shape[0]
  toks = jnp.tile(jnp.arange(V, dtype=jnp.int32), (rows, 1))
  logits = steps.tree_verify(params, toks, jnp.eye(V, dtype=bool), cache, cfg)[0]
  return logits.reshape(rows * V, -1)


@dataclasses.dataclass
class Laws:
  pairs: list[np.ndarray]  # [W - 1] x [V, V]: P(t_i, t_{i+1})
  accept: np.ndarray       # [gamma + 1, 2]: P(k1 = j, 1[k2 > 0] = b)


def exact_laws(target, draft, prompt, sp: SamplingParams, gamma: int,
               tie_shift: float = 0.0) -> Laws:
  w = gamma + 3
  p = [warp(x, sp, tie_shift) for x in next_token_logits(target, prompt, w - 1)]
  q = [warp(x, sp, tie_shift) for x in next_token_logits(draft, prompt, w - 1)]
  joint = p[0][0]  # P(t_0 .. t_j) over V^(j+1) prefixes
  pairs = []
  for j in range(1, w):
    nxt = (joint[:, None] * p[j]).reshape(-1)
    pairs.append(nxt.reshape(V ** (j - 1), V, V).sum(0))
    joint = nxt
  return Laws(pairs, acceptance_law(p, q, q, gamma))


def acceptance_law(p: list[np.ndarray], q_draft: list, q_next: list, gamma: int,
                   by_first: bool = False) -> np.ndarray:
  """The law of (k1, 1[k2 > 0]) [gamma + 1, 2] from the target's p and the
  drafter's proposal laws, all indexed like next_token_logits (entry j:
  [V^j, V], one row per continuation t_0 .. t_{j-1} of the prompt):
    q_draft[j]  the law of d_j, the first step's j-th draft, after t_0 d_1 ..
                d_{j-1} (j = 1..gamma);
    q_next[j]   the law of the second step's first draft after a first step
                that left the continuation t_0 .. t_{j-1} (j = 2..gamma + 2).
  A draft model has one q for both; a drafter that drafts from other
  context (EAGLE's predicted features within a step, n-gram lookup's
  history as of the step's start) has two. A row of zeros means nothing is
  drafted there: the engine then accepts nothing and draws its token from p,
  as max(0, p - 0) does; a onehot row is a deterministic draft.

  `by_first`: the joint law with the first token t_0 [V, gamma + 1, 2], whose
  cells see a drafter that drafts well after some t_0 and badly after
  others where the marginal may average the difference away."""
  mass = p[0][0]  # prefixes t_0 whose drafts so far were all accepted
  accept = np.zeros((V, gamma + 1, 2))
  for j in range(gamma + 1):
    length = j + 1
    resid = np.maximum(p[length] - q_draft[length], 0.0) if j < gamma else p[length]
    s1 = (mass[:, None] * resid).reshape(-1)          # the step's last token y
    beta = np.minimum(p[length + 1], q_next[length + 1]).sum(-1)  # P(k2 > 0 | s1)
    accept[:, j] = np.stack([(s1 * (1 - beta)).reshape(V, -1).sum(1),
                             (s1 * beta).reshape(V, -1).sum(1)], 1)  # t_0 leads the index
    if j < gamma:
      mass = (mass[:, None] * np.minimum(p[length], q_draft[length])).reshape(-1)
  np.testing.assert_allclose(accept.sum(), 1.0, atol=1e-9)
  return accept if by_first else accept.sum(0)

# ---------------------------------------------------------------- the test


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
  """Pearson's chi-square of counts against probs; cells expecting < 5 are
  pooled. A count where the law puts no mass at all gives p = 0."""
  counts, probs = counts.ravel().astype(float), probs.ravel() / probs.sum()
  n = counts.sum()
  if np.any(counts[probs <= 1e-12] > 0):
    return 0.0
  exp = probs * n
  keep = exp >= 5
  obs, ex = list(counts[keep]), list(exp[keep])
  if exp[~keep].sum() >= 5:
    obs.append(counts[~keep].sum())
    ex.append(exp[~keep].sum())
  elif ex:  # a small remainder joins the smallest cell
    i = int(np.argmin(ex))
    obs[i] += counts[~keep].sum()
    ex[i] += exp[~keep].sum()
  if len(ex) < 2:
    return 1.0
  return float(scipy_stats.chisquare(obs, ex).pvalue)


def sample(target, draft, sp, gamma, rows, loop="device", batch=True, seed=0, drafter="model"):
  """Windows [R, W] and (k1, k2) [R, 2] of speculative generation from every
  prompt, rows of each prompt in one ragged batch (or one call per row)."""
  w = gamma + 3
  kw = dict(sp=sp, loop=loop, drafter=drafter)
  if batch:
    prompts = [p for p in PROMPTS for _ in range(rows)]
    res = [speculative.generate(target, draft, prompts, w, gamma, seed=seed, **kw)]
  else:
    prompts = [p for p in PROMPTS for _ in range(rows)]
    res = [speculative.generate(target, draft, [p], w, gamma, seed=seed + i, **kw)
           for i, p in enumerate(prompts)]
  tokens = np.array([t for r in res for t in r.tokens])
  # Every row is live in the first two steps (the window is longer).
  ks = np.concatenate([np.stack([r.records.at_step(0), r.records.at_step(1)], 1) for r in res])
  assert len(ks) == len(tokens)
  return tokens, ks, np.array([PROMPTS.index(p) for p in prompts])


def pvalues(target, draft, sp, gamma, rows, accept_law=None, **kw) -> dict[str, float]:
  """Every p-value of one configuration (per prompt: each pair, acceptance).

  `draft` is the model whose q the acceptance law uses (and the draft of the
  `model` drafter); `accept_law(prompt, sp, gamma)` replaces that law (a
  drafter without a draft model, or one that drafts from more than the
  tokens: tests/drafters/); a law [V, gamma + 1, 2] is tested jointly with
  t_0."""
  tokens, ks, which = sample(target, draft, sp, gamma, rows, **kw)
  out = {}
  for i, prompt in enumerate(PROMPTS):
    laws = exact_laws(target, draft, prompt, sp, gamma)
    if sp.top_p < 1:  # near-ties at the top-p boundary move no tested cell visibly
      for shift in (-TIE, TIE):
        other = exact_laws(target, draft, prompt, sp, gamma, shift)
        for a, b in zip(laws.pairs + [laws.accept], other.pairs + [other.accept]):
          assert np.max(np.abs(a - b)) < 1e-3, "the reference law depends on rounding"
    if accept_law is not None:
      laws.accept = accept_law(prompt, sp, gamma)
    t, k = tokens[which == i], ks[which == i]
    for j, law in enumerate(laws.pairs):
      counts = np.bincount(t[:, j] * V + t[:, j + 1], minlength=V * V)
      out[f"prompt {i} pair t{j},t{j + 1}"] = chi2_pvalue(counts, law)
    cell = k[:, 0] * 2 + (k[:, 1] > 0)
    if laws.accept.ndim == 3:  # the joint law with t_0 (acceptance_law's by_first)
      cell = cell + t[:, 0] * 2 * (gamma + 1)
    counts = np.bincount(cell, minlength=laws.accept.size)
    out[f"prompt {i} acceptance"] = chi2_pvalue(counts, laws.accept)
  return out


def output_pvalues(target, draft, sp, w, rows=ROWS, gamma=1, **kw) -> dict[str, float]:
  """Pair laws of the first w - 1 token pairs of speculative generation (rows
  per prompt, one ragged batch; kw: generate's tree, siblings, drafter, seed)
  against the target's own: the output test of a drafter or tree whose
  acceptance law is not enumerated here."""
  prompts = [p for p in PROMPTS for _ in range(rows)]
  res = speculative.generate(target, draft, prompts, w, gamma, sp=sp, **kw)
  tokens, which = np.array(res.tokens), np.repeat(np.arange(len(PROMPTS)), rows)
  out = {}
  for i, prompt in enumerate(PROMPTS):
    laws = exact_laws(target, target, prompt, sp, w - 3)
    t = tokens[which == i]
    for j, law in enumerate(laws.pairs):
      counts = np.bincount(t[:, j] * V + t[:, j + 1], minlength=V * V)
      out[f"prompt {i} pair t{j},t{j + 1}"] = chi2_pvalue(counts, law)
  return out


def adjusted(ps: dict[str, float]) -> float:
  """The Bonferroni-adjusted p-value of a family of tests."""
  return min(1.0, min(ps.values()) * len(ps))


def exactness(pair_, sp, gamma, **kw) -> tuple[float, dict[str, float]]:
  """(smallest p-value times the number of tests, all p-values) over both
  pairs: the Bonferroni-adjusted p-value of the configuration."""
  target, draft = pair_
  ps = {f"noisy draft, {k}": v for k, v in pvalues(target, draft, sp, gamma, ROWS, **kw).items()}
  ps.update({f"self draft, {k}": v
             for k, v in pvalues(target, target, sp, gamma, ROWS, **kw).items()})
  return min(1.0, min(ps.values()) * len(ps)), ps




def full_forward_kv(m: steps.Runner, seq: list[int]):
  cache = m.new_cache(1, len(seq))
  return model.forward(m.params, jnp.asarray([seq]), cache, m.cfg)[1]


def mutant(fn, old: str, new: str):
  """`fn` with the source text `old` replaced by `new`: a deliberate bug at
  one expression, compiled in fn's own module (its globals), for a mutation
  check to monkeypatch in. `old` must occur exactly once, so that an edit of
  the engine that moves it fails the check loudly instead of testing nothing."""
  src = textwrap.dedent(inspect.getsource(fn))
  assert src.count(old) == 1, f"{fn.__qualname__}: {old!r} occurs {src.count(old)} times"
  code = compile(src.replace(old, new), inspect.getsourcefile(fn), "exec",
                 flags=__future__.annotations.compiler_flag, dont_inherit=True)
  scope: dict = {}
  exec(code, fn.__globals__, scope)  # pylint: disable=exec-used
  return scope[fn.__name__]


def row_pair_pvalues(target, res_tokens, prompts, rows: int) -> dict[str, float]:
  """p-values of each prompt's first token pairs (t0,t1 and t1,t2) against
  the target's law at T = 1, for a run of `rows` rows per prompt in order
  (the per-row lengths' tests: tests/decode/test_rows.py, test_rows_depth.py)."""
  tokens, which = np.array(res_tokens), np.repeat(np.arange(len(prompts)), rows)
  out = {}
  for i, prompt in enumerate(prompts):
    t = tokens[which == i]
    for j, law in enumerate(exact_laws(target, target, prompt, SamplingParams(1.0), 2).pairs):
      out[f"prompt {i} pair t{j},t{j + 1}"] = chi2_pvalue(
          np.bincount(t[:, j] * V + t[:, j + 1], minlength=V * V), law)
  return out
