"""Training the EAGLE-3 head with training-time test (specjax/train/eagle3.py,
eagle3_stage.py): step j's logits at pair t are the logits the drafter
computes on a chain rooted at pair t - j + 1 with the true tokens forced
(head_forward3 on a head KV cache), for every root and step; the loss
counts the set's labels only, over the pairs whose root exists; a tiny run
overfits, a resumed run equals an uninterrupted one; the stored layers are
the target's, recorded and refused for other layers. MUTATIONS are
deliberate bugs, each failing a check."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import train as train_configs
from specjax.drafters import eagle3 as head3
from specjax.errors import ConfigError
from specjax.model import kv_cache as kvc
from specjax.model import llama as model
from specjax.model import steps
from specjax.model.config import ModelConfig
from specjax.train import eagle3 as ttt
from specjax.train import eagle3_stage as stage
from specjax.train import loop as train_lib
from specjax.train import replies

TINY = ModelConfig("t", 97, 32, 4, 4, 2, 64, max_seq_len=256, tie_embeddings=True, attn_block=8)
B, T, K = 2, 12, 4
SET = np.arange(0, 97, 2)  # every other id: labels outside the set exist


@pytest.fixture(scope="module")
def head(init_params):
  """A tiny target, a window's tokens and layers' outputs, a random head."""
  params = dict(init_params(TINY, 3))
  params["embed"] = {"embedding": params["embed"]["embedding"] * 30.0}  # peaked laws
  toks = jnp.asarray(np.random.default_rng(0).integers(0, TINY.vocab_size, (B, T + 1)),
                     jnp.int32)
  layers = head3.default_layers(TINY.n_layers)
  _, _, feats = model.forward(params, toks, kvc.init_cache(TINY, B, T + 1), TINY,
                              return_hidden=True, hidden_layers=layers)
  hcfg = head3.head_config(TINY)
  return params, toks, feats, hcfg, head3.init_head3(hcfg, len(SET), 1), layers


@jax.jit
def drafted_chains(hparams, tparams, feats, toks):
  """The drafter's logits along the chain rooted at each pair r, the true
  tokens forced, one batch row per (row, root): the true pairs 0..r in the
  head's cache with fused target features (all T fed, rolled back to r + 1,
  as the drafter's refresh does), then pairs (h, x_{t+1}) fed one at a time,
  each reading the previous output. Returns [K] x [B, T (root), V_d]."""
  hcfg = head3.head_config(TINY)
  rows = jnp.repeat(toks, T, 0)  # row b * T + r: row b's window, root r
  roots = jnp.tile(jnp.arange(T), B)
  cache = head3.new_cache(hcfg, B * T, T + K)
  fused = head3.fuse(hparams, jnp.repeat(feats[:, :T], T, 0))
  hs, cache = head3.head_forward3(hparams, tparams, fused, rows[:, 1:], cache, hcfg, TINY)
  cache = kvc.rollback(cache, roots + 1)
  h = jnp.take_along_axis(hs, roots[:, None, None], 1)  # [B*T, 1, E]: the root's output
  out = [head3.head_logits3(hparams, h[:, 0])]
  for i in range(1, K):  # pair r + i reads h and x_{r+i+1}
    tok = jnp.take_along_axis(rows, jnp.minimum(roots + i + 1, T)[:, None], 1)
    h, cache = head3.head_forward3(hparams, tparams, h, tok, cache, hcfg, TINY)
    out.append(head3.head_logits3(hparams, h[:, 0]))
  return [o.reshape(B, T, -1) for o in out]


def gap_to_drafting(head) -> float:
  """The largest difference between TTT step j at pair t and the chain from root t - j + 1."""
  tparams, toks, feats, hcfg, hparams, _ = head
  hs = jax.jit(lambda p: ttt.ttt_hidden(p, tparams, feats[:, :-1], toks[:, 1:], hcfg, TINY, K)
               )(hparams)
  chains = drafted_chains(hparams, tparams, feats, toks)
  worst = 0.0
  for j in range(1, K + 1):  # pair t = r + j - 1 < T
    got = head3.head_logits3(hparams, hs[j - 1][:, j - 1:])
    diff = jnp.abs(got - chains[j - 1][:, :T - j + 1])
    worst = max(worst, float(jnp.where(jnp.isnan(diff), jnp.inf, diff).max()))  # NaN: apart
  return worst


def test_ttt_steps_are_the_drafted_chains(head):
  assert gap_to_drafting(head) < 1e-4


MUTATIONS = {
    # step j's feature from the same pair, h^{j-1}_t, not the previous pair's
    "same pair's feature": ("step_features", lambda orig: lambda h: h),
    # step j attends to the true prefix only: its own chain's keys dropped
    "no diagonal": ("diagonal", lambda orig: lambda kvs, j: []),
    # the true prefix one pair too long, or too short
    "prefix s <= t-j+2": ("prefix_mask", lambda orig: lambda n, j: orig(n, j - 1)),
    "prefix s <= t-j": ("prefix_mask", lambda orig: lambda n, j: orig(n, j + 1)),
}


@pytest.mark.parametrize("name", MUTATIONS)
def test_each_mutation_parts_from_drafting(head, monkeypatch, name):
  attr, make = MUTATIONS[name]
  monkeypatch.setattr(ttt, attr, make(getattr(ttt, attr)))
  assert gap_to_drafting(head) > 1e-2


def test_the_loss_counts_the_sets_labels_over_rooted_pairs(head):
  """set_ce against a NumPy reference (labels outside the set ignored, not
  renormalised); ttt_loss's step j averages pairs t >= j - 1 only, and its
  accuracy maps the set's argmax back to target ids."""
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(3, len(SET))).astype(np.float32)
  top_i = np.asarray([[0, 1, 2], [3, 4, 96], [5, 7, 9]], np.int32)  # 1, 3, 5, 7, 9: outside
  top_p = np.asarray([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1], [0.7, 0.2, 0.1]], np.float32)
  logq = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  col = {int(v): i for i, v in enumerate(SET)}
  want = [-sum(p * logq[r, col[i]] for i, p in zip(top_i[r], top_p[r]) if i in col)
          for r in range(3)]
  got = ttt.set_ce(jnp.asarray(logits), jnp.asarray(ttt.set_index(SET, 97)),
                   jnp.asarray(top_i), jnp.asarray(top_p))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5)
  assert float(got[2]) == 0.0  # no label in the set: nothing counted
  tparams, toks, feats, hcfg, hparams, _ = head
  w = {"tokens": toks, "layers": feats, "top_i": jnp.broadcast_to(toks[..., None], (B, T + 1, 2)),
       "top_p": jnp.full((B, T + 1, 2), 0.5)}
  vocab = {"ids": jnp.asarray(SET), "index": jnp.asarray(ttt.set_index(SET, 97))}
  _, m = jax.jit(lambda p: ttt.ttt_loss(p, hcfg, tparams, TINY, w, vocab, K, 0.8))(hparams)
  hs = jax.jit(lambda p: ttt.ttt_hidden(p, tparams, feats[:, :-1], toks[:, 1:], hcfg, TINY, K)
               )(hparams)
  for j in (1, 3):
    lg = head3.head_logits3(hparams, hs[j - 1])[:, j - 1:]
    lab = toks[:, j:]  # pair t's label: top_i at position t + 1
    ce = -jnp.take_along_axis(jax.nn.log_softmax(lg, -1), jnp.maximum(
        jnp.asarray(ttt.set_index(SET, 97))[lab], 0)[..., None], -1)[..., 0]
    ce = jnp.where(lab % 2 == 0, ce, 0.0)  # odd ids are outside the set
    np.testing.assert_allclose(float(m[f"ce_{j}"]), float(ce.mean()), rtol=1e-5)
    acc = jnp.mean(jnp.asarray(SET)[jnp.argmax(lg, -1)] == lab)
    np.testing.assert_allclose(float(m[f"acc_{j}"]), float(acc), rtol=1e-6)


@pytest.fixture(scope="module")
def data(head, tmp_path_factory):
  """Stored data of a few sequences of the tiny target: tokens, top-K
  labels (replies.features) and the layers' outputs (stage.layer_features)."""
  tparams = head[0]
  target = steps.Runner(TINY, tparams)
  rng = np.random.default_rng(2)
  seqs = [list(rng.integers(0, TINY.vocab_size, n)) for n in (70, 50, 90, 40)]
  d = replies.features(target, seqs, 8, 2, log=lambda s: None)
  path = tmp_path_factory.mktemp("layers") / stage.LAYERS_FILE
  stage.layer_features(target, d["tokens"], d["starts"], head[5], 3, path, log=lambda s: None)
  d["layers"] = np.load(path)
  return target, d


def test_stored_layers_are_the_targets_outputs(head, data):
  target, d = data
  s, e = stage.spans(d["starts"], len(d["tokens"]))[2]
  fwd = jax.jit(lambda p, x: model.forward(p, x, kvc.init_cache(TINY, 1, e - s), TINY,
                                           return_hidden=True, hidden_layers=head[5])[2])
  want = fwd(target.params, jnp.asarray(d["tokens"][None, s:e]))
  np.testing.assert_allclose(d["layers"][s:e].astype(np.float32), np.asarray(want[0]),
                             rtol=2e-3, atol=2e-3)


def test_outputs_beyond_float16_are_refused_not_stored_as_inf(head, tmp_path):
  loud = dict(head[0], embed={"embedding": head[0]["embed"]["embedding"] * 1e6})
  path = tmp_path / stage.LAYERS_FILE
  with pytest.raises(ConfigError, match="beyond float16's range"):
    stage.layer_features(steps.Runner(TINY, loud), np.arange(20, dtype=np.int32), [0], head[5],
                         1, path, log=lambda s: None)
  assert not path.exists()


def _tc(steps_=6, **kw):
  tc = train_configs.get_config("smollm2_tiny").head3_train
  tc.steps, tc.seq_len, tc.batch, tc.lr, tc.warmup = steps_, 16, 2, 1e-2, 1
  tc.eval_every, tc.ckpt_every, tc.log_every, tc.ttt_steps = steps_, 3, 1, 3
  for key, v in kw.items():
    tc[key] = v
  return tc


def test_a_tiny_run_overfits_and_resumes_exactly(head, data, tmp_path):
  """Loss falls over 6 steps on the same few sequences; 3 steps, stopped,
  resumed to 6, equal 6 steps uninterrupted (params and metrics)."""
  target, d = data
  hcfg = head[3]
  init = lambda: stage.init_params(hcfg, target.params, SET, 3)
  run = lambda work, stop=None: ttt.train(hcfg, init(), TINY, target.params, d, SET, 200,
                                          _tc(), work, stop_at=stop, progress=False,
                                          log=lambda s: None)
  full = run(tmp_path / "full")
  losses = [r["loss"] for r in train_lib.read_metrics(tmp_path / "full") if "loss" in r]
  assert losses[-1] < 0.8 * losses[0], losses
  recs = train_lib.read_metrics(tmp_path / "full")
  assert {f"acc_{j}" for j in range(1, 4)} <= set(recs[0]) and "eval_acc_3" in recs[-1]
  run(tmp_path / "cut", stop=3)
  again = run(tmp_path / "cut")
  for a, b in zip(jax.tree_util.tree_leaves(full), jax.tree_util.tree_leaves(again)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  strip = lambda rs: [{k: v for k, v in r.items() if k not in ("tok_s", "compile_s")} for r in rs]
  assert strip(train_lib.read_metrics(tmp_path / "cut")) == strip(recs)
  with pytest.raises(ConfigError, match="different config"):  # other TTT settings: refused
    ttt.train(hcfg, init(), TINY, target.params, d, SET, 200, _tc(ttt_steps=2),
              tmp_path / "full", progress=False, log=lambda s: None)
  with pytest.raises(ConfigError, match="ttt_steps"):
    ttt.check_settings(_tc(ttt_steps=0))
  with pytest.raises(ConfigError, match="ttt_decay"):
    ttt.check_settings(_tc(ttt_decay=0.0))


@pytest.fixture(scope="module")
def tiny_stage(tmp_path_factory):
  """selfdistill.run(stages=("head3",)) with configs/train.py:smollm2_tiny on
  a tiny random 4-layer target with SmolLM2's tokenizer and chat template."""
  from specjax.formats import checkpoint  # pylint: disable=import-outside-toplevel
  from specjax.formats import gguf as gguf_file  # pylint: disable=import-outside-toplevel
  from specjax.formats import gguf_tokenizer  # pylint: disable=import-outside-toplevel
  from specjax.train import selfdistill as sd  # pylint: disable=import-outside-toplevel
  try:
    path = checkpoint.packaged_path("smollm2-135m")  # its tokenizer alone, not the weights
    tok = gguf_tokenizer.gguf_tokenizer(gguf_file.open_reader(path), str(path))
  except Exception as e:  # pylint: disable=broad-except
    pytest.skip(f"smollm2-135m: {e}")
  cfg = ModelConfig("tiny-smol", tok.vocab_size, 32, 4, 4, 2, 64, max_seq_len=512,
                    tie_embeddings=True, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)
  params = model.init_params(cfg, 0)
  real = checkpoint.load_model
  mp = pytest.MonkeyPatch()
  mp.setattr(sd.checkpoint, "load_model", lambda spec, dtype=None, seed=0, role="target": (
      (cfg, params, tok) if spec == "smollm2-135m" else real(spec, dtype, seed, role)))
  work, out = tmp_path_factory.mktemp("sd3"), tmp_path_factory.mktemp("assets3")
  lines = []
  c = train_configs.get_config("smollm2_tiny")
  s = sd.run(c, work, out, progress=False, log=lines.append, stages=("head3",))
  yield sd, c, work, out, s, lines, steps.Runner(cfg, params), tok
  mp.undo()


def test_the_stage_trains_measures_and_exports_the_head(tiny_stage):
  from specjax.decode import generation, speculative  # pylint: disable=import-outside-toplevel
  from specjax.drafters import vocab  # pylint: disable=import-outside-toplevel
  sd, c, work, out, s, lines, target, tok = tiny_stage
  h3 = s["head3"]
  assert h3["layers"] == list(head3.default_layers(4)) == [2, 2, 1]
  assert [r["step"] for r in train_lib.read_metrics(work / stage.RUN_DIR) if "loss" in r] == [1, 2]
  assert {f"eval_acc_{j}" for j in range(1, 4)} <= set(h3["heldout"])
  assert (work / stage.PLOT_FILE).is_file() and set(h3["alpha"]["0"]) >= {"alpha"}
  loaded = head3.load_head3(out / str(c.head3_name))
  assert loaded.meta["dtype"] == "bfloat16" and loaded.layers == (2, 2, 1)
  # the set: the specials and the most frequent ids of the stored (training) replies
  seqs = [r for f in sorted((work / "gen").glob("*.json")) for r in json.loads(f.read_text())]
  assert seqs and len(loaded.ids) == c.head3_vocab
  want = vocab.top_ids(vocab.count_tokens(seqs, tok.vocab_size), c.head3_vocab,
                       tok.special_ids())
  assert loaded.ids.tolist() == want.tolist() and set(tok.special_ids()) <= set(want.tolist())
  # the exported head drafts: greedy output equals target-only
  prompts = [tok.encode_chat([{"role": "user", "content": "Hello there."}]), [5, 6, 7]]
  got = speculative.generate(target, None, prompts, 10, 3,
                             drafter=f"eagle3:{out / 'smollm2-eagle3'}")
  assert got.tokens == generation.generate(target, prompts, 10).tokens


def test_the_stage_resumes_and_refuses_other_layers(tiny_stage):
  sd, c, work, out, s, lines, _, tok = tiny_stage
  assert any(l.startswith("layer features") for l in lines)
  again = []
  s2 = sd.run(c, work, None, progress=False, log=again.append, stages=("head3",))
  assert not any(l.startswith(("layer features", "replies", "head3: acceptance")) for l in again)
  assert s2["head3"]["alpha"] == s["head3"]["alpha"]
  other = train_configs.get_config("smollm2_tiny")
  other.head3_layers = (0, 1, 3)
  with pytest.raises(ConfigError, match=r"layers.npy was made with other settings \(layers"):
    sd.run(other, work, None, progress=False, log=again.append, stages=("head3",))
  other.head3_layers = (0, 1)
  with pytest.raises(ConfigError, match="head3_layers"):
    sd.run(other, work, None, progress=False, log=again.append, stages=("head3",))
  # replies of held-out prompts (draft_vocab.py's 'heldout' batches) are never counted
  ids = stage.reply_set(tok, work, c.head3_vocab, tok.vocab_size)[0]
  (work / "gen" / "heldout-0000.json").write_text(json.dumps([[40000 + i] * 9 for i in range(300)]))
  assert stage.reply_set(tok, work, c.head3_vocab, tok.vocab_size)[0].tolist() == ids.tolist()


def test_an_export_dir_that_is_a_file_is_refused_before_any_work(tmp_path):
  from specjax.errors import OutputError  # pylint: disable=import-outside-toplevel
  from specjax.train import selfdistill as sd  # pylint: disable=import-outside-toplevel
  file = tmp_path / "assets"
  file.write_text("not a folder")
  c = train_configs.get_config("smollm2_tiny")
  c.target = "no-such-model"  # loading it would fail: the check comes first
  with pytest.raises(OutputError, match="--export_dir .* is a file"):
    sd.run(c, tmp_path / "work", file, progress=False, stages=("head3",))
  assert file.read_text() == "not a folder" and not (tmp_path / "work").exists()


def test_a_head_on_the_targets_lm_head_trains_without_storing_it(head, data, tmp_path):
  """lm_head 'target': the loss falls with the table frozen at the target's
  rows, and what the run returns (and the stage saves) has no table."""
  target, d = data
  hcfg = head[3]
  init = stage.init_params(hcfg, target.params, SET, 3, head3.LM_HEAD_TARGET)
  assert "lm_head" not in init
  out = ttt.train(hcfg, init, TINY, target.params, d, SET, 200, _tc(), tmp_path, progress=False,
                  log=lambda s: None)
  losses = [r["loss"] for r in train_lib.read_metrics(tmp_path) if "loss" in r]
  assert "lm_head" not in out and losses[-1] < 0.8 * losses[0], losses


def test_a_warm_start_from_an_eagle1_head_ranks_as_that_head(head, tmp_path):
  """head3_init: fc and layer from an EAGLE-1 head, fuse = the target's
  final norm on the third layer; with the last layer third, step 1's top
  token over the set is the EAGLE-1 head's (the target's LM head on its
  predicted feature, over the same set)."""
  from specjax.drafters import eagle  # pylint: disable=import-outside-toplevel
  from specjax.drafters import vocab  # pylint: disable=import-outside-toplevel
  tparams, toks = head[0], head[1]
  hcfg = head[3]
  ecfg = eagle.head_config(TINY)
  ep = jax.tree_util.tree_map(lambda x: 3 * x if x.ndim == 2 else x, eagle.init_head(ecfg, 4))
  eagle.save_head(tmp_path / "e1", ecfg, ep, TINY, "t")
  layers = (0, 1, TINY.n_layers - 1)
  _, _, feats = model.forward(tparams, toks, kvc.init_cache(TINY, B, T + 1), TINY,
                              return_hidden=True, hidden_layers=layers)
  _, _, final = model.forward(tparams, toks, kvc.init_cache(TINY, B, T + 1), TINY,
                              return_hidden=True)
  g, _ = eagle.head_forward(ep, tparams, final[:, :-1], toks[:, 1:],
                            eagle.new_cache(ecfg, B, T + 1), ecfg, TINY)
  want = SET[jnp.argmax(vocab.logits(vocab.head_table(tparams, SET), g), -1)]
  for lm_head in (head3.LM_HEAD_OWN, head3.LM_HEAD_TARGET):
    hp = head3.with_lm_head(stage.init_params(hcfg, tparams, SET, 3, lm_head, str(tmp_path / "e1")),
                            tparams, SET)
    h = ttt.ttt_hidden(hp, tparams, feats[:, :-1], toks[:, 1:], hcfg, TINY, 1)[0]
    got = SET[jnp.argmax(head3.head_logits3(hp, h), -1)]
    assert np.mean(np.asarray(got) == np.asarray(want)) >= 0.95
  cold = head3.with_lm_head(stage.init_params(hcfg, tparams, SET, 3), tparams, SET)
  h = ttt.ttt_hidden(cold, tparams, feats[:, :-1], toks[:, 1:], hcfg, TINY, 1)[0]
  assert np.mean(np.asarray(SET[jnp.argmax(head3.head_logits3(cold, h), -1)]) ==
                 np.asarray(want)) < 0.5  # the check can fail: a random start does not
