"""``python -m hpccomm.bench overlap``: does reducing during backward hide the wire?

Under mpiexec (or ``bench netem --command overlap``).  A PyTorch MLP (one CPU
thread per rank) is trained for a few steps four ways, each timed per step
(median over steps of the slowest rank):

    forward     the forward pass alone (no gradient exists before it ends)
    compute     forward + backward, no reduction
    comm        the reduction of the same gradients alone (``GradReducer()`` after
                an untimed backward)
    serial      backward, then ``GradReducer()``            (model: compute + comm)
    overlap     ``GradReducer(overlap=True)``: buckets start from backward's hooks
                                                           (model: max(compute, comm);
                with buckets made by backward, at best forward + max(backward, comm))

and prints each with the model's prediction.  ``--batch`` sets the compute time
against the wire.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hpccomm.bench overlap", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--codec", default="none,onebit", help="codecs, comma-separated")
    p.add_argument("--algorithm", default="mpi,twoshot",
                   help="one algorithm per codec, comma-separated (same order)")
    p.add_argument("--width", type=int, default=1024, help="hidden width of the MLP")
    p.add_argument("--depth", type=int, default=4, help="hidden layers")
    p.add_argument("--batch", type=int, default=256, help="batch per rank")
    p.add_argument("--bucket-mb", type=float, default=4.0, help="bucket size in MiB")
    p.add_argument("--steps", type=int, default=7, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("-J", "--json", default=None, help="write results to this JSON file")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import torch
    from mpi4py import MPI

    from ..torch_grads import GradReducer

    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    codecs = args.codec.split(",")
    algorithms = args.algorithm.split(",")
    if len(algorithms) != len(codecs):
        raise SystemExit("--algorithm needs one entry per codec")

    def make_model():
        torch.manual_seed(0)
        layers, width = [], 256
        for _ in range(args.depth):
            layers += [torch.nn.Linear(width, args.width), torch.nn.ReLU()]
            width = args.width
        layers.append(torch.nn.Linear(width, 10))
        return torch.nn.Sequential(*layers)

    rng = np.random.default_rng(comm.rank)
    x = torch.from_numpy(rng.standard_normal((args.batch, 256)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, 10, args.batch))
    loss_fn = torch.nn.CrossEntropyLoss()

    def slowest_median(times):
        worst = np.empty(len(times))
        comm.Allreduce(np.asarray(times, dtype=np.float64), worst, op=MPI.MAX)
        return float(np.median(worst))

    def timed(step):
        for _ in range(args.warmup):
            step()
        times = []
        for _ in range(args.steps):
            comm.Barrier()
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        return slowest_median(times)

    rows = []
    params = sum(p.numel() for p in make_model().parameters())
    for codec, algorithm in zip(codecs, algorithms):
        result = {"codec": codec, "algorithm": algorithm, "params": params,
                  "batch": args.batch, "ranks": comm.size}
        for variant in ("forward", "compute", "comm", "serial", "overlap"):
            model = make_model()
            reducer = GradReducer(model, comm, codec=codec, algorithm=algorithm, op="mean",
                                  bucket_bytes=int(args.bucket_mb * (1 << 20)),
                                  overlap=variant == "overlap")
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)

            def backward():
                opt.zero_grad(set_to_none=False)
                loss_fn(model(x), y).backward()

            if variant == "forward":
                def step():
                    with torch.no_grad():
                        loss_fn(model(x), y)
            elif variant == "compute":
                step = backward
            elif variant == "comm":
                def step():
                    reducer()
                backward()
            else:
                def step():
                    backward()
                    reducer()
            result[variant] = timed(step)
        result["model_serial"] = result["compute"] + result["comm"]
        result["model_overlap"] = max(result["compute"], result["comm"])
        result["model_buckets"] = result["forward"] + max(result["compute"] - result["forward"],
                                                          result["comm"])
        result["overlap_vs_model"] = result["overlap"] / result["model_overlap"]
        rows.append(result)
        if comm.rank == 0:
            print(f"{codec:>8} {algorithm:>8}  params={params}  compute {result['compute']*1e3:.1f}"
                  f" ms  comm {result['comm']*1e3:.1f} ms  serial {result['serial']*1e3:.1f} ms"
                  f" (model {result['model_serial']*1e3:.1f})  overlap "
                  f"{result['overlap']*1e3:.1f} ms (max {result['model_overlap']*1e3:.1f},"
                  f" ratio {result['overlap_vs_model']:.2f}; forward + max(backward, comm) "
                  f"{result['model_buckets']*1e3:.1f})", flush=True)
    if comm.rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": {"ranks": comm.size, "mpi": MPI.Get_library_version().splitlines()[0],
                                "args": vars(args)}, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
