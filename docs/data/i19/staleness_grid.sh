#!/bin/bash
# Bounded staleness: does the delay want other hyper-parameters?  The CNN's
# fp32 and terngrad runs (both chose lr 0.025 at momentum 0.9 without delay)
# at S = 1, 2 over lr x momentum, chosen on the validation split with the
# grid's seed (100), as bench lrgrid chooses; P = 4 on one host (MPICH).
set -e
OUT=${OUT:-docs/data/i19}
N=${N:-4}
for s in 1 2; do
  for m in 0.9 0.5; do
    for lr in 0.025 0.0125 0.00625; do
      timeout 3000 mpiexec -n $N python -m mpi4py -m hpccomm.bench train --model cnn \
          --codec none,terngrad --recipe paper --seeds 100 --staleness $s --lr $lr --momentum $m \
          -J $OUT/grid-cnn-s$s-m$m-lr$lr.json > $OUT/grid-cnn-s$s-m$m-lr$lr.txt
    done
  done
done
