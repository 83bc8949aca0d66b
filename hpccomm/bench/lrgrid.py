"""``python -m hpccomm.bench lrgrid``: choose each codec's learning rate on the
validation split, for ``train --recipe paper``.

    mpiexec -n 4 python -m mpi4py -m hpccomm.bench lrgrid --model cnn \\
        --codec none,onebit,terngrad --seeds 100 [--table FILE]

For every codec (with its paper recipe, :mod:`hpccomm.bench.recipes`) and
every rate of the grid -- :data:`~hpccomm.bench.recipes.LR_GRID` times the
model's fp32 rate, the same grid for every codec and for fp32 -- it trains
with the given seeds (by convention not the seeds of the reported runs) and
scores the final *validation* metric, mean over seeds (a diverged run scores
worst).  The best rate goes into the table (``--table``, default the
package's ``lr_chosen.json``), merged with what the table already holds, with
every rate's score beside it.  The test split is never looked at.
"""
from __future__ import annotations

import json
import math
import os
import sys

import numpy as np

from . import recipes
from .train import algorithm_for, build_parser as train_parser, load_data, resolve, train_run


def score(run, metric: str) -> float:
    """Higher is better: validation accuracy, or minus validation loss."""
    if run["diverged_at_step"] is not None or not run["history"]:
        return -math.inf
    val = run["history"][-1]["val"]
    return val if metric == "accuracy" else -val


def choose(scores: dict) -> float:
    """The rate with the best score; ties go to the smaller rate."""
    return max(sorted(scores), key=lambda lr: (scores[lr], -lr))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = train_parser()
    p.prog = "python -m hpccomm.bench lrgrid"
    p.description = "Choose each codec's learning rate on validation (under mpiexec)."
    p.add_argument("--table", default=recipes.LR_TABLE, help="table to update")
    args = p.parse_args(argv)
    if args.lr is not None:
        p.error("lrgrid chooses --lr itself")
    if args.meprop:
        # the table is keyed by codec: a meProp run's choice would replace fp32's
        p.error("lrgrid does not take --meprop (the table has no entry for it)")
    if args.staleness:
        p.error("lrgrid does not take --staleness (the table has no entry for it)")
    args.recipe = "paper"
    from mpi4py import MPI

    import hpccomm
    from .harness import case_options, parse_options

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    args.hidden = [int(h) for h in args.hidden.split(",") if h.strip()]
    all_options = parse_options(args.option)
    codecs = [c.strip() for c in args.codec.split(",") if c.strip()]
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    setup = recipes.MODELS[args.model]
    data, _ = load_data(args)
    key_model = recipes.table_model(args.model, args.dataset)
    chosen = {}
    for codec in codecs:
        algorithm = algorithm_for(codec, args)
        args.options = case_options(codec, algorithm, all_options)
        scores = {}
        for lr in recipes.grid(args.model):
            args.lr = lr
            run_args = resolve(args, codec)
            s = [score(train_run(comm, data, codec, algorithm, seed, run_args), setup.metric)
                 for seed in seeds]
            scores[lr] = float(np.mean(s))
            if rank == 0:
                print(f"# {key_model} {recipes.table_key(codec, args.error_feedback)} "
                      f"lr {lr:.4g}: validation score {scores[lr]:.4f}", flush=True)
        best = choose(scores)
        chosen[recipes.table_key(codec, args.error_feedback)] = {
            "lr": best, "scores": {f"{lr:.6g}": v for lr, v in scores.items()},
            "seeds": seeds, "ranks": comm.Get_size()}
        args.lr = None
    if rank == 0:
        table = recipes.load_table(args.table) if os.path.exists(args.table) else {}
        table.setdefault(key_model, {}).update(chosen)
        table.setdefault("_meta", {})["tool"] = f"hpccomm {hpccomm.__version__}"
        with open(args.table, "w", encoding="utf-8") as f:
            json.dump(table, f, indent=1, sort_keys=True)
        for k, v in chosen.items():
            print(f"{key_model} {k}: lr {v['lr']:.4g}")
        print(f"# wrote {args.table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
