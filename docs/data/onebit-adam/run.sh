#!/bin/bash
# OneBitAdam on the character transformer, P = 4 on one host, seeds 0,1,2,
# protocol (a) (the model's hyper-parameters: Adam, lr 3e-3, 400 steps):
# Adam on the dense gradient, OneBitAdam without compression (codec none:
# what freezing v costs) and with onebit, v frozen after 100 steps (25 %).
# Run from the repository root.
set -e
OUT=${OUT:-docs/data/onebit-adam}
run() { timeout 3000 mpiexec -n 4 python -m mpi4py -m hpccomm.bench train --model charlm --recipe same --seeds 0,1,2 "$@"; }
run --codec none -J $OUT/adam.json > $OUT/adam.txt
run --codec none,onebit --optimizer onebit_adam --freeze-step 100 -J $OUT/onebit-adam.json > $OUT/onebit-adam.txt
# the negative control: the same without the worker and owner residuals
run --codec onebit --optimizer onebit_adam --freeze-step 100 --error-feedback off -J $OUT/onebit-adam-noef.json > $OUT/onebit-adam-noef.txt
