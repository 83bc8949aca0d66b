#!/usr/bin/env bash
# The cost model against measurements: shared memory and emulated 1 and
# 4 Gbit/s per host (root: network namespaces), P = 2, 3, 4, 4 KiB-256 MiB.
# Each run is calibrated and swept in one launch (bench allreduce --calibrate),
# then reported (prediction next to measurement, outliers with their cause,
# and the count over the sizes whose bare MPI_Allreduce ran as calibrated).
# The emulated links hold 250 us of tokens (tbf burst 32 KB at 1 Gbit/s, 128 KB
# at 4 Gbit/s): netem's default 256 KB lets a transfer that follows 2 ms of idle
# through at memory speed, which no NIC does and no calibration sees.
#   ./dev.sh run docs/data/i33/model/run.sh [shm|1gbit|4gbit ...]     (~40 min)
# OUT=DIR writes the run's files into DIR (created) instead of next to this script.
set -euo pipefail
mkdir -p "${OUT:-$(dirname "$0")}"
cd "${OUT:-$(dirname "$0")}"
ARGS=(-m 4K:256M -f 4 --codec onebit,topk,terngrad
      --algorithm twoshot,allgather,auto --no-progress)
export NUMBA_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
# pinned as in every launch (rank r on the (r mod 2)-th CPU): unbound, 3 ranks on 2
# cores land differently per launch
export HPCCOMM_BENCH_BIND=core
nets=("$@"); [ $# -gt 0 ] || nets=(shm 1gbit 4gbit)
for net in "${nets[@]}"; do
  for P in 2 3 4; do
    run=$net-p$P
    if [ "$net" = shm ]; then
      timeout 2400 mpiexec -n $P python -m mpi4py -m hpccomm.bench allreduce "${ARGS[@]}" \
          --calibrate profile-$run.json -J $run.json > $run.txt
    else
      burst=$([ "$net" = 1gbit ] && echo 32kb || echo 128kb)
      timeout 3000 python -m hpccomm.bench netem --ranks $P --rate $net --burst $burst \
          --timeout 2900 -- "${ARGS[@]}" --calibrate "$PWD/profile-$run.json" \
          -J "$PWD/$run.json" > $run.txt
    fi
    python -m hpccomm.bench report $run.json --profile profile-$run.json > $run-predicted.md
    echo "$run: $(grep "predictions within" $run-predicted.md)"
  done
done
