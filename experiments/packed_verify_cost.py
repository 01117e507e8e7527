"""The packed verify's cost against the rectangular verify's
(specjax/bench/studies/packed_verify_cost.py):

  python experiments/packed_verify_cost.py --model=stdlib-target --batches=4,8 \
      --gamma=4 --depth=64 --reps=7

For each batch B and block size N = B .. B (gamma + 1) in steps of B / 2: T_packed(B, N),
T_rect(B, gamma + 1) and T_rect(B, N / B) where B divides N (--whole_rows:
those N alone), medians of
--reps alternating repetitions, compile untimed. --torch adds the same
three in PyTorch on the same weights (backends/torch_packed.py), timed in
the same rounds, eager unless --torch_compile; --torch_threads=1 on a small
shared CPU (docs/long_context.md). --json_out writes the records
(docs/packed_verify.md).
"""

from absl import flags

from specjax import cli
from specjax import workdir as wd
from specjax.bench import tables
from specjax.bench.backends import torch_llama
from specjax.bench.studies import packed_verify_cost
from specjax.formats import checkpoint
from specjax.model import steps

_MODEL = flags.DEFINE_string("model", "stdlib-target", "Target: preset, HF, GGUF or orbax.")
_DTYPE = flags.DEFINE_string("dtype", "float32", "Compute dtype.")
_BATCHES = flags.DEFINE_list("batches", "4,8", "Batch sizes.")
_GAMMA = flags.DEFINE_integer("gamma", 4, "Most drafts per row.", lower_bound=1)
_DEPTH = flags.DEFINE_integer("depth", 64, "Tokens in each row's cache.", lower_bound=1)
_REPS = flags.DEFINE_integer("reps", 7, "Timed repetitions (alternating).", lower_bound=1)
_WHOLE = flags.DEFINE_bool("whole_rows", False,
                           "N in steps of B only (the points with a rectangle of N / B).")
_TORCH = flags.DEFINE_bool("torch", False, "Also time PyTorch's packed and rectangular verify.")
_COMPILE = flags.DEFINE_bool("torch_compile", False, "torch.compile the torch forwards.")
_THREADS = flags.DEFINE_integer("torch_threads", 0, "torch's threads (0: its default).",
                                lower_bound=0)
_JSON = flags.DEFINE_string("json_out", None, "Write the records here (JSON).")


def whole_rows(batch: int, gamma: int) -> list[int]:
  """N = B .. B (gamma + 1) by B: the blocks with a rectangle of N / B."""
  return list(range(batch, batch * (gamma + 1) + 1, batch))


def main(argv):
  del argv
  batches = tables.parse_ints(_BATCHES.value, "--batches")
  cfg, params, _ = checkpoint.load_model(_MODEL.value, dtype=_DTYPE.value)
  tmodel = None
  if _TORCH.value:
    tmodel = torch_llama.TorchLlama(cfg, params, compile=_COMPILE.value,
                                    threads=_THREADS.value or None)
  torch_note = ("" if tmodel is None else f"; torch {'compiled' if _COMPILE.value else 'eager'}"
                f", {tmodel.torch.get_num_threads()} thread(s)")
  print(f"target {cfg.name} ({cfg.precision}), gamma {_GAMMA.value}, depth {_DEPTH.value}, "
        f"medians of {_REPS.value}{torch_note}")
  recs = packed_verify_cost.packed_cost(steps.Runner(cfg, params), batches, _GAMMA.value,
                                        _DEPTH.value, _REPS.value, torch_model=tmodel,
                                        sizes=whole_rows if _WHOLE.value else
                                        packed_verify_cost.even_sizes)
  if _JSON.value:
    settings = {"model": _MODEL.value, "dtype": _DTYPE.value, "whole_rows": _WHOLE.value,
                "torch": _TORCH.value,
                "torch_compile": _COMPILE.value, "torch_threads": _THREADS.value,
                "torch_compile_note": None if tmodel is None else tmodel.compile_note}
    wd.write_json(_JSON.value, {"records": recs, "settings": settings,
                                "environment": wd.environment()})


if __name__ == "__main__":
  cli.run(main)
