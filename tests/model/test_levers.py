"""The GPU levers on the CPU (model/levers.py): each attention kind and the
scanned layers give the unrolled, blocked model's logits and tokens in
float32; the attention default is chosen per backend at model load (the
CPU's unchanged, a GPU's masked); XLA's command-buffer options compile to
the same tokens here and a misspelt option is one line. Each equality is
shown able to fail by a monkeypatched mutant."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.decode import generation
from specjax.errors import ConfigError
from specjax.formats import checkpoint
from specjax.model import config
from specjax.model import kv_cache as kvc
from specjax.model import layers
from specjax.model import levers
from specjax.model import llama as model
from specjax.model import steps
from specjax.model.sampling import SamplingParams

# A token tree of 5 nodes: root, two children, a grandchild under each.
TREE = np.array([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0],
                 [1, 0, 1, 0, 1]], bool)
VARIANTS = {"masked": dict(attention="masked"), "fused": dict(attention="fused"),
            "scan": dict(scan_layers=True), "scan+fused": dict(scan_layers=True, attention="fused")}


@pytest.fixture(scope="module")
def tiny():
  cfg = config.get_preset("tiny")  # attention 'auto', blocks of 8 slots: the blocked path
  return cfg, model.init_params(cfg, seed=3)


def _logits(cfg, params, shape):
  """Logits of a ragged prefill of 12 and 9 tokens, then one of: a chain of
  3, a tree verify (5 nodes), a tree's next level (the last 2 of the 5-node
  block, its first 3 already written)."""
  r = np.random.RandomState(0)
  cache = kvc.init_cache(cfg, 2, 40)
  toks = jnp.asarray(r.randint(0, cfg.vocab_size, (2, 12)), jnp.int32)
  first, cache = model.forward(params, toks, cache, cfg)
  cache = kvc.rollback(cache, jnp.array([12, 9], jnp.int32))
  if shape == "chain":
    out, _ = model.forward(params, toks[:, :3], cache, cfg)
  elif shape == "tree":
    out, _ = model.forward(params, toks[:, :5], cache, cfg, tree_mask=TREE)
  else:  # a draft tree's level: 3 written, then 2 more under the [2, 5] mask rows
    _, cache = model.forward(params, toks[:, :3], cache, cfg, tree_mask=TREE[:3, :3])
    out, _ = model.forward(params, toks[:, 3:5], cache, cfg, tree_mask=TREE[3:])
  return np.concatenate([np.asarray(first).ravel(), np.asarray(out).ravel()])


@pytest.mark.parametrize("shape", ["chain", "tree", "tree_level"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variants_give_the_same_logits(tiny, variant, shape):
  cfg, params = tiny
  want = _logits(cfg, params, shape)
  got = _logits(cfg.replace(**VARIANTS[variant]), params, shape)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_a_wrong_tree_mask_in_the_fused_kind_fails(tiny, monkeypatch):
  """Mutant: cache_mask ignores the tree (each node sees the whole block)."""
  cfg, params = tiny
  want = _logits(cfg, params, "tree")
  right = layers.cache_mask

  def whole_block(pos, s, tree=None):
    if tree is None:
      return right(pos, s)
    seen = jnp.arange(s)[None, :] < tree.lengths[:, None] + tree.mask.shape[-1]  # [B, S]
    return jnp.broadcast_to(seen[:, None], (pos.shape[0], pos.shape[1], s))

  monkeypatch.setattr(layers, "cache_mask", whole_block)
  got = _logits(cfg.replace(attention="fused"), params, "tree")
  assert np.abs(got - want).max() > 1e-3


def test_scanned_layers_in_the_wrong_order_fail(tiny, monkeypatch):
  """Mutant: the scan walks the layers backwards."""
  cfg, params = tiny
  want = _logits(cfg, params, "chain")
  scan = jax.lax.scan
  monkeypatch.setattr(jax.lax, "scan", lambda f, c, xs: scan(f, c, xs, reverse=True))
  got = _logits(cfg.replace(scan_layers=True), params, "chain")
  assert np.abs(got - want).max() > 1e-3


def _greedy(cfg, params, options=None):
  """16 greedy tokens on the device loop, compiled with `options`."""
  m = steps.Runner(cfg, params)
  cache = m.new_cache(1, 48)
  logits, cache = m.prefill([[5, 9, 2, 7, 7, 1]], cache)
  args = (params, logits, cache, jax.random.PRNGKey(0))
  kw = dict(cfg=cfg, sp=SamplingParams(), n_predict=16, eos_id=-1)
  compiled = generation.decode_loop.lower(*args, **kw).compile(compiler_options=options or {})
  return np.asarray(compiled(*args)[0]).tolist()


def test_every_lever_gives_the_same_tokens_on_the_cpu(tiny):
  """Each lever's config and compile options: the default's greedy tokens
  (the command buffers are GPU options, accepted and unused here)."""
  cfg, params = tiny
  want = _greedy(cfg, params)
  for name, lever in levers.LEVERS.items():
    got = _greedy(lever.model_config(cfg, "draft"), params, lever.compiler_options())
    assert got == want, name


def test_a_misspelt_xla_option_is_refused():
  cfg = config.get_preset("tiny")
  with pytest.raises(Exception, match="No such compile option"):
    _greedy(cfg, model.init_params(cfg), {"xla_gpu_enable_command_bufer": "FUSION"})


def test_lever_flags_and_names():
  lever = levers.parse("command_buffers")
  assert lever.xla_flags() == ("--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUDNN,"
                               "CUSTOM_CALL,CONDITIONAL,WHILE --xla_gpu_graph_min_graph_size=1")
  assert lever.missing_flags("") == lever.xla_flags().split()
  assert lever.missing_flags("--xla_foo=1 " + lever.xla_flags()) == []
  assert levers.parse("default").xla_flags() == ""
  cfg = config.get_preset("tiny")
  assert levers.parse("draft_scan").model_config(cfg, "target") == cfg
  assert levers.parse("draft_scan").model_config(cfg, "draft").scan_layers
  with pytest.raises(ConfigError, match="unknown lever 'cuda_graphs'; valid: default"):
    levers.parse("cuda_graphs")
  with pytest.raises(ConfigError, match="attention must be one of auto, blocked"):
    cfg.replace(attention="flash")


def test_build_md_gives_the_helpers_flags():
  """BUILD.md quotes the command-buffer flags the helper prints."""
  import os  # pylint: disable=import-outside-toplevel
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  with open(os.path.join(root, "BUILD.md")) as f:
    text = f.read()
  assert levers.parse("command_buffers").xla_flags() in text
  assert 'XLA_FLAGS="$(python -m specjax.model.levers command_buffers)"' in text


def test_a_lever_needs_its_flags_from_the_start(monkeypatch):
  monkeypatch.setattr(levers, "_ACTIVE", [levers.parse("default")])
  with pytest.raises(ConfigError, match="--lever=all needs XLA_FLAGS to hold --xla_gpu_enable"):
    levers.use("all", "--xla_gpu_graph_min_graph_size=1")
  assert levers.active().name == "default"
  levers.use("all", "--xla_foo=1 " + levers.parse("all").xla_flags())
  levers.use("fused", "")  # no flags to need
  assert levers.active().name == "fused"


def test_the_cpu_default_is_unchanged(monkeypatch):
  """Loaded on the CPU, a preset is its preset (attention 'auto'), and its
  forward runs the blocked loop."""
  cfg, params, _ = checkpoint.load_model("tiny")
  assert cfg == config.get_preset("tiny") and cfg.attention == "auto"
  calls = []
  blocked = layers.attend_blocked
  monkeypatch.setattr(layers, "attend_blocked", lambda *a, **k: calls.append(1) or blocked(*a, **k))
  model.forward(params, jnp.ones((1, 3), jnp.int32), kvc.init_cache(cfg, 1, 32), cfg)
  assert len(calls) == cfg.n_layers


def test_a_gpu_loads_masked_attention(monkeypatch):
  """The backend is asked at load: on a GPU 'auto' becomes 'masked' (and a
  lever's kind still wins); an explicit kind is kept on any backend."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert checkpoint.load_model("tiny")[0].attention == "masked"
  assert config.for_backend(config.get_preset("tiny").replace(attention="blocked"),
                            "gpu").attention == "blocked"
  monkeypatch.setattr(levers, "_ACTIVE", [levers.parse("fused")])
  assert checkpoint.load_model("tiny")[0].attention == "fused"


def test_a_lever_is_applied_by_role(monkeypatch):
  monkeypatch.setattr(levers, "_ACTIVE", [levers.parse("all")])
  target = checkpoint.load_model("tiny")[0]
  draft = checkpoint.load_model("tiny-draft", role="draft")[0]
  assert (target.attention, target.scan_layers) == ("fused", False)
  assert (draft.attention, draft.scan_layers) == ("fused", True)


def test_the_roofline_reads_the_capacity_unless_blocked():
  from specjax.bench.studies import roofline  # pylint: disable=import-outside-toplevel
  cfg = config.get_preset("llama-160m")
  assert roofline.attended_slots(cfg, 4096, 128) == 256
  assert roofline.attended_slots(cfg.replace(attention="blocked"), 4096, 128) == 256
  for kind in ("masked", "fused"):
    assert roofline.attended_slots(cfg.replace(attention=kind), 4096, 128) == 4096


def test_the_flags_helper_prints_one_line(capsys):
  assert levers.main(["levers", "command_buffers"]) == 0
  assert capsys.readouterr().out.startswith("--xla_gpu_enable_command_buffer=")
  assert levers.main(["levers", "graphs"]) == 1
  assert capsys.readouterr().err.strip() == (
      "error: unknown lever 'graphs'; valid: " + ", ".join(levers.LEVERS))


def test_a_head_takes_the_targets_attention_kind():
  """A draft config read from its own file (an EAGLE head: attention 'auto')
  runs the target's resolved kind: masked beside a GPU-loaded target, and
  unchanged on the CPU."""
  from specjax.decode import plan  # pylint: disable=import-outside-toplevel
  target, draft = config.get_preset("tiny"), config.get_preset("tiny-draft")
  assert plan.SpecConfig(target=target, draft=draft, gamma=2).draft == draft
  gpu = target.replace(attention="masked")
  assert plan.SpecConfig(target=gpu, draft=draft, gamma=2).draft.attention == "masked"
  fused = draft.replace(attention="fused")
  assert plan.SpecConfig(target=gpu, draft=fused, gamma=2).draft.attention == "fused"
