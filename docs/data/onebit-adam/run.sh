#!/bin/bash
# Compressed Adam on the character transformer, P = 4 on one host, seeds 0,1,2,
# protocol (a) (the model's hyper-parameters: Adam, lr 3e-3, 400 steps):
# - Adam on the dense gradient (fp32 MPI_Allreduce);
# - OneBitAdam, v frozen after 100 steps (25 %), without compression (codec
#   none: what freezing v costs) and with onebit;
# - ZeroOneAdam, var_freeze_step 100, kappa 16, local steps with alpha 32 and
#   gaps of at most 4 (the bench's defaults), with none and onebit;
# - the negative control: OneBitAdam with onebit, worker and owner residuals off.
# Both optimizers run in a GradReducer's buckets with overlap (the bench's default):
# each compressed tensor its own bucket, small and 1-D tensors dense.
# Run from the repository root.
set -e
OUT=${OUT:-docs/data/onebit-adam}
run() { timeout 3000 mpiexec -n 4 python -m mpi4py -m hpccomm.bench train --model charlm --recipe same --seeds 0,1,2 "$@"; }
run --codec none -J $OUT/adam.json > $OUT/adam.txt
run --codec none,onebit --optimizer onebit_adam --freeze-step 100 -J $OUT/onebit-adam.json > $OUT/onebit-adam.txt
run --codec none,onebit --optimizer zero_one_adam --freeze-step 100 -J $OUT/zero-one-adam.json > $OUT/zero-one-adam.txt
run --codec onebit --optimizer onebit_adam --freeze-step 100 --error-feedback off -J $OUT/onebit-adam-noef.json > $OUT/onebit-adam-noef.txt
