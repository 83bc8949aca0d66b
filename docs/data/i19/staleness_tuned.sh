#!/bin/bash
# Bounded staleness: the CNN at the grid's choice per codec and S
# (staleness_grid.sh, staleness_tables.py), seeds 0,1,2; P = 4 on one host.
set -e
OUT=${OUT:-docs/data/i19}
N=${N:-4}
run() { timeout 3000 mpiexec -n $N python -m mpi4py -m hpccomm.bench train --model cnn \
          --recipe paper --seeds 0,1,2 "$@"; }
run --codec none --staleness 1 --momentum 0.5 --lr 0.0125 -J $OUT/acc-cnn-tuned-s1-none.json > $OUT/acc-cnn-tuned-s1-none.txt
run --codec terngrad --staleness 1 --momentum 0.5 --lr 0.025 -J $OUT/acc-cnn-tuned-s1-terngrad.json > $OUT/acc-cnn-tuned-s1-terngrad.txt
run --codec none --staleness 2 --momentum 0.5 --lr 0.025 -J $OUT/acc-cnn-tuned-s2-none.json > $OUT/acc-cnn-tuned-s2-none.txt
run --codec terngrad --staleness 2 --momentum 0.5 --lr 0.00625 -J $OUT/acc-cnn-tuned-s2-terngrad.json > $OUT/acc-cnn-tuned-s2-terngrad.txt
