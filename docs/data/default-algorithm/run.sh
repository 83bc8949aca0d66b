#!/usr/bin/env bash
# auto against the best fixed choice at >= 64 KiB, P = 2 and 4, on shared memory
# and on an emulated 1 Gbit/s network (root: network namespaces): the numbers
# behind the default algorithm (docs/results/auto.md, "auto as the default?").
#   ./dev.sh run docs/data/default-algorithm/run.sh
set -euo pipefail
cd "$(dirname "$0")"
ARGS=(-m 64K:64M -f 4 -i 7 -x 2 --codec onebit,topk,terngrad,qsgd
      --algorithm twoshot,allgather,auto --no-progress)
export NUMBA_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
for P in 2 4; do
    timeout 600 mpiexec -n $P python -m mpi4py -m hpccomm.bench calibrate -o profile-shm-p$P.json
    HPCCOMM_PROFILE=profile-shm-p$P.json timeout 900 mpiexec -n $P python -m mpi4py \
        -m hpccomm.bench allreduce "${ARGS[@]}" -J shm-p$P.json > shm-p$P.txt
    timeout 600 python -m hpccomm.bench netem --ranks $P --rate 1gbit --command calibrate -- \
        -o "$PWD/profile-netem1g-p$P.json"
    HPCCOMM_PROFILE="$PWD/profile-netem1g-p$P.json" timeout 1200 python -m hpccomm.bench netem \
        --ranks $P --rate 1gbit -- "${ARGS[@]}" -J "$PWD/netem1g-p$P.json" > netem1g-p$P.txt
done
for run in shm-p2 shm-p4 netem1g-p2 netem1g-p4; do
    python against_fixed.py $run.json > $run-against-fixed.md
done
