#!/bin/bash
# Evidence beside the accuracy study (docs/results/accuracy.md): the gradient probe
# (train --probe-every 1) per codec on the CNN under protocol (b), seed 0; PowerSGD's
# rank 1 and 4 (rank 2 is the recipe) under protocol (b), seeds 0,1,2, on the MLP
# and the CNN.  P = 4 on one host.
set -e
OUT=${OUT:-docs/data/i18}
N=${N:-4}
TABLE=${TABLE:-hpccomm/bench/lr_chosen.json}
run() { timeout 3000 mpiexec -n $N python -m mpi4py -m hpccomm.bench "$@" --lr-table $TABLE; }
for m in cnn; do
  run train --model $m --codec none,onebit,terngrad,qsgd,threshold,topk,randk,powersgd \
      --recipe paper --seeds 0 --probe-every 1 -J $OUT/$m-probe.json > $OUT/$m-probe.txt
  run train --model $m --codec onebit --error-feedback off --recipe paper --seeds 0 \
      --probe-every 1 -J $OUT/$m-probe-noef.json > $OUT/$m-probe-noef.txt
done
for r in 1 4; do
  for m in mlp cnn; do
    run train --model $m --codec powersgd --option powersgd.rank=$r --recipe paper \
        --seeds 0,1,2 -J $OUT/$m-powersgd-r$r.json > $OUT/$m-powersgd-r$r.txt
  done
done
