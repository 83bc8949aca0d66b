#!/usr/bin/env bash
# The exit with steps in flight, under glibc's malloc checks: the pattern of the
# staleness accuracy runs (several runs in one process, each ending with
# GradReducer(staleness=2) steps in flight, then the interpreter exits), N times
# at P = 4, with MALLOC_CHECK_=3 (glibc >= 2.34 honours it only with
# libc_malloc_debug.so preloaded).  Writes one line per run to exits.txt.
# In a Python process the debug library does not switch its checks on (the heap
# is in use before it initialises: malloc_usable_size(malloc(20)) stays 24 where
# a checked C program gets 20 and aborts on a one-byte overflow), so what these
# runs exercise is glibc's built-in consistency checks -- the ones that printed
# "corrupted double-linked list" -- not the extra ones; valgrind.sh covers more.
#   ./dev.sh run docs/data/exit-check/run.sh [N]
set -uo pipefail
cd "$(dirname "$0")"
N=${1:-50}
DEBUG=$(ls /lib/*-linux-gnu/libc_malloc_debug.so.0 /usr/lib/*-linux-gnu/libc_malloc_debug.so.0 \
        2>/dev/null | head -1)
: > exits.txt
for i in $(seq 1 "$N"); do
    MALLOC_CHECK_=3 LD_PRELOAD=$DEBUG timeout 300 mpiexec -n 4 python -m mpi4py -m hpccomm.bench \
        train --model cnn --codec none,terngrad --recipe paper --seeds 0,1 --staleness 2 \
        --epochs 1 --steps-per-epoch 10 > run.log 2>&1
    rc=$?
    bad=$(grep -c -i -E "corrupted|malloc|double free|free\(\)|Segmentation|Aborted|core dumped" run.log)
    echo "run $i: exit $rc, malloc/abort messages: $bad" | tee -a exits.txt
    if [ "$rc" != 0 ] || [ "$bad" != 0 ]; then cp run.log "failed-$i.log"; fi
done
rm -f run.log
echo "runs: $N, failed: $(grep -c -v 'exit 0, malloc/abort messages: 0' exits.txt)" | tee -a exits.txt
