#!/bin/bash
# batch 4 mixed (docs/results/rows_first/mixed4.jsonl), n-gram, SmolLM2: gamma 2 and per-row budget=auto, at HEAD
cd /work/main
for g in auto:rows,max=4,budget=auto 2 auto:rows,max=4,budget=auto 2; do
  n=$(echo $g | tr ':,=' '___'); i=$((i+1))
  python experiments/speculative.py --model=smollm2-135m --drafter=ngram --gamma=$g --n_predict=64 --reps=3 --chat --prompt_file=docs/results/rows_first/mixed4.jsonl --json_out=/tmp/m4/${n}_$i.json > /tmp/m4/${n}_$i.log 2>&1
  echo "gamma=$g run $i: $(grep -io 'speedup[^,]*' /tmp/m4/${n}_$i.log | head -1) load $(cut -d' ' -f1 /proc/loadavg)"
done
