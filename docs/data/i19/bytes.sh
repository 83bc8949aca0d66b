#!/bin/bash
# meProp's effect on the exact sparse allreduce's bytes (docs/results/accuracy.md,
# "meProp"): the CNN's run of accuracy.sh (seed 0; the same weights digest),
# fc1.weight's local gradients measured every 25 steps by
# docs/data/i19/meprop_bytes.py.  P = 4 on one host.
set -e
OUT=${OUT:-docs/data/i19}
N=${N:-4}
for k in ${KS:-0 128 64 32 16 8}; do
  timeout 3000 mpiexec -n $N python -m mpi4py docs/data/i19/meprop_bytes.py --meprop $k \
      --every 25 -J $OUT/bytes-$k.json > $OUT/bytes-$k.txt
done
# the harness itself through an exact sparse algorithm: codec none with a sparse
# --algorithm; --min-compress 600000 sends fc1.weight (655 360 elements, the one
# tensor that large) through it and the rest through MPI_Allreduce
for k in ${HARNESS_KS:-32 8}; do
  timeout 3000 mpiexec -n $N python -m mpi4py -m hpccomm.bench train --model cnn --codec none \
      --recipe paper --seeds 0 --meprop $k --algorithm sparse_allgather --min-compress 600000 \
      -J $OUT/harness-sparse_allgather-$k.json > $OUT/harness-sparse_allgather-$k.txt
done
