"""Orbax checkpoints, `load_model` resolution, and tokenizers (no torch needed)."""

from __future__ import annotations

import gc
import json
import string

import jax
import numpy as np
import pytest

from specjax.formats import checkpoint
from specjax.formats import hf
from specjax.model.config import get_preset, preset_names
from specjax.errors import CheckpointError, TokenizerError
from specjax.formats.tokenizer import Tokenizer, load_tokenizer

# A failed orbax restore leaves tensorstore reads in flight; when they finish
# after its event loop closed, asyncio reports it during some later test.
pytestmark = pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnraisableExceptionWarning")

SENTENCES = ["the quick brown fox jumps over the lazy dog",
             "speculative decoding drafts tokens and verifies them",
             "a small model proposes, a large model disposes",
             "jax compiles the whole loop with xla"]


def bit_equal(a, b) -> bool:
  """Same structure, dtypes and bits (NaN-safe, -0.0 != 0.0)."""
  same = lambda x, y: (x.dtype == y.dtype and x.shape == y.shape
                       and np.asarray(x).tobytes() == np.asarray(y).tobytes())
  return (jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
          and all(jax.tree_util.tree_leaves(jax.tree_util.tree_map(same, a, b))))


def write_bpe_tokenizer(path, n_extra=0, bos=False):
  """Trains a tiny byte-level BPE tokenizer (128 tokens, plus `n_extra` added
  tokens) on SENTENCES; writes tokenizer.json. `bos`: its post-processor
  puts <s> first (LLaMA-2 style); otherwise it adds nothing."""
  # pylint: disable=import-outside-toplevel
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, processors, trainers
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=128,
                                special_tokens=["<unk>", "<s>", "</s>"])
  # Every printable ASCII character is in the alphabet, so any ASCII text
  # round-trips; the full byte alphabet (256) would not fit a tiny model.
  tok.train_from_iterator(SENTENCES + [string.printable], trainer)
  tok.add_tokens([f"<extra_{i}>" for i in range(n_extra)])
  if bos:
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B:1", special_tokens=[("<s>", 1)])
  tok.save(str(path))
  return path


def write_sp_tokenizer(folder, llama_style=False):
  """Trains a tiny SentencePiece BPE on SENTENCES: tokenizer.model (64 pieces;
  llama_style: LLaMA's settings, identity normalisation, spaces kept, byte
  fallback, so 300 pieces)."""
  import sentencepiece  # pylint: disable=import-outside-toplevel
  style = (dict(normalization_rule_name="identity", remove_extra_whitespaces=False,
                byte_fallback=True, vocab_size=300) if llama_style else dict(vocab_size=64))
  sentencepiece.SentencePieceTrainer.train(
      sentence_iterator=iter(SENTENCES), model_prefix=str(folder / "tokenizer"),
      hard_vocab_limit=False, model_type="bpe", minloglevel=2, **style)

# ------------------------------------------------------------ orbax


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_orbax_round_trip_bit_exact(tmp_path, init_params, dtype):
  params = init_params(get_preset("tiny", dtype), 0)
  cfg = get_preset("tiny", dtype).replace(bos_token_id=1, eos_token_id=2)
  checkpoint.save(tmp_path / "ckpt", cfg, params)
  assert checkpoint.is_orbax_dir(tmp_path / "ckpt")
  cfg2, params2 = checkpoint.load(tmp_path / "ckpt")
  assert cfg2 == cfg
  assert bit_equal(params2, params)


def test_orbax_load_casts_dtype(tmp_path, init_params):
  cfg = get_preset("tiny")
  checkpoint.save(tmp_path, cfg, init_params(cfg, 0))
  cfg2, params2 = checkpoint.load(tmp_path, dtype="bf16")
  assert (cfg2.dtype, cfg2.param_dtype) == ("bfloat16", "bfloat16")
  assert {x.dtype.name for x in jax.tree_util.tree_leaves(params2)} == {"bfloat16"}


def test_orbax_save_overwrites(tmp_path, init_params):
  cfg = get_preset("tiny")
  params = init_params(cfg, 0)
  checkpoint.save(tmp_path, cfg, params)
  params2 = jax.tree_util.tree_map(lambda x: x + 1, params)
  checkpoint.save(tmp_path, cfg, params2)
  assert bit_equal(checkpoint.load(tmp_path)[1], params2)


def test_orbax_missing_dir(tmp_path):
  assert not checkpoint.is_orbax_dir(tmp_path / "nope")
  with pytest.raises(CheckpointError, match="does not exist"):
    checkpoint.load(tmp_path / "nope")


def test_orbax_missing_config(tmp_path):
  with pytest.raises(CheckpointError, match="missing specjax_config.json"):
    checkpoint.load(tmp_path)


def test_orbax_corrupt_config(tmp_path, init_params):
  cfg = get_preset("tiny")
  checkpoint.save(tmp_path, cfg, init_params(cfg, 0))
  (tmp_path / checkpoint.CONFIG_FILE).write_text("{not json")
  with pytest.raises(CheckpointError, match="corrupt .*specjax_config.json"):
    checkpoint.load(tmp_path)


def test_orbax_missing_params(tmp_path):
  (tmp_path / checkpoint.CONFIG_FILE).write_text(json.dumps(get_preset("tiny").to_dict()))
  with pytest.raises(CheckpointError, match="missing params/"):
    checkpoint.load(tmp_path)


@pytest.mark.parametrize("which", ["largest", "all"])
def test_orbax_corrupt_data(tmp_path, init_params, which):
  cfg = get_preset("tiny")
  checkpoint.save(tmp_path, cfg, init_params(cfg, 0))
  files = sorted((tmp_path / checkpoint.PARAMS_DIR).rglob("d/*"),
                 key=lambda f: f.stat().st_size)
  for f in files[-1:] if which == "largest" else files:
    f.write_bytes(b"junk")
  with pytest.raises(CheckpointError, match="no params found|cannot restore"):
    checkpoint.load(tmp_path)
  gc.collect()  # finalise orbax's abandoned reads here, not in a later test


@pytest.mark.parametrize("part", ["manifest.ocdbt", "_METADATA", "d"])
def test_orbax_incomplete_is_one_line_before_orbax(tmp_path, init_params, capfd, part):
  """A checkpoint missing its manifest (or tree metadata, or root data) is
  named as incomplete before orbax runs: orbax's own failure there printed
  up to a score of asyncio tracebacks first."""
  cfg = get_preset("tiny")
  checkpoint.save(tmp_path, cfg, init_params(cfg, 0))
  target = tmp_path / checkpoint.PARAMS_DIR / part
  if target.is_dir():
    import shutil  # pylint: disable=import-outside-toplevel
    shutil.rmtree(target)
  else:
    target.unlink()
  capfd.readouterr()
  with pytest.raises(CheckpointError, match=rf"params is incomplete \(no {part}: an "
                     rf"interrupted write or a partial copy\)$"):
    checkpoint.load(tmp_path)
  gc.collect()
  err = capfd.readouterr().err
  assert "Traceback" not in err and "Failed to get item metadata" not in err, err


def test_orbax_config_mismatch(tmp_path, init_params):
  """Params restored against a config they do not fit: a clear error."""
  cfg = get_preset("tiny")
  checkpoint.save(tmp_path, cfg, init_params(cfg, 0))
  wrong = get_preset("tiny-draft")
  (tmp_path / checkpoint.CONFIG_FILE).write_text(json.dumps(wrong.to_dict()))
  with pytest.raises(CheckpointError, match=r"param embed/embedding is \(\(256, 64\).*"
                     r"config 'tiny-draft' expects \(\(256, 32\)"):
    checkpoint.load(tmp_path)


def test_save_rejects_params_not_matching_config(tmp_path, init_params):
  cfg = get_preset("tiny")
  with pytest.raises(CheckpointError, match="param .* is .*float32.*expects .*bfloat16"):
    checkpoint.save(tmp_path, cfg.with_dtype("bf16"), init_params(cfg, 0))
  assert not checkpoint.is_orbax_dir(tmp_path)

# ------------------------------------------------------------ load_model


def test_load_model_preset():
  cfg, params, tok = checkpoint.load_model("tiny-draft", dtype="bf16", seed=3)
  assert cfg == get_preset("tiny-draft", "bfloat16")
  assert tok is None
  assert params["embed"]["embedding"].dtype.name == "bfloat16"


def test_load_model_hf_dir_with_tokenizer(tmp_path, init_params):
  params = init_params(get_preset("tiny"), 0)
  cfg = get_preset("tiny").replace(bos_token_id=1, eos_token_id=2)
  tok_file = write_bpe_tokenizer(tmp_path / "tokenizer.json")
  hf.save_hf(tmp_path / "hf", cfg, params, tokenizer_json=tok_file)
  cfg2, params2, tok = checkpoint.load_model(str(tmp_path / "hf"))
  assert cfg2 == cfg.replace(name="hf", attn_block=cfg2.attn_block)
  assert bit_equal(params2, params)
  assert isinstance(tok, Tokenizer) and (tok.bos_id, tok.eos_id) == (1, 2)


def test_load_model_orbax_dir_with_tokenizer(tmp_path, init_params):
  cfg = get_preset("tiny")
  write_bpe_tokenizer(tmp_path / "tokenizer.json")
  checkpoint.save(tmp_path / "ckpt", cfg, init_params(cfg, 0), tokenizer_dir=tmp_path)
  assert (tmp_path / "ckpt" / "tokenizer.json").is_file()
  cfg2, params2, tok = checkpoint.load_model(str(tmp_path / "ckpt"))
  assert cfg2 == cfg and bit_equal(params2, init_params(cfg, 0))
  assert tok.decode(tok.encode(SENTENCES[0])) == SENTENCES[0]


def test_load_model_hf_to_orbax_conversion(tmp_path, init_params):
  """HF dir -> orbax dir keeps weights bit-exact (the conversion scripts do)."""
  cfg = get_preset("tiny", "bf16")
  hf.save_hf(tmp_path / "hf", cfg, init_params(cfg, 0))
  cfg_hf, params_hf, _ = checkpoint.load_model(str(tmp_path / "hf"))
  checkpoint.save(tmp_path / "ckpt", cfg_hf, params_hf, tokenizer_dir=tmp_path / "hf")
  _, params_ckpt, _ = checkpoint.load_model(str(tmp_path / "ckpt"))
  assert bit_equal(params_ckpt, params_hf)


@pytest.mark.parametrize("spec", ["no-such-preset", "{tmp}"])
def test_load_model_unknown_spec(tmp_path, spec):
  with pytest.raises(CheckpointError) as e:
    checkpoint.load_model(spec.format(tmp=tmp_path))
  msg = str(e.value)
  assert "preset name, an HF directory" in msg and "orbax directory" in msg
  assert all(name in msg for name in preset_names())


def test_load_model_tokenizer_too_big(tmp_path, init_params):
  cfg = get_preset("tiny")
  tok_file = write_bpe_tokenizer(tmp_path / "tokenizer.json", n_extra=200)
  hf.save_hf(tmp_path / "hf", cfg, init_params(cfg, 0), tokenizer_json=tok_file)
  with pytest.raises(TokenizerError, match="tokenizer has 328 tokens but the model only 256"):
    checkpoint.load_model(str(tmp_path / "hf"))

# ------------------------------------------------------------ tokenizer


@pytest.mark.parametrize("bos", [False, True])
def test_tokenizer_round_trip_follows_its_post_processor(tmp_path, bos):
  write_bpe_tokenizer(tmp_path / "tokenizer.json", bos=bos)
  tok = load_tokenizer(tmp_path)
  assert (tok.bos_id, tok.eos_id) == (1, 2)  # found by their names
  assert tok.vocab_size == 128
  for text in SENTENCES + ["unseen words: zebra quartz!"]:
    ids, bare = tok.encode(text), tok.encode(text, add_special=False)
    assert ids == ([tok.bos_id] if bos else []) + bare
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_sentencepiece_round_trip(tmp_path):
  write_sp_tokenizer(tmp_path)
  tok = load_tokenizer(tmp_path)
  assert tok.kind == "sentencepiece" and tok.vocab_size == 64
  assert (tok.bos_id, tok.eos_id) == (1, 2)
  for text in SENTENCES:
    ids = tok.encode(text)
    assert ids[0] == 1 and tok.decode(ids + [tok.eos_id]) == text


def test_tokenizer_config_names_specials(tmp_path):
  write_bpe_tokenizer(tmp_path / "tokenizer.json")
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(
      {"bos_token": {"content": "</s>"}, "eos_token": "<unk>"}))
  tok = load_tokenizer(tmp_path)
  assert (tok.bos_id, tok.eos_id) == (2, 0)
  assert load_tokenizer(tmp_path, bos_id=7, eos_id=8).bos_id == 7


TEXTS = ["the quick brown fox", "  two spaces,\nthen a newline\n\n", "def f(x):\n\treturn x * 2  # code",
         "a small model proposes"]


@pytest.mark.parametrize("kind,config", [
    ("bpe", {}), ("bpe-bos", {}), ("bpe", {"add_bos_token": True}),
    ("sp", {"add_bos_token": True}), ("sp", {"add_bos_token": False}),
    ("sp", {"add_bos_token": True, "add_eos_token": True})])
def test_token_ids_match_transformers(tmp_path, transformers, kind, config):
  """The same text gives the same ids as transformers' AutoTokenizer: a
  tokenizer.json's post-processor decides (tokenizer_config's add_bos_token
  does not override it, as in transformers >= 5); a tokenizer.model follows
  add_bos_token / add_eos_token."""
  if kind == "sp":
    write_sp_tokenizer(tmp_path, llama_style=True)
    tc = {"tokenizer_class": "LlamaTokenizer", "unk_token": "<unk>"}
  else:
    write_bpe_tokenizer(tmp_path / "tokenizer.json", bos=kind == "bpe-bos")
    tc = {"tokenizer_class": "PreTrainedTokenizerFast"}
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(
      {**tc, "bos_token": "<s>", "eos_token": "</s>", **config}))
  ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  tok = load_tokenizer(tmp_path)
  for text in TEXTS:
    if kind == "sp" and text.startswith(" "):
      # SentencePiece itself (what specjax runs, and Meta's tokenizer) puts its
      # dummy-prefix '▁' before leading spaces; transformers 5's conversion
      # to a Metaspace BPE does not.
      continue
    assert tok.encode(text) == ref(text)["input_ids"], text
    assert tok.encode(text, add_special=False) == ref(text, add_special_tokens=False)["input_ids"]


def test_no_tokenizer_is_none(tmp_path):
  assert load_tokenizer(tmp_path) is None


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer.model"])
def test_corrupt_tokenizer(tmp_path, name):
  (tmp_path / name).write_text('{"version": "1.0", "model": {"type": "BPE"')
  with pytest.raises(TokenizerError, match=f"corrupt or unreadable tokenizer .*{name}"):
    load_tokenizer(tmp_path)
