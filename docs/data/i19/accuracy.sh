#!/bin/bash
# meProp on the MNIST-1D CNN (docs/results/accuracy.md, "meProp"): fp32
# through MPI_Allreduce under protocol (b) (the paper recipe: fp32's
# validation-chosen learning rate), P = 4 on one host, meProp off and K = 128,
# 64, 32, 16, 8 of fc1's 512 units.  Run from the repository root.
set -e
OUT=${OUT:-docs/data/i19}
N=${N:-4}
SEEDS=${SEEDS:-0,1}
TAG=${TAG:-}            # e.g. SEEDS=2 TAG=-s2: more seeds beside the first files
run() { timeout 3000 mpiexec -n $N python -m mpi4py -m hpccomm.bench "$@"; }
for k in ${KS:-0 128 64 32 16 8}; do
  run train --model cnn --codec none --recipe paper --seeds $SEEDS --meprop $k \
      -J $OUT/cnn-meprop-$k$TAG.json > $OUT/cnn-meprop-$k$TAG.txt
done
