#!/usr/bin/env bash
# Where the CPU goes while onebit and terngrad run over the emulated 1 Gbit/s
# links at P = 2 and 4 (root: network namespaces), and on shared memory at
# P = 2 (the kernels with a core each and no network): /proc/stat sampled
# beside each run (sample_cpu.py), then set against each case's span (cpu.py).
# BURST: the tbf burst of the emulated links (default 256kb, bench netem's and
# docs/results/network.md's; the model check uses 32kb).
#   [BURST=32kb] ./dev.sh run docs/data/i33/p4cpu/run.sh      (~5 min)
# Files go to burst-$BURST/ next to this script, or to OUT=DIR.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
BURST=${BURST:-256kb}
mkdir -p "${OUT:-$here/burst-$BURST}"
cd "${OUT:-$here/burst-$BURST}"
export NUMBA_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 HPCCOMM_BENCH_BIND=core
ARGS=(-m 64M:64M -i 7 -x 1 --codec onebit,terngrad --algorithm twoshot --no-progress)
for run in shm-p2 netem-1g-p2 netem-1g-p4; do
  python "$here/sample_cpu.py" stat-$run.tsv &
  sampler=$!
  if [ $run = shm-p2 ]; then
    timeout 900 mpiexec -n 2 python -m mpi4py -m hpccomm.bench allreduce "${ARGS[@]}" \
        -J $run.json > $run.txt
  else
    timeout 900 python -m hpccomm.bench netem --ranks ${run##*-p} --rate 1gbit --burst $BURST \
        --timeout 850 -- "${ARGS[@]}" -J "$PWD/$run.json" > $run.txt
  fi
  kill $sampler; wait $sampler || true
done
python "$here/cpu.py" . > cpu.md
