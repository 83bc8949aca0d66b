#!/usr/bin/env bash
# hpccomm developer entry point.  Creates .venv once (idempotent), installs
# hpccomm with the MPICH wheel and the test tools into it, then:
#
#   ./dev.sh bench [ARGS...]   mpiexec -n ${NP:-2} python -m mpi4py -m hpccomm.bench allreduce ARGS
#                              (no ARGS: calibrate auto if this machine has no profile,
#                              then 4 KiB-64 MiB, MPI_Allreduce vs bf16/onebit/terngrad/
#                              qsgd/topk/randk through auto and twoshot, interleaved, and
#                              a line per codec: where compression paid)
#   ./dev.sh test  [ARGS...]   the whole test suite (python tests/run.py ARGS)
#   ./dev.sh gpu [--simulate]  the GPU check: gpu tests at 1, 2, 5 ranks, codec and allreduce
#                              benchmarks (CuPy, torch) with MPI_Allreduce in the same run;
#                              report in bench-out/gpu-report.txt (+ .json), <= 6 minutes.
#                              Needs no network: a venv over the python3 on PATH (which holds
#                              numba-cuda, CuPy, torch) plus the wheels in $HPCCOMM_WHEELS
#                              (mpich, mpi4py, pytest-mpi). --simulate: the same on numba's
#                              CUDA simulator at tiny sizes, over the dev venv (CI runs it)
#   ./dev.sh run CMD...        any command inside the venv (e.g. ./dev.sh run mpiexec -n 4 ...)
#
# Environment: PYTHON (interpreter for the venv, default python3), HPCCOMM_VENV
# (venv path, default .venv), NP (ranks for bench, default 2), HPCCOMM_EXTRAS
# (pip extras, default mpich,test,train), HPCCOMM_TORCH (torch requirement the
# tests install, default torch==2.13.0: a CPU wheel; "none" skips torch),
# HPCCOMM_WHEELS (gpu: a folder of wheels for the GPU interpreter), HPCCOMM_GPU_VENV
# (gpu: the venv it builds, default build/gpu-venv).
set -euo pipefail
cd "$(dirname "$0")"
VENV=${HPCCOMM_VENV:-.venv}
PYTHON=${PYTHON:-python3}
EXTRAS=${HPCCOMM_EXTRAS:-mpich,test,train}
# A CPU build of torch for the tests of the PyTorch helper; an unpinned "torch"
# would pull a multi-GB CUDA build.
TORCH=${HPCCOMM_TORCH:-torch==2.13.0}
# --no-compile: no bytecode for every installed module (torch's alone is half the
# install's time); a program compiles what it imports on first use, and the test
# suite keeps its bytecode in build/pycache (tests/run.py), never reading pip's
PIP_FLAGS="--disable-pip-version-check --no-compile"

setup() {
    if [ ! -x "$VENV/bin/python" ]; then
        "$PYTHON" -c 'import sys; assert sys.version_info >= (3, 9), "hpccomm needs Python >= 3.9"'
        "$PYTHON" -m venv "$VENV"
    fi
    local stamp="$VENV/.hpccomm-installed-$EXTRAS"
    if [ ! -f "$stamp" ] || [ setup.py -nt "$stamp" ]; then
        "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
        "$VENV/bin/python" -m pip install -q $PIP_FLAGS -e ".[$EXTRAS]"
        touch "$stamp"
    fi
    export PATH="$PWD/$VENV/bin:$PATH"
}

# The GPU check's venv: over interpreter $1, whose packages it sees through a .pth
# file (venv --system-site-packages would see only the base install of an interpreter
# that is itself a venv) that adds $1's site directories with their own .pth files
# (numba-cuda's redirection of numba.cuda is one), with the wheels of folder $2
# installed into it (no index; they come first).
gpu_venv() {
    local base=$1 wheels=$2 venv=${HPCCOMM_GPU_VENV:-build/gpu-venv}
    rm -rf "$venv"
    "$base" -m venv "$venv"
    local site
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$base" -c 'import sys; print("".join(f"import site; site.addsitedir({p!r})\n"
                                        for p in sys.path if p.endswith("-packages")))' \
        > "$site/hpccomm-base.pth"
    "$venv/bin/python" -m pip install -q $PIP_FLAGS --no-index --no-deps \
        --ignore-installed \
        "$wheels"/*.whl
    GPU_VENV=$PWD/$venv
}

setup_torch() {
    local stamp="$VENV/.hpccomm-torch-${TORCH//[^A-Za-z0-9.]/_}"
    if [ "$TORCH" != "none" ] && [ ! -f "$stamp" ]; then
        "$VENV/bin/python" -m pip install -q $PIP_FLAGS "$TORCH"
        touch "$stamp"
    fi
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
    bench)
        setup
        if [ $# -eq 0 ]; then
            # the default sweep: MPI_Allreduce against a codec of each family, each
            # through auto (calibrated once per machine and rank count) and twoshot,
            # the cases interleaved so that their ratios hold on a noisy machine
            mpiexec -n "${NP:-2}" python -m mpi4py -m hpccomm.bench calibrate --if-missing
            set -- -m 4K:64M -f 4 --codec bf16,onebit,terngrad,qsgd,topk,randk \
                --algorithm auto,twoshot --order interleaved
        fi
        exec mpiexec -n "${NP:-2}" python -m mpi4py -m hpccomm.bench allreduce "$@"
        ;;
    test)
        setup
        setup_torch
        exec python tests/run.py "$@"
        ;;
    gpu)
        if [ "${1:-}" = "--simulate" ]; then
            # CI: the dev venv (numba-cuda's simulator) is the base, the wheels come from
            # the package index, and every step runs on the simulator
            setup
            wheels=${HPCCOMM_WHEELS:-build/gpu-wheels}
            if [ -z "${HPCCOMM_WHEELS:-}" ]; then
                rm -rf "$wheels"
                "$VENV/bin/python" -m pip download -q --disable-pip-version-check --no-deps \
                    --only-binary=:all: -d "$wheels" mpich mpi4py pytest-mpi
            fi
            base=$PWD/$VENV/bin/python
        else
            wheels=${HPCCOMM_WHEELS:?set HPCCOMM_WHEELS to a folder with mpich, mpi4py and pytest-mpi wheels for $PYTHON}
            base=$(command -v "$PYTHON")
        fi
        gpu_venv "$base" "$wheels"
        export PATH="$GPU_VENV/bin:$PATH" LD_LIBRARY_PATH="$GPU_VENV/lib:${LD_LIBRARY_PATH:-}"
        exec "$GPU_VENV/bin/python" tests/gpucheck.py "$@"
        ;;
    run)
        setup
        exec "$@"
        ;;
    *)
        sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'
        exit 2
        ;;
esac
