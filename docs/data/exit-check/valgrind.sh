#!/usr/bin/env bash
# One short run of the same pattern (here the numpy MLP, so that no torch is
# loaded) with every rank under valgrind's memcheck; PYTHONMALLOC=malloc so that
# memcheck sees Python's allocations.  Counts the errors that mean corruption
# (invalid reads, writes and frees) in each rank's log.
#   ./dev.sh run docs/data/exit-check/valgrind.sh
set -uo pipefail
cd "$(dirname "$0")"
PYTHONMALLOC=malloc timeout 1500 mpiexec -n 2 valgrind --tool=memcheck --log-file=valgrind-%p.log \
    --num-callers=30 python -m mpi4py -m hpccomm.bench train --model mlp --dataset digits \
    --codec none,terngrad --recipe paper --seeds 0 --staleness 2 --epochs 1 --steps-per-epoch 5 \
    > valgrind-run.txt 2>&1
echo "exit $?" >> valgrind-run.txt
# per rank: invalid writes and frees (none expected), and invalid reads with
# where they come from (the dynamic loader's strncmp and MPICH's MPI_Init_thread
# are known to read past their buffers' ends); the raw logs are not kept
for f in valgrind-*[0-9].log; do
    echo "$f: writes $(grep -c 'Invalid write' "$f"), frees $(grep -c -E 'Invalid free|Mismatched free' "$f")," \
         "reads $(grep -c 'Invalid read' "$f") (ld.so strncmp: $(grep -A1 'Invalid read' "$f" | grep -c 'strcmp-sse2')," \
         "MPI_Init_thread: $(grep -A8 'Invalid read' "$f" | grep -c 'PMPI_Init_thread'))," \
         "corrupted: $(grep -c -i corrupted "$f"); $(grep -m1 -o 'ERROR SUMMARY.*' "$f")"
    rm -f "$f"
done | tee valgrind-summary.txt
