"""What meProp does to the bytes of an exact sparse allreduce
(docs/results/accuracy.md, "meProp").

    mpiexec -n 4 python -m mpi4py docs/data/i19/meprop_bytes.py --meprop 8 \\
        --every 25 -J docs/data/i19/bytes-8.json

Trains the harness's CNN exactly as ``bench train --model cnn --codec none
--recipe paper --meprop K`` does (fp32 through ``MPI_Allreduce``; the run's
weights digest is the accuracy run's) and, every ``--every`` steps, takes each
rank's local gradient of ``fc1.weight`` before the reduction -- through the
harness's gradient-probe hook (``--probe-every``), which sees exactly those
gradients -- and measures on it:

* the fraction of ``fc1.weight``'s rows (units) that are zero on this rank,
  and on every rank (the rows no rank needs to send);
* the bytes per rank that each of hpccomm's exact sparse allreduce algorithms
  (:func:`hpccomm.sparse_algorithms`, fed the rank's non-zeros as a
  :class:`hpccomm.SparseVector`) sends for it, and the relative error of its
  sum against the exact float64 sum (float32 rounding only);
* the bytes of dense ``MPI_Allreduce`` on the same tensor (hpccomm's byte
  accounting: ``2 (P-1)/P`` times the tensor's bytes, ``docs/design.md``,
  "Byte accounting"), what the harness's run sends for it.

Bytes per rank are the largest over the ranks (as ``bench train`` reports),
averaged over the probed steps.  The harness itself routes ``--codec none``
through ``MPI_Allreduce``; the same exact sparse path is
``Allreducer(codec="none", algorithm=<sparse algorithm>)``, which sends each
rank's non-zeros.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def measure(comm, g: np.ndarray, algorithms, dense) -> dict:
    """Row fractions and bytes of one step's local ``fc1.weight`` gradient
    (``dense``: the ``MPI_Allreduce`` reducer whose bytes to compare with)."""
    from mpi4py import MPI

    import hpccomm
    from hpccomm.stats import CallStats

    rows = g.any(axis=1)
    size = comm.Get_size()
    row_counts = np.empty_like(rows, dtype=np.int64)
    comm.Allreduce(rows.astype(np.int64), row_counts, op=MPI.SUM)
    exact = np.empty(g.size, dtype=np.float64)
    comm.Allreduce(g.ravel().astype(np.float64), exact, op=MPI.SUM)
    flat = np.ascontiguousarray(g.ravel(), dtype=np.float32)
    out = {"rows_zero_rank": comm.allreduce(float(1 - rows.mean()), op=MPI.SUM) / size,
           "rows_zero_all": float((row_counts == 0).mean()),
           "density_rank": comm.allreduce(float(np.count_nonzero(flat)) / flat.size,
                                          op=MPI.SUM) / size,
           "bytes": {}, "rel_err": {}}
    norm = float(np.linalg.norm(exact)) or 1.0
    sent = dense.stats.bytes_sent
    dense(flat.copy())
    out["bytes"]["MPI_Allreduce"] = comm.allreduce(dense.stats.bytes_sent - sent, op=MPI.MAX)
    for alg in algorithms:
        stats = CallStats()
        total = hpccomm.sparse_allreduce(hpccomm.SparseVector.from_dense(flat), comm,
                                         algorithm=alg, stats=stats)
        out["bytes"][alg] = comm.allreduce(stats.bytes_sent, op=MPI.MAX)
        out["rel_err"][alg] = float(np.linalg.norm(total - exact)) / norm
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--meprop", type=int, default=0, help="K (0: off)")
    p.add_argument("--every", type=int, default=25, help="measure every N-th step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=None, help="default: the recipe's")
    p.add_argument("-J", "--json", required=True)
    args = p.parse_args(argv)

    from mpi4py import MPI

    import hpccomm
    from hpccomm.bench import torch_train, train
    from hpccomm.bench.models import torch_model
    from hpccomm.bench.probe import GradientProbe

    comm = MPI.COMM_WORLD
    names = [n for n, _ in torch_model("cnn", 0).named_parameters()]
    where = names.index("fc1.weight")
    algorithms = hpccomm.sparse_algorithms()
    dense = hpccomm.Allreducer(comm, codec="none", algorithm="mpi")
    steps = []

    class FC1Recorder(GradientProbe):
        """The harness's probe, also measuring fc1.weight's local gradient."""

        def before(self, grads):
            steps.append(measure(comm, np.asarray(grads[where]), algorithms, dense))
            super().before(grads)

    torch_train.GradientProbe = FC1Recorder      # the probe train_torch builds
    rc = train.main(["--model", "cnn", "--codec", "none", "--recipe", "paper",
                     "--seeds", str(args.seed), "--meprop", str(args.meprop),
                     "--probe-every", str(args.every), "-J", args.json]
                    + (["--epochs", str(args.epochs)] if args.epochs else []))
    if comm.Get_rank() == 0:
        with open(args.json, encoding="utf-8") as f:
            result = json.load(f)
        summary = {
            "probed_steps": len(steps),
            "rows_zero_rank": float(np.mean([s["rows_zero_rank"] for s in steps])),
            "rows_zero_all": float(np.mean([s["rows_zero_all"] for s in steps])),
            "density_rank": float(np.mean([s["density_rank"] for s in steps])),
            "bytes_per_step": {a: float(np.mean([s["bytes"][a] for s in steps]))
                               for a in steps[0]["bytes"]},
            "max_rel_err": {a: float(np.max([s["rel_err"][a] for s in steps]))
                            for a in algorithms}}
        result["fc1_weight"] = {"summary": summary, "steps": steps}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
        dense = summary["bytes_per_step"]["MPI_Allreduce"]
        print(f"# fc1.weight, meProp k={args.meprop or 'off'}, {comm.Get_size()} ranks, "
              f"{len(steps)} steps probed (every {args.every}): rows zero per rank "
              f"{100 * summary['rows_zero_rank']:.1f} %, on every rank "
              f"{100 * summary['rows_zero_all']:.1f} %, density per rank "
              f"{100 * summary['density_rank']:.1f} %")
        print(f"# {'algorithm':>16} {'MB/step/rank':>13} {'vs dense':>9} {'max rel err':>12}")
        for a, b in summary["bytes_per_step"].items():
            err = summary["max_rel_err"].get(a)
            print(f"  {a:>16} {b / 1e6:>13.3f} {dense / b:>8.2f}x "
                  f"{'' if err is None else f'{err:.1e}':>12}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
