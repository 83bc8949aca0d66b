#!/usr/bin/env bash
# hpccomm developer entry point.  Creates .venv once (idempotent), installs
# hpccomm with the MPICH wheel and the test tools into it, then:
#
#   ./dev.sh bench [ARGS...]   mpiexec -n ${NP:-2} python -m mpi4py -m hpccomm.bench allreduce ARGS
#                              (no ARGS: 4 KiB-64 MiB, MPI_Allreduce vs none/bf16/onebit/
#                              terngrad/qsgd/topk/randk through twoshot)
#   ./dev.sh test  [ARGS...]   the whole test suite (python tests/run.py ARGS)
#   ./dev.sh run CMD...        any command inside the venv (e.g. ./dev.sh run mpiexec -n 4 ...)
#
# Environment: PYTHON (interpreter for the venv, default python3), HPCCOMM_VENV
# (venv path, default .venv), NP (ranks for bench, default 2), HPCCOMM_EXTRAS
# (pip extras, default mpich,test,train), HPCCOMM_TORCH (torch requirement the
# tests install, default torch==2.13.0: a CPU wheel; "none" skips torch).
set -euo pipefail
cd "$(dirname "$0")"
VENV=${HPCCOMM_VENV:-.venv}
PYTHON=${PYTHON:-python3}
EXTRAS=${HPCCOMM_EXTRAS:-mpich,test,train}
# A CPU build of torch for the tests of the PyTorch helper; an unpinned "torch"
# would pull a multi-GB CUDA build.
TORCH=${HPCCOMM_TORCH:-torch==2.13.0}

setup() {
    if [ ! -x "$VENV/bin/python" ]; then
        "$PYTHON" -c 'import sys; assert sys.version_info >= (3, 9), "hpccomm needs Python >= 3.9"'
        "$PYTHON" -m venv "$VENV"
    fi
    local stamp="$VENV/.hpccomm-installed-$EXTRAS"
    if [ ! -f "$stamp" ] || [ setup.py -nt "$stamp" ]; then
        "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
        "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[$EXTRAS]"
        touch "$stamp"
    fi
    export PATH="$PWD/$VENV/bin:$PATH"
}

setup_torch() {
    local stamp="$VENV/.hpccomm-torch-${TORCH//[^A-Za-z0-9.]/_}"
    if [ "$TORCH" != "none" ] && [ ! -f "$stamp" ]; then
        "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$TORCH"
        touch "$stamp"
    fi
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
    bench)
        setup
        if [ $# -eq 0 ]; then
            # the default sweep: MPI_Allreduce against a codec of each family
            set -- -m 4K:64M -f 4 --codec none,bf16,onebit,terngrad,qsgd,topk,randk \
                --algorithm mpi,twoshot
        fi
        exec mpiexec -n "${NP:-2}" python -m mpi4py -m hpccomm.bench allreduce "$@"
        ;;
    test)
        setup
        setup_torch
        exec python tests/run.py "$@"
        ;;
    run)
        setup
        exec "$@"
        ;;
    *)
        sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'
        exit 2
        ;;
esac
