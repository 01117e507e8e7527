"""PyTorch backends: HF `LlamaForCausalLM` from `hf.to_torch_model` (the one
conversion), eager over a `DynamicCache` (`torch`) or `torch.compile`d over a
`StaticCache` (`torch-compile`). torch and transformers are imported on first
use: this module imports without them."""

from __future__ import annotations

import inspect

import jax
import numpy as np

from specjax.formats import hf
from specjax.bench.backends.base import Backend, Unavailable
from specjax.model.config import ModelConfig


def import_torch():
  try:
    import torch  # pylint: disable=import-outside-toplevel
    import transformers  # pylint: disable=import-outside-toplevel,unused-import
  except ImportError as e:
    raise Unavailable(f"torch/transformers not installed ({e.name}); "
                      f"pip install -e '.[torch]'") from None
  return torch


def _crop_to(cache, length: int) -> None:
  """Rolls an HF cache back to `length` tokens. A negative crop removes that
  many tokens on transformers 4 and 5 alike (5 rejects absolute lengths)."""
  extra = int(cache.get_seq_length()) - length
  if extra > 0:
    cache.crop(-extra)


class TorchBackend(Backend):
  """HF LlamaForCausalLM holding the same params, eager, DynamicCache."""
  name = "torch"

  def __init__(self, cfg: ModelConfig, params, threads: int, attention: str,
               model=None):
    torch = self.torch = import_torch()
    if jax.default_backend() != "cpu" and not torch.cuda.is_available():
      raise Unavailable(f"XLA runs on {jax.default_backend()} but this torch "
                        f"has no CUDA: no like-for-like comparison")
    self.device = "cpu" if jax.default_backend() == "cpu" else "cuda"
    self.threads = threads
    torch.set_num_threads(threads)
    if model is None:  # torch-compile shares the eager backend's model
      model = hf.to_torch_model(cfg, params).to(self.device)
      if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(attention)
      else:  # transformers < 4.48
        model.config._attn_implementation = attention  # pylint: disable=protected-access
    self.model = model
    names = inspect.signature(self.model.forward).parameters
    # transformers >= 5.2x names it `cache`; older ones `past_key_values`.
    self.cache_kw = "cache" if "cache" in names else "past_key_values"
    self.fwd = self.model.forward

  def new_cache(self, capacity: int):
    from transformers import DynamicCache  # pylint: disable=import-outside-toplevel
    try:
      return DynamicCache(config=self.model.config)
    except TypeError:
      return DynamicCache()

  def _call(self, fn, ids, cache):
    with self.torch.inference_mode():
      return fn(input_ids=ids, use_cache=True, **{self.cache_kw: cache}).logits

  def prepare(self, prefix, capacity, max_n):
    self.depth, self.capacity = prefix.shape[1], capacity
    self.cache = self.new_cache(capacity)
    ids = self.torch.from_numpy(prefix.astype(np.int64)).to(self.device)
    self._call(self.model.forward, ids, self.cache)  # prefill: never compiled

  def runner(self, tokens):
    ids = self.torch.from_numpy(np.asarray(tokens, np.int64)).to(self.device)
    sync = self.torch.cuda.synchronize if self.device == "cuda" else (lambda: None)

    def run():
      _crop_to(self.cache, self.depth)
      out = self._call(self.fwd, ids, self.cache)
      sync()
      return out
    return run

  def logits(self, tokens):
    return self.runner(tokens)().float().cpu().numpy()


class TorchCompileBackend(TorchBackend):
  """The torch model's forward under torch.compile, over a StaticCache of
  `capacity` slots (attention spans all of them, as in XLA's cache)."""
  name = "torch-compile"

  def __init__(self, cfg, params, threads, attention, dynamic: bool | None,
               model=None):
    super().__init__(cfg, params, threads, attention, model)
    torch = self.torch
    if not hasattr(torch, "compile"):
      raise Unavailable(f"torch {torch.__version__} has no torch.compile")
    # Every (N, B, cache) may compile a graph: allow them all.
    for limit in ("recompile_limit", "cache_size_limit"):
      if hasattr(torch._dynamo.config, limit):  # pylint: disable=protected-access
        setattr(torch._dynamo.config, limit, 256)  # pylint: disable=protected-access
    self.fwd = torch.compile(self.model.forward, dynamic=dynamic)

  def new_cache(self, capacity):
    from transformers import StaticCache  # pylint: disable=import-outside-toplevel
    return StaticCache(config=self.model.config, max_cache_len=capacity)
