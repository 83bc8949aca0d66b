#!/usr/bin/env bash
# Shared memory, P = 2: `auto` with onebit and topk against MPI_Allreduce,
# 4 KiB-256 MiB, the cases timed in blocks and interleaved, alternated twice,
# all four runs deciding by one profile calibrated first (ranks bound).
#   ./dev.sh run docs/data/i33/interleave/run.sh          (~15 min on 2 cores)
# OUT=DIR writes the files into DIR instead of next to this script.
set -euo pipefail
mkdir -p "${OUT:-$(dirname "$0")}"
cd "${OUT:-$(dirname "$0")}"
export NUMBA_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 HPCCOMM_BENCH_BIND=core
export HPCCOMM_PROFILE=$PWD/profile-shm-p2.json
timeout 900 mpiexec -n 2 python -m mpi4py -m hpccomm.bench calibrate --codec onebit,topk \
    > calibrate.txt
for round in 1 2; do
  for order in blocks interleaved; do
    timeout 1800 mpiexec -n 2 python -m mpi4py -m hpccomm.bench allreduce -m 4K:256M -f 4 \
        --codec onebit,topk --algorithm auto --order $order --no-progress \
        -J $order-$round.json > $order-$round.txt
  done
done
