#!/bin/bash
# Batch 1, SmolLM2-135M-Instruct float32, T = 0, 96 tokens, 3 reps alternating with target-only:
# n-gram with per-row lengths (budget=auto) on the task suite's open-chat category (multi_turn,
# its first 3 conversations: mt*.jsonl) and the three chat prompts of run.sh (P1-P3);
# then the distilled draft, specjax per-row lengths against HF's default assisted schedule
# (compare_assisted.py), on the same prompts.
# usage: docs/results/rows_batch1/v3/run.sh OUTDIR   (from the repository root)
set -u
OUT=${1:?usage: run.sh OUTDIR}
mkdir -p "$OUT"
D=docs/results/rows_batch1/v3
printf '%s\n' '{"prompt": "What are some good ways to stay motivated when learning a new language?"}' > "$OUT/p1.jsonl"
printf '%s\n' '{"prompt": "Write a short poem about the sea at night."}' > "$OUT/p2.jsonl"
printf '%s\n' '{"prompt": "Explain why the sky is blue to a ten-year-old."}' > "$OUT/p3.jsonl"
for f in $D/mt1.jsonl $D/mt2.jsonl $D/mt3.jsonl "$OUT/p1.jsonl" "$OUT/p2.jsonl" "$OUT/p3.jsonl"; do
  n=$(basename "$f" .jsonl)
  python experiments/speculative.py --model=smollm2-135m --drafter=ngram \
      --gamma=auto:rows,max=4,budget=auto --chat --prompt_file="$f" --n_predict=96 --reps=3 \
      --json_out="$OUT/ngram_rows_$n.json" > "$OUT/ngram_rows_$n.log" 2>&1
  echo "$n ngram per-row: $(grep -o 'speedup = [0-9.]*x' "$OUT/ngram_rows_$n.log") load $(cut -d' ' -f1 /proc/loadavg)"
done
cat $D/mt1.jsonl $D/mt2.jsonl $D/mt3.jsonl "$OUT/p1.jsonl" "$OUT/p2.jsonl" "$OUT/p3.jsonl" > "$OUT/all.jsonl"
python experiments/compare_assisted.py --model=smollm2-135m --model_draft=smollm2-draft \
    --dtype=float32 --chat --prompt_file="$OUT/all.jsonl" --n_predict=96 --reps=3 \
    --hf_schedule=default --specjax_gamma=auto:rows,max=4,budget=auto --noself_pair \
    --json_out="$OUT/assisted_default.json" > "$OUT/assisted_default.log" 2>&1
echo "assisted: exit $? load $(cut -d' ' -f1 /proc/loadavg)"
