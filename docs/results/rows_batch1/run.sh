#!/bin/bash
# batch 1, n-gram, SmolLM2, the skip_verify prompts: gamma 4 against per-row lengths (budget=auto), at HEAD
# usage: run.sh [PREFIX]  (run 1: no prefix, at 9999924; run 2: v2_, at 7a648e0-04d25fc)
cd /work/main
X=${1:-}
P1="What are some good ways to stay motivated when learning a new language?"
P2="Write a short poem about the sea at night."
P3="Explain why the sky is blue to a ten-year-old."
for i in 1 2 3; do
  eval P=\$P$i
  for g in 4 auto:rows,max=4,budget=auto; do
    n=$(echo $g | tr ':,=' '___')
    python experiments/speculative.py --model=smollm2-135m --drafter=ngram --gamma=$g --chat --prompt="$P" --n_predict=96 --reps=3 --json_out=/tmp/b1/${X}g${n}_p${i}.json > /tmp/b1/${X}g${n}_p${i}.log 2>&1
    echo "p$i gamma=$g: $(grep -io 'speedup[^,]*' /tmp/b1/${X}g${n}_p${i}.log | head -1) load $(cut -d' ' -f1 /proc/loadavg)"
  done
done
