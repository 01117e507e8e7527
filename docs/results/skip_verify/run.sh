#!/bin/bash
# before (c7af16c, /tmp/old) and after (HEAD, /work/main), alternating, n-gram gamma 4, SmolLM2
cd /work/main
P1="What are some good ways to stay motivated when learning a new language?"
P2="Write a short poem about the sea at night."
P3="Explain why the sky is blue to a ten-year-old."
for rep in 1; do
 for i in 1 2 3; do
  eval P=\$P$i
  for side in old new; do
   root=/work/main; [ $side = old ] && root=/tmp/old
   PYTHONPATH=$root python $root/experiments/speculative.py --model=smollm2-135m --drafter=ngram --gamma=4 --chat --prompt="$P" --n_predict=96 --reps=3 --json_out=/tmp/skip/${side}_p${i}_r${rep}.json > /tmp/skip/${side}_p${i}_r${rep}.log 2>&1
   echo "$side p$i r$rep: $(grep -io 'speedup[^,]*' /tmp/skip/${side}_p${i}_r${rep}.log | head -1)"
  done
 done
done
