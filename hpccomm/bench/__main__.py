"""``python -m hpccomm.bench <command>``: hpccomm's benchmark suite.

Commands
    allreduce   every selected collective against MPI_Allreduce, side by side
                (run it under mpiexec / srun)
    codecs      encode / decode throughput of every codec against memcpy
    train       data-parallel training with compressed gradients (accuracy study)
    plot        PNG figures from the JSON files of allreduce and train
    netem       the allreduce benchmark across network namespaces with tc-limited links
"""
import argparse
import sys

from .. import __version__

COMMANDS = {
    "allreduce": ("hpccomm.bench.allreduce", "collectives vs MPI_Allreduce over a size sweep "
                                             "(under mpiexec/srun)"),
    "codecs": ("hpccomm.bench.codecs", "encode/decode throughput of every codec vs memcpy"),
    "train": ("hpccomm.bench.train", "data-parallel MLP training: accuracy of each codec vs fp32 "
                                     "(under mpiexec)"),
    "plot": ("hpccomm.bench.plot", "PNG figures from allreduce/train JSON results"),
    "netem": ("hpccomm.bench.netem", "the allreduce benchmark on an emulated cluster network "
                                     "(root)"),
}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
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
    import importlib

    module = importlib.import_module(COMMANDS[args.command][0])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
