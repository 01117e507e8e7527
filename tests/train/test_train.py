"""Training, resume, tokenizer, distillation and the shipped pair."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import train as train_configs
from specjax.formats import checkpoint
from specjax.train import corpus
from specjax.decode import generation
from specjax.model import llama as model
from specjax.train import pair
from specjax.decode import speculative
from specjax.model import steps
from specjax.train import loop as train
from specjax.model.config import ModelConfig
from specjax.errors import CheckpointError, ConfigError
from specjax.model.sampling import SamplingParams

TINY = ModelConfig("t", 64, 32, 2, 4, 2, 64, max_seq_len=64, tie_embeddings=True)


def _tc(**kw):
  c = train_configs.get_config("tiny").target_train
  for k, v in kw.items():
    c[k] = v
  return c


def _stream(n=4000, seed=0):
  # A learnable stream: a short random "program" repeated with noise.
  rng = np.random.default_rng(seed)
  base = rng.integers(3, 64, size=50)
  s = np.tile(base, n // 50 + 1)[:n].copy()
  flip = rng.random(n) < 0.05
  s[flip] = rng.integers(3, 64, size=flip.sum())
  return s.astype(np.int32)


def test_training_reduces_loss(tmp_path):
  tc = _tc(steps=30, batch=4, seq_len=32, lr=1e-2, warmup=3, eval_every=30,
           eval_batches=2, ckpt_every=30, log_every=10)
  stream = _stream()
  windows = corpus.eval_windows(stream, 8, 33)
  before = train.evaluate(model.init_params(TINY, 0), TINY, windows, 4)["eval_loss"]
  params = train.train(TINY, tc, tmp_path, stream, stream, progress=False, log=lambda s: None)
  after = train.evaluate(params, TINY, windows, 4)["eval_loss"]
  assert after < before - 1.0, (before, after)
  recs = train.read_metrics(tmp_path)
  assert [r["step"] for r in recs if "loss" in r] == [10, 20, 30]
  assert recs[-1]["eval_loss"] == pytest.approx(after, rel=1e-5)


def test_resume_matches_uninterrupted(tmp_path):
  tc = _tc(steps=6, batch=2, seq_len=16, ckpt_every=2, log_every=1, eval_every=100)
  stream, quiet = _stream(), dict(progress=False, log=lambda s: None)
  full = train.train(TINY, tc, tmp_path / "a", stream, stream, **quiet)
  part = train.train(TINY, tc, tmp_path / "b", stream, stream, stop_at=3, **quiet)
  assert not all(np.array_equal(x, y) for x, y in zip(jax.tree_util.tree_leaves(part),
                                                       jax.tree_util.tree_leaves(full)))
  resumed = train.train(TINY, tc, tmp_path / "b", stream, stream, **quiet)
  for x, y in zip(jax.tree_util.tree_leaves(full), jax.tree_util.tree_leaves(resumed)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  losses = lambda d: [r["loss"] for r in train.read_metrics(d) if "loss" in r]
  assert losses(tmp_path / "a") == losses(tmp_path / "b")
  assert train.finished_params(tmp_path / "b", TINY, tc) is not None


def test_a_run_killed_before_its_first_checkpoint_logs_each_step_once(tmp_path, monkeypatch):
  """The rows a run wrote before it was killed, with no checkpoint yet, are
  written again by the rerun from step 0: they must not stay twice."""
  tc = _tc(steps=4, batch=2, seq_len=16, ckpt_every=4, log_every=1, eval_every=100)
  stream, quiet = _stream(), dict(progress=False, log=lambda s: None)

  def killed(*args):
    raise KeyboardInterrupt
  monkeypatch.setattr(train, "_save", killed)  # killed while writing its first checkpoint
  with pytest.raises(KeyboardInterrupt):
    train.train(TINY, tc, tmp_path, stream, stream, **quiet)
  assert [r["step"] for r in train.read_metrics(tmp_path)] == [1, 2, 3, 4, 4]
  monkeypatch.undo()
  train.train(TINY, tc, tmp_path, stream, stream, **quiet)
  recs = train.read_metrics(tmp_path)
  assert [r["step"] for r in recs if "loss" in r] == [1, 2, 3, 4]
  assert [r["step"] for r in recs if "eval_loss" in r] == [4]


def test_a_broken_latest_checkpoint_names_the_intact_one(tmp_path, capfd):
  """A last checkpoint without its manifest: one line naming the older
  intact step and how to resume from it; moved aside, the run resumes there
  and finishes as an uninterrupted one."""
  tc = _tc(steps=6, batch=2, seq_len=16, ckpt_every=2, log_every=1, eval_every=100)
  stream, quiet = _stream(), dict(progress=False, log=lambda s: None)
  full = train.train(TINY, tc, tmp_path / "full", stream, stream, **quiet)
  work = tmp_path / "w"
  train.train(TINY, tc, work, stream, stream, stop_at=4, **quiet)
  (work / "ckpt" / "4" / "default" / "manifest.ocdbt").unlink()
  capfd.readouterr()
  with pytest.raises(CheckpointError, match=r"training checkpoint 4 in .*no manifest.ocdbt.*; "
                     r"step 2 is intact: move .*ckpt/4 out of .*ckpt to resume from it$"):
    train.train(TINY, tc, work, stream, stream, **quiet)
  assert "Traceback" not in capfd.readouterr().err
  (work / "ckpt" / "4").rename(work / "broken-4")
  resumed = train.train(TINY, tc, work, stream, stream, **quiet)
  for x, y in zip(jax.tree_util.tree_leaves(full), jax.tree_util.tree_leaves(resumed)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert [r["step"] for r in train.read_metrics(work) if "loss" in r] == [1, 2, 3, 4, 5, 6]
  # a final checkpoint broken with no intact one before it says so
  (work / "ckpt" / "6" / "default" / "_METADATA").unlink()
  (work / "ckpt" / "4" / "default" / "_METADATA").unlink()
  with pytest.raises(CheckpointError, match="no older checkpoint is intact$"):
    train.finished_params(work, TINY, tc)


def test_resume_refuses_a_changed_config(tmp_path):
  stream, quiet = _stream(), dict(progress=False, log=lambda s: None)
  train.train(TINY, _tc(steps=2, batch=2, seq_len=16), tmp_path, stream, stream, **quiet)
  # a run saved before a ModelConfig field existed (it has its default) is the same run
  file = tmp_path / train.CONFIG_FILE
  saved = json.loads(file.read_text())
  del saved["model"]["dot_dtype"]
  file.write_text(json.dumps(saved))
  assert train.finished_params(tmp_path, TINY, _tc(steps=2, batch=2, seq_len=16)) is not None
  with pytest.raises(ConfigError, match="different config"):
    train.train(TINY, _tc(steps=2, batch=2, seq_len=16, lr=5e-3), tmp_path, stream, stream,
                **quiet)


def test_bad_training_settings_raise():
  with pytest.raises(ConfigError, match="train.warmup"):
    train.validate(_tc(steps=5, warmup=5))
  with pytest.raises(ConfigError, match="train.lr"):
    train.validate(_tc(lr=0.0))


def test_distillation_loss_is_zero_for_the_teacher_itself():
  params = model.init_params(TINY, 3)
  batch = jnp.asarray(_stream()[:2 * 17].reshape(2, 17))
  teacher = train.logits_of(params, TINY, batch[:, :-1])
  loss, (kl, _) = train.distill_loss(params, TINY, batch, teacher, 0.0)
  assert float(loss) == pytest.approx(0.0, abs=1e-6) and float(kl) >= -1e-6
  other = train.logits_of(model.init_params(TINY, 4), TINY, batch[:, :-1])
  assert float(train.kl_to_teacher(teacher, other)) > 1e-3


def test_distillation_step_reduces_kl(tmp_path):
  teacher_params = model.init_params(TINY, 7)
  tc = _tc(steps=25, batch=4, seq_len=16, lr=1e-2, warmup=2, eval_every=25, ckpt_every=25,
           log_every=5)
  stream = _stream()
  train.train(TINY, tc, tmp_path, stream, stream, teacher=(TINY, teacher_params),
              progress=False, log=lambda s: None)
  kls = [r["kl"] for r in train.read_metrics(tmp_path) if "kl" in r]
  assert kls[-1] < 0.5 * kls[0], kls


def test_batches_are_a_pure_function_of_step():
  s = _stream()
  np.testing.assert_array_equal(corpus.batch_at(s, 5, 3, 9, 0), corpus.batch_at(s, 5, 3, 9, 0))
  assert not np.array_equal(corpus.batch_at(s, 5, 3, 9, 0), corpus.batch_at(s, 6, 3, 9, 0))
  with pytest.raises(ConfigError):
    corpus.batch_at(s[:5], 0, 1, 9, 0)


def test_split_is_by_file_deterministic_and_disjoint():
  train_files, held = corpus.list_files(heldout_per_mille=50)
  assert set(train_files).isdisjoint(held) and len(held) > 5
  assert not any("test" in p.parts for p in train_files + held)
  again = corpus.list_files(heldout_per_mille=50)
  assert again == (train_files, held)


def test_tokenizer_round_trips_text_exactly(tmp_path):
  files, held = corpus.list_files()
  corpus.train_tokenizer(corpus.read_texts(files[:15]), 400, tmp_path)
  from specjax.formats.tokenizer import load_tokenizer
  tok = load_tokenizer(tmp_path)
  assert (tok.bos_id, tok.eos_id) == (0, 1)
  texts = corpus.read_texts(held[:3]) + [
      "\tdef f(x):\n        return x  # tabs, spaces\r\n", "unicode: é ß 漢字 🙂\x00",
      "  leading and trailing  ", ""]
  for text in texts:
    ids = tok.encode(text, add_special=False)
    assert tok.decode(ids) == text
    assert tok.encode(text) == [tok.bos_id] + ids  # what training puts first
    assert max(ids, default=0) < 400


@pytest.fixture(scope="module")
def shipped():
  t = steps.Runner(*checkpoint.load_model("stdlib-target", "float32")[:2])
  d_cfg, d_params, tok = checkpoint.load_model("stdlib-draft", "float32")
  return t, steps.Runner(d_cfg, d_params), tok


def test_shipped_pair_loads_and_shares_a_vocabulary(shipped):
  t, d, tok = shipped
  assert t.cfg.vocab_size == d.cfg.vocab_size == tok.vocab_size
  assert t.cfg.num_params() > 3 * d.cfg.num_params()
  size = sum(f.stat().st_size for name in ("stdlib-target", "stdlib-draft")
             for f in checkpoint.SHIPPED[name].iterdir())
  assert size <= 25e6, size
  meta = json.loads((checkpoint.SHIPPED["stdlib-target"] / pair.SUMMARY_FILE).read_text())
  assert meta["corpus"]["train_tokens"] > 1e6


def test_shipped_pair_greedy_speculative_equals_target_only(shipped):
  t, d, tok = shipped
  prompt = tok.encode(pair.shipped_prompts(1)[0])
  base = generation.generate(t, [prompt], 40, SamplingParams(0.0), ctx_size=256)
  spec = speculative.generate(t, d, [prompt], 40, 4, rule="real", ctx_size=256)
  assert spec.tokens == base.tokens
  # a trained pair agrees often: more than one token per verify on held-out code
  assert spec.stats.tokens_per_step > 1.5


def test_shipped_pair_is_better_than_chance(shipped):
  t, _, tok = shipped
  text = pair.shipped_prompts(2)[1]
  ids = jnp.asarray([tok.encode(text)])
  loss = float(train.lm_loss(t.params, t.cfg, ids))
  assert loss < 0.5 * np.log(t.cfg.vocab_size), loss


def test_shipped_pair_loads_into_transformers_unchanged(shipped):
  torch = pytest.importorskip("torch", reason="torch not installed (the test extra has it)")
  transformers = pytest.importorskip("transformers")
  t, _, tok = shipped
  path = checkpoint.SHIPPED["stdlib-target"]
  hf_model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
  hf_tok = transformers.AutoTokenizer.from_pretrained(path)
  text = pair.shipped_prompts(1)[0]
  # The same ids, special tokens included: <s> first, as in training.
  assert hf_tok(text)["input_ids"] == tok.encode(text)
  assert tok.encode(text)[0] == tok.bos_id
  assert hf_tok(text, add_special_tokens=False)["input_ids"] == tok.encode(text, add_special=False)
  ids = tok.encode(text)[:48]
  with torch.no_grad():
    ref = hf_model(torch.tensor([ids])).logits.numpy()
  ours = np.asarray(train.logits_of(t.params, t.cfg, jnp.asarray([ids])))
  np.testing.assert_allclose(ours, ref, atol=2e-4, rtol=0)


def test_editing_prompts_repeat_a_whole_function(tmp_path):
  src = ("import os\n\n"
         "class A:\n"
         "    def one(self, x):\n"
         "        if x:\n"
         "\n"
         "            return x + 1\n"
         "        return 0\n"
         "\n"
         "    def two(self): return 2\n"
         "\n"
         "def three(a,\n"
         "          b):\n"
         "    return a\n")
  blocks = corpus.function_blocks(src)
  # `one` whole and dedented (its blank line kept); the one-liner and the
  # multi-line header are skipped
  assert blocks == [(4, "def one(self, x):\n    if x:\n\n        return x + 1\n    return 0\n")]
  (tmp_path / "m.py").write_text(src)

  class Chars:  # a tokenizer of one token per character
    encode = staticmethod(lambda text, add_special=False: list(text))

  got = corpus.editing_prompts([tmp_path / "m.py"], Chars, n=4, max_tokens=200, root=tmp_path)
  assert len(got) == 1 and got[0]["file"] == "m.py" and got[0]["line"] == 4
  text = got[0]["text"]
  assert text.startswith(blocks[0][1]) and text.endswith("\ndef one(self, x):\n")
  assert corpus.EDIT_INSTRUCTIONS[0] in text
  assert corpus.editing_prompts([tmp_path / "m.py"], Chars, n=4, max_tokens=20,
                                root=tmp_path) == []


def test_shipped_prompt_sets():
  cont, edit = pair.shipped_prompts(kind="continuation"), pair.shipped_prompts(kind="editing")
  assert len(cont) >= 16 and len(edit) >= 12
  for text in edit:  # the def line of the function comes again at the end
    assert text.splitlines()[-1] == text.splitlines()[0]
  with pytest.raises(ConfigError, match="prompt set"):
    pair.shipped_prompts(kind="poetry")
