"""``python -m hpccomm.bench <command>``: hpccomm's benchmark suite.

Commands
    allreduce   every selected collective against MPI_Allreduce, side by side
                (run it under mpiexec / srun)
    codecs      encode / decode throughput of every codec against memcpy
    train       data-parallel training with compressed gradients (accuracy, time to accuracy)
    tta         time to accuracy (markdown) from train JSON results
    lrgrid      choose each codec's learning rate on validation, for train --recipe paper
    plot        PNG figures from the JSON files of allreduce and train
    netem       the allreduce benchmark across network namespaces with tc-limited links
    sparse      sparse allreduce algorithms against MPI_Allreduce (under mpiexec / srun)
    report      markdown table of allreduce results with the model's floor per row
    calibrate   measure MPI patterns and codec kernels for algorithm="auto" (under mpiexec)
    model       predicted step time / throughput of real networks for 2-512 ranks per codec
    overlap     step time of a PyTorch MLP with and without reducing during backward (under mpiexec)
    soak        10^5 calls of a mix of reducers and keys: memory, MPI objects and key state over time
"""
import argparse
import os
import sys

from .. import __version__

COMMANDS = {
    "allreduce": ("hpccomm.bench.allreduce", "collectives vs MPI_Allreduce over a size sweep "
                                             "(under mpiexec/srun)"),
    "codecs": ("hpccomm.bench.codecs", "encode/decode throughput of every codec vs memcpy"),
    "train": ("hpccomm.bench.train", "data-parallel training (mlp, cnn, charlm): accuracy and "
                                     "time to accuracy of each codec vs fp32 (under mpiexec)"),
    "tta": ("hpccomm.bench.timetoacc", "time to fp32's accuracy per codec from train JSON "
                                       "results"),
    "lrgrid": ("hpccomm.bench.lrgrid", "choose each codec's learning rate on validation for "
                                       "train --recipe paper (under mpiexec)"),
    "plot": ("hpccomm.bench.plot", "PNG figures from allreduce/train JSON results"),
    "netem": ("hpccomm.bench.netem", "the allreduce benchmark on an emulated cluster network "
                                     "(root)"),
    "calibrate": ("hpccomm.bench.calibrate", "measure this machine for algorithm='auto' "
                                             "(under mpiexec/srun)"),
    "model": ("hpccomm.bench.model", "predicted training throughput of real networks, 2-512 "
                                     "ranks, per codec and link rate"),
    "overlap": ("hpccomm.bench.overlap", "step time with and without overlapping the reduction "
                                         "with backward (under mpiexec/srun)"),
    "soak": ("hpccomm.bench.soak", "10^5 calls over a mix of keys, codecs and algorithms: "
                                   "memory, MPI objects and key state over time (under mpiexec)"),
    "report": ("hpccomm.bench.report", "markdown table of allreduce JSON with the model's floor"),
    "sparse": ("hpccomm.bench.sparse_allreduce", "sparse allreduce algorithms vs MPI_Allreduce by input "
                                       "density (under mpiexec/srun)"),
}


def limit_blas_threads() -> None:
    """One BLAS thread per process unless ``HPCCOMM_BLAS_THREADS`` says otherwise.

    MPI runs one process per core, and MPICH / Open MPI ranks busy-poll while
    they wait.  OpenBLAS's idle worker threads spin too, so a single
    ``np.linalg.norm`` or matrix product leaves them competing with the ranks
    for the cores: measured here, a 64 KiB ``MPI_Allreduce`` at P = 2 went from
    50 us to 8-20 ms (whole scheduler ticks) after one norm per iteration.
    """
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=int(os.environ.get("HPCCOMM_BLAS_THREADS", "1")), user_api="blas")


_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")


def launcher_rank() -> int:
    """This process's rank as the MPI launcher (mpiexec, srun) set it in the
    environment, read without initializing MPI; 0 outside a launcher."""
    for name in _RANK_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def launched() -> bool:
    """Whether an MPI launcher started this process (it set a rank)."""
    return any(os.environ.get(name, "").isdigit() for name in _RANK_VARIABLES)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if launcher_rank() > 0 and any(a in ("-h", "--help", "--version") for a in argv):
        return 0        # under mpiexec, rank 0 alone prints help and version
    parser = argparse.ArgumentParser(
        prog="python -m hpccomm.bench",
        description="hpccomm benchmark suite",
        epilog="Run 'python -m hpccomm.bench COMMAND --help' for a command's options.")
    parser.add_argument("--version", action="version", version=f"hpccomm {__version__}")
    parser.add_argument("command", choices=sorted(COMMANDS),
                        help="; ".join(f"{k}: {v[1]}" for k, v in sorted(COMMANDS.items())))
    if not argv or argv[0] in ("-h", "--help", "--version"):
        parser.parse_args(argv)
        return 0
    args = parser.parse_args(argv[:1])
    limit_blas_threads()
    if launched() and args.command != "netem":  # a rank, not the driver its ranks inherit CPUs from
        from .harness import bind_to_core

        bind_to_core(launcher_rank())
    import importlib

    module = importlib.import_module(COMMANDS[args.command][0])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
