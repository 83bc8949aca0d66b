#!/bin/bash
# Bounded staleness, accuracy (docs/results/accuracy.md, "Bounded staleness:
# accuracy"): protocol (b) -- each codec's recipe and validation-chosen rate,
# not re-tuned for the delay -- with seeds 0,1,2 at S = 0, 1, 2; P = 4 on one
# host (MPICH).
# Run from the repository root.
set -e
OUT=${OUT:-docs/data/i19}
N=${N:-4}
run() { timeout 3000 mpiexec -n $N python -m mpi4py -m hpccomm.bench train "$@"; }
for m in mlp cnn; do
  for s in 0 1 2; do
    run --model $m --codec none,terngrad --recipe paper --seeds 0,1,2 --staleness $s \
        -J $OUT/acc-$m-s$s.json > $OUT/acc-$m-s$s.txt
  done
done
