"""How drafted tokens are judged: the real rules and the seed thread's simulations.

Every rule returns, per row, the number k of accepted drafts and the one
token the target emits after them (the correction at the first rejection,
or the bonus when every draft is accepted). `real` is greedy at T = 0 and
exact speculative sampling otherwise (a deterministic drafter's q is
onehot(x), never carried); `bernoulli:P`, `fraction:F`, `always`,
`mean_length:L` and `siblings:P1,..` are simulations whose per-position
probabilities are traced, so one compilation serves every rate. The rules
and their sources: docs/sweep.md (the acceptance rules).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax.model import sampling
from specjax.metrics import theory
from specjax.errors import ConfigError
from specjax.model.sampling import SamplingParams

KINDS = ("real", "bernoulli", "fraction", "always", "mean_length", "siblings")


@dataclasses.dataclass(frozen=True)
class AcceptRule:
  kind: str = "real"
  value: float = 0.0  # P, F or L (siblings: P1)
  probs: tuple[float, ...] = ()  # siblings: P1, P2, ... by rank

  def __str__(self) -> str:
    if self.kind == "siblings":
      return "siblings:" + ",".join(f"{x:g}" for x in self.probs)
    return self.kind if self.kind in ("real", "always") else f"{self.kind}:{self.value:g}"

  @property
  def simulated(self) -> bool:
    return self.kind != "real"

  def resolve(self, gamma: int) -> "AcceptRule":
    """mean_length:L -> bernoulli:P for this gamma (P from theory's inverse)."""
    if self.kind != "mean_length":
      return self
    if not 0.0 <= self.value <= gamma:
      raise ConfigError(f"mean_length:{self.value:g} must lie in [0, gamma={gamma}]")
    return AcceptRule("bernoulli", theory.alpha_from_mean_accepted(self.value, gamma))


def parse_rule(spec: str) -> AcceptRule:
  """Parses 'real', 'always', 'bernoulli:0.8', 'fraction:0.8', 'mean_length:3',
  'siblings:0.8,0.3,0.1'."""
  kind, _, arg = str(spec).strip().partition(":")
  if kind not in KINDS:
    raise ConfigError(f"unknown acceptance rule {spec!r}; valid: real, always, "
                      "bernoulli:P, fraction:F, mean_length:L, siblings:P1,P2,...")
  if kind == "siblings":
    return _parse_siblings(spec, arg)
  if kind in ("real", "always"):
    if arg:
      raise ConfigError(f"acceptance rule {kind!r} takes no value, got {spec!r}")
    return AcceptRule(kind)
  try:
    value = float(arg)
  except ValueError:
    raise ConfigError(f"acceptance rule {spec!r} needs a number after ':'") from None
  if kind in ("bernoulli", "fraction") and not 0.0 <= value <= 1.0:
    raise ConfigError(f"{kind}:{value:g} must lie in [0, 1]")
  if kind == "mean_length" and value < 0:
    raise ConfigError(f"mean_length:{value:g} must be >= 0")
  return AcceptRule(kind, value)


def _parse_siblings(spec: str, arg: str) -> AcceptRule:
  """'siblings:P1,P2,...': one probability in [0, 1] per sibling rank."""
  try:
    probs = tuple(float(x) for x in arg.split(","))
  except ValueError:
    raise ConfigError(f"acceptance rule {spec!r} needs comma-separated numbers after "
                      "':', e.g. siblings:0.8,0.3") from None
  bad = [x for x in probs if not 0.0 <= x <= 1.0]
  if bad:
    raise ConfigError(f"siblings:{arg}: every probability must lie in [0, 1], got {bad[0]:g}")
  return AcceptRule("siblings", probs[0], probs)


def _leading(accepted: jax.Array) -> jax.Array:
  """Length of the leading run of True along the last axis: [B, N] -> [B]."""
  return jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=-1), axis=-1)


def _at(x: jax.Array, idx: jax.Array) -> jax.Array:
  """x[b, idx[b]] for x [B, N, ...]."""
  return jnp.take_along_axis(x, idx[:, None, None], axis=1)[:, 0]


def position_probs(rule: AcceptRule, gamma: int) -> np.ndarray:
  """A simulated rule as per-position acceptance probabilities [gamma].

  Draft position i is accepted when u_i < probs[i], u_i ~ U[0, 1), until the
  first miss: bernoulli:P is P everywhere, always is 1 everywhere, fraction:F
  is 1 on the first ceil(F gamma) positions and 0 after; siblings:P1,... is
  P1 everywhere (a chain has one child per node). Passed to `judge` as
  a traced array, so one compilation serves every simulated rule.
  """
  rule = rule.resolve(gamma)
  if rule.kind in ("bernoulli", "siblings"):
    return np.full((gamma,), rule.value, np.float32)
  if rule.kind == "fraction":
    n_keep = int(theory.expected_accepted_fraction(gamma, rule.value))
    return (np.arange(gamma) < n_keep).astype(np.float32)
  return np.ones((gamma,), np.float32)  # always (and unused by real)


def exact_accepts(u: jax.Array, p_x: jax.Array, q_x: jax.Array) -> jax.Array:
  """Exact speculative sampling's test: accept x when u < p(x) / q(x), written
  u q(x) < p(x) so that nothing is divided (q(x) > 0 for a drafted x)."""
  return u * q_x < p_x


def target_token_dist(p_next: jax.Array, q_next: jax.Array, rejected: jax.Array) -> jax.Array:
  """The distribution of the token the target emits after the accepted run.

  At a rejection: norm(max(0, p - q)), the residual (if p == q there is no
  mass left, and a rejection has probability 0: p is returned). After every
  drafted token was accepted (the bonus token): p itself.
  p_next, q_next [B, V]; rejected [B].
  """
  resid = jnp.maximum(p_next - q_next, 0.0)
  mass = jnp.sum(resid, -1, keepdims=True)
  resid = jnp.where(mass > 0, resid / jnp.where(mass > 0, mass, 1.0), p_next)
  return jnp.where(rejected[:, None], resid, p_next)


def judge(key, simulated: bool, accept_probs, sp: SamplingParams, drafts, q, p, n_drafted,
          deterministic: bool = False):
  """Decides how many drafted tokens to keep and the token after them.

  Positions at or past a row's n_drafted are never accepted; when a row
  drafted fewer than gamma tokens and all were accepted (n_drafted = 0
  included), the target's token is drawn from p at the first undrafted
  position.

  Args:
    key: PRNG key for this step's acceptance.
    simulated: False for the real rule, True for the simulated ones.
    accept_probs: [gamma] position_probs() of a simulated rule (may be traced).
    sp: sampling settings applied to both models.
    drafts: [B, gamma] drafted tokens.
    q: [B, gamma, V] draft distributions (used by the real rule when sampling;
      ignored when `deterministic`).
    p: [B, gamma+1, V] target distributions at the gamma+1 verified positions.
    n_drafted: [B] tokens really drafted (< gamma after an early stop).
    deterministic: the drafts are a function of the context (q = onehot(x)).
  Returns:
    (n_accepted [B], next_token [B]).
  """
  b, gamma = drafts.shape
  k_u, k_tok = jax.random.split(key)
  pos = jnp.arange(gamma)[None, :]
  u = jax.random.uniform(k_u, (b, gamma))
  if simulated:
    ok = u < accept_probs[None, :]
  elif sp.greedy:
    ok = drafts == sampling.argmax(p[:, :gamma])
  else:
    p_x = jnp.take_along_axis(p[:, :gamma], drafts[..., None], -1)[..., 0]  # [B, gamma]
    q_x = (jnp.ones_like(p_x) if deterministic
           else jnp.take_along_axis(q, drafts[..., None], -1)[..., 0])
    ok = exact_accepts(u, p_x, q_x)
  n_acc = _leading(ok & (pos < n_drafted[:, None]))

  p_next = _at(p, n_acc)                  # target distribution after the accepted run
  if not simulated and not sp.greedy:
    # A rejection is a real draft at position n_acc that was not accepted.
    at_next = jnp.minimum(n_acc, gamma - 1)
    if deterministic:
      x_next = jnp.take_along_axis(drafts, at_next[:, None], 1)[:, 0]
      q_next = jax.nn.one_hot(x_next, p.shape[-1], dtype=p.dtype)
    else:
      q_next = _at(q, at_next)
    p_next = target_token_dist(p_next, q_next, n_acc < n_drafted)
  if sp.greedy:
    nxt = sampling.argmax(p_next)
  else:
    nxt = sampling.sample(k_tok, p_next)
  return n_acc, nxt


def expected_accepted(rule: AcceptRule, gamma: int) -> float | None:
  """Expected accepted tokens per step of a chain under a simulated rule (None
  for real)."""
  rule = rule.resolve(gamma)
  if rule.kind in ("bernoulli", "siblings"):
    return float(theory.expected_accepted(gamma, rule.value))
  if rule.kind == "fraction":
    return float(theory.expected_accepted_fraction(gamma, rule.value))
  if rule.kind == "always":
    return float(gamma)
  return None
