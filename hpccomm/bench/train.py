"""``python -m hpccomm.bench train``: data-parallel training with compressed
gradients, to measure what compression costs in accuracy and what it saves in
time.

    mpiexec -n 4 python -m mpi4py -m hpccomm.bench train --model cnn \\
        --codec none,onebit,topk --recipe paper --seeds 0,1,2 -J train.json

Models (:mod:`hpccomm.bench.models`, data: :mod:`hpccomm.bench.datasets`):

``--model mlp``     numpy MLP on ``--dataset digits`` (default) or ``mnist1d``:
                    the no-torch path;
``--model cnn``     1-D CNN on MNIST-1D (torch);
``--model charlm``  character-level transformer on standard-library source
                    files, reported in bits per character (torch).

Every rank builds the same model (same seed, same initial weights) and trains
on its shard of every global minibatch; the gradients are averaged through
hpccomm (``op="mean"``) with the chosen codec, algorithm and error feedback,
or, for the torch models, through PyTorch DDP with its own hooks
(``--runner ddp``, :mod:`hpccomm.bench.torch_train`).  Each epoch ends with
the validation metric and the training clock; the test metric is taken once,
at the end.  The ranks' weights are then compared bit for bit.

Hyper-parameters: each model's fp32 set (:data:`hpccomm.bench.recipes.MODELS`),
any of them overridable.  ``--recipe same`` trains every codec with them;
``--recipe paper`` applies the codec's recipe from its paper and the learning
rate chosen on validation by ``python -m hpccomm.bench lrgrid``
(:mod:`hpccomm.bench.recipes`).

``--meprop K`` (torch models): meProp's sparsified back-propagation in the
hidden linear layers (:mod:`hpccomm.bench.meprop`).

Data: install with ``pip install 'hpccomm[train]'`` (scikit-learn, mnist1d)
and ``'hpccomm[torch]'``; nothing is downloaded.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

from ..codecs import own_algorithm
from ..codecs.rotation import split_rotate
from . import recipes
from .harness import case_options, parse_options
from .probe import GradientProbe


# ----------------------------------------------------------------------- training
def train_numpy(comm, data, codec: str, algorithm: str, seed: int, args) -> dict:
    """One run of the numpy MLP (``--model mlp``)."""
    import hpccomm
    from hpccomm.fusion import GradientBuckets

    from .models import MLP

    rank, size = comm.Get_rank(), comm.Get_size()
    xtr, ytr = data.x_train, data.y_train
    model = MLP([xtr.shape[1], *args.hidden, 10], seed)
    shapes = {k: v.shape for k, v in model.params.items()}
    transport, ef, options = codec, args.ef, dict(args.options)
    if args.dgc:
        (transport, options), ef = recipes.dgc_transport(algorithm, options), False
    reducer = hpccomm.Allreducer(comm, codec=transport, algorithm=algorithm, op="mean",
                                 error_feedback=ef, seed=seed, **options)
    dense_reducer = hpccomm.Allreducer(comm, codec="none", algorithm="mpi", op="mean")
    buckets = GradientBuckets(shapes, reducer, dense_reducer=dense_reducer,
                              bucket_bytes=0 if args.layerwise else args.bucket_bytes,
                              min_compress=args.min_compress,
                              dense=model.last_layer if args.fp_last else (),
                              staleness=args.staleness)
    dense_all = GradientBuckets(shapes, dense_reducer, dense_reducer=dense_reducer,
                                bucket_bytes=args.bucket_bytes, min_compress=0,
                                prefix="warmup")
    compressed = [n for b in buckets.buckets if not b.dense for n in b.names]
    dgc = None
    if args.dgc:
        from hpccomm.dgc_optimizer import DGCMomentum

        dgc = DGCMomentum({k: shapes[k] for k in compressed}, momentum=args.momentum,
                          ratio=args.dgc_ratio, warmup_epochs=args.dgc_warmup_epochs,
                          clip_norm=args.dgc_clip_norm, nranks=size, seed=seed, rank=rank)
    velocity = {k: np.zeros_like(v) for k, v in model.params.items()}
    n_train = len(xtr)
    per_step = args.batch * size
    steps_per_epoch = max(1, n_train // per_step)
    probe = GradientProbe(comm, 0 if args.dgc else args.probe_every)
    history = []
    step = 0
    t_compute = 0.0
    diverged_at = None
    from mpi4py import MPI

    comm.Barrier()
    t_start, t_eval = time.perf_counter(), 0.0
    for epoch in range(args.epochs):
        perm = np.random.default_rng([seed, epoch, 777]).permutation(n_train)
        losses = []
        for s in range(steps_per_epoch):
            t0 = time.perf_counter()
            idx = perm[s * per_step:(s + 1) * per_step][rank::size]
            with np.errstate(over="ignore", invalid="ignore"):
                loss, grads = model.loss_and_grads(xtr[idx], ytr[idx])
            finite = bool(np.isfinite(loss)) and all(np.isfinite(g).all() for g in grads.values())
            t_compute += time.perf_counter() - t0
            # a diverged run stops on every rank at the same step (one tiny collective)
            if not comm.allreduce(finite, op=MPI.LAND):
                diverged_at = step
                break
            losses.append(loss)
            lr = recipes.lr_at(step, steps_per_epoch, args, size)
            if step < args.dense_warmup_steps:
                dense_all.reduce(grads)
                for k, g in grads.items():
                    velocity[k] *= args.momentum
                    velocity[k] += g
                    model.params[k] -= lr * velocity[k]
            elif dgc is not None:
                # compressed tensors: momentum-corrected selection, masked once sent;
                # dense ones (filtered by the bucket plan): ordinary momentum SGD
                selected = dgc.accumulate({k: grads[k] for k in compressed}, epoch=epoch)
                grads.update(selected)
                buckets.reduce(grads)
                dgc.sent(selected)
                for k, g in grads.items():
                    if k in selected:
                        model.params[k] -= lr * g
                    else:
                        velocity[k] *= args.momentum
                        velocity[k] += g
                        model.params[k] -= lr * velocity[k]
            else:
                probing = probe.active(step)
                if probing:
                    probe.before([grads[k] for k in sorted(grads)])
                # with --staleness, the reduced gradient of S steps ago (none at first)
                if not buckets.reduce(grads):
                    step += 1
                    continue
                if probing:
                    probe.after([grads[k] for k in sorted(grads)])
                for k, g in grads.items():
                    velocity[k] *= args.momentum
                    velocity[k] += g
                    model.params[k] -= lr * velocity[k]
            step += 1
        if diverged_at is not None:
            break
        # the clock counts training only, as the torch loop's
        t_stop = time.perf_counter()
        local = np.array([np.mean(losses)], dtype=np.float64)
        comm.Allreduce(local.copy(), local)
        history.append({"epoch": epoch + 1, "step": step, "time": t_stop - t_start - t_eval,
                        "train_loss": float(local[0] / size),
                        "val": model.accuracy(data.x_val, data.y_val)})
        t_eval += time.perf_counter() - t_stop
    try:                             # --staleness: the last S steps are never applied
        buckets.discard_in_flight()
    except hpccomm.NonFiniteError:   # a diverged run's steps in flight
        pass
    digests = comm.allgather(model.digest())
    stats = np.array([buckets.bytes_sent + dense_all.bytes_sent,
                      buckets.reduce_time + dense_all.reduce_time, t_compute,
                      buckets.comm_time + dense_all.comm_time], dtype=np.float64)
    worst = np.empty_like(stats)
    comm.Allreduce(stats, worst, op=MPI.MAX)
    described = reducer.codec.describe()
    if args.dgc:
        described = f"{recipes.dgc_described(args)}+{described}"
    return {"codec": described, "error_feedback": reducer.memory.enabled,
            **({"probe": probe.summary()} if probe.every else {}),
            "history": history,
            "test": None if diverged_at is not None else model.accuracy(data.x_test, data.y_test),
            "diverged_at_step": diverged_at,
            "bytes_sent_per_rank": int(worst[0]), "t_reduce": float(worst[1]),
            "t_comm": float(worst[3]),
            "t_compute": float(worst[2]), "weights_identical": len(set(digests)) == 1,
            "digest": digests[0], "steps": step, "buckets": buckets.plan()}


# ------------------------------------------------------------------ set-up of a run
def resolve(args, codec: str) -> argparse.Namespace:
    """The hyper-parameters of one codec's runs: the model's fp32 set, the
    command line's overrides, and under ``--recipe paper`` the codec's recipe
    and its validation-chosen learning rate."""
    setup = recipes.MODELS[args.model]
    run = argparse.Namespace(**vars(args))
    for field in ("lr", "lr_scaling", "batch", "epochs", "steps_per_epoch", "warmup_epochs",
                  "weight_decay", "optimizer"):
        if getattr(run, field, None) is None:
            setattr(run, field, getattr(setup, field))
    if run.bucket_bytes is None:
        run.bucket_bytes = 0 if args.model == "mlp" else 25 << 20
    ef_flag = {"auto": None, "on": True, "off": False}[args.error_feedback]
    options = dict(args.options)
    if args.recipe == "paper":
        r = recipes.recipe(codec)
        run.ef = r.error_feedback if ef_flag is None else ef_flag
        run.fp_last, run.dgc, run.layerwise = r.fp_last_layer, r.dgc_momentum, r.layerwise
        options = {**r.options, **options}     # the command line's options win
        if args.lr is None:
            run.lr = recipes.chosen_lr(recipes.table_model(args.model, args.dataset), codec,
                                      args.error_feedback, args.lr_table)
            # chosen for the model's batch; another batch scales it linearly (Goyal et al.)
            run.lr *= run.batch / setup.batch
    else:
        run.ef = ef_flag
        run.fp_last = args.fp_last_layer == "on" or (args.fp_last_layer == "auto"
                                                     and codec == "terngrad")
        run.dgc = args.dgc_momentum == "on" or (args.dgc_momentum == "auto" and codec == "dgc")
        run.layerwise = False
    if run.dgc:
        run.dgc_ratio = float(options.pop("ratio", 0.001))
        if args.staleness:
            # DGC's masking and momentum correction act on what this step sends
            raise SystemExit(f"--staleness does not combine with DGC's recipe ({codec})")
    run.options = options
    return run


def algorithm_for(codec: str, args) -> str:
    # none goes through MPI_Allreduce, or through a sparse algorithm named by
    # --algorithm (exact: each rank sends its gradient's non-zeros, e.g. under
    # --meprop); powersgd through its own algorithm
    if codec == "none":
        from ..sparse_vectors import sparse_algorithms

        return args.algorithm if args.algorithm in sparse_algorithms() else "mpi"
    return own_algorithm(codec) or args.algorithm


def load_data(args):
    """``(data, description)`` of ``args.model`` (``--dataset`` / ``--samples``
    applied); sets ``args.dataset_name``."""
    setup = recipes.MODELS[args.model]
    if args.samples:
        setup = setup._replace(samples=args.samples)
    if args.model == "mlp":
        from .datasets import load_dataset

        data = load_dataset(args.dataset, setup.samples)
        args.dataset_name = args.dataset
        return data, (f"{args.dataset} ({len(data.x_train)} train / {len(data.x_val)} "
                      f"validation / {len(data.x_test)} test), MLP "
                      f"{[data.x_train.shape[1], *args.hidden, 10]}")
    from .torch_train import Data

    args.dataset_name = setup.dataset
    return Data(args.model, setup), f"{args.model} on {setup.dataset}"


def train_run(comm, data, codec: str, algorithm: str, seed: int, args) -> dict:
    """One run of ``args.model``: the numpy loop for the MLP, torch's otherwise."""
    if args.model == "mlp":
        return train_numpy(comm, data, codec, algorithm, seed, args)
    from .torch_train import train_torch

    return train_torch(comm, data, codec, algorithm, seed, args)


def build_parser():
    p = argparse.ArgumentParser(prog="python -m hpccomm.bench train",
                                description="Data-parallel training with compressed gradients "
                                            "(run under mpiexec).")
    p.add_argument("--model", choices=sorted(recipes.MODELS), default="mlp",
                   help="mlp (numpy; --dataset), cnn (MNIST-1D), charlm (stdlib text)")
    p.add_argument("--dataset", choices=("digits", "mnist1d"), default="digits",
                   help="--model mlp only")
    p.add_argument("--samples", type=int, default=None,
                   help="mnist1d: samples to generate (default: the model's)")
    p.add_argument("--codec", default="none", help="comma-separated codecs (one run each)")
    p.add_argument("--recipe", choices=("same", "paper"), default="same",
                   help="same: fp32's hyper-parameters for every codec; paper: the codec's "
                        "recipe and its validation-chosen learning rate")
    p.add_argument("--lr-table", default=None, metavar="FILE",
                   help="chosen learning rates (default: the one lrgrid wrote into the package)")
    p.add_argument("--algorithm", default="twoshot",
                   help="algorithm for the compressed codecs (default twoshot); none uses mpi, "
                        "or the sparse algorithm named here (its non-zeros, exactly)")
    p.add_argument("--runner", choices=("hpccomm", "ddp"), default="hpccomm",
                   help="torch models: average through hpccomm, or PyTorch DDP over gloo")
    p.add_argument("--ddp-hook", choices=("none", "fp16", "powersgd"), default="none",
                   help="--runner ddp: DDP's own communication hook")
    p.add_argument("--ddp-rank", type=int, default=2, help="rank of DDP's PowerSGD hook")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="torch models: reduce buckets while backward runs")
    p.add_argument("--error-feedback", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--seeds", default="0", help="comma-separated seeds")
    p.add_argument("--epochs", type=int, default=None,
                   help="epochs (charlm: evaluation rounds of --steps-per-epoch steps)")
    p.add_argument("--steps-per-epoch", type=int, default=None, help="charlm only")
    p.add_argument("--batch", type=int, default=None,
                   help="samples (charlm: sequences of 64) per rank per step; under --recipe "
                        "paper the chosen learning rate scales with it linearly")
    p.add_argument("--hidden", default="128,64", help="--model mlp: hidden layer widths")
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate (for one rank when scaled; default: the model's fp32 "
                        "rate, or under --recipe paper the validation-chosen one)")
    p.add_argument("--optimizer", choices=("sgd", "adam", *recipes.COMPRESSED_ADAMS),
                   default=None,
                   help="the model's own by default (sgd for mlp and cnn, adam for charlm); "
                        "onebit_adam: hpccomm.optim.OneBitAdam, exact Adam for --freeze-step "
                        "steps, then the momentum reduced through the codec; zero_one_adam: "
                        "hpccomm.optim.ZeroOneAdam, the variance updated on a doubling "
                        "schedule until --freeze-step, local steps after (torch models; "
                        "the codec compresses, in a GradReducer's buckets with --overlap)")
    p.add_argument("--freeze-step", type=int, default=100,
                   help="onebit_adam: steps of exact Adam before the variance is frozen; "
                        "zero_one_adam: its var_freeze_step")
    p.add_argument("--var-update-scaler", type=int, default=16,
                   help="zero_one_adam: variance updates between doublings of their gap")
    p.add_argument("--local-step-scaler", type=int, default=32,
                   help="zero_one_adam: synchronizations between doublings of their gap")
    p.add_argument("--local-step-clipper", type=int, default=4,
                   help="zero_one_adam: the largest gap between synchronizations, in steps")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=None)
    p.add_argument("--lr-scaling", action=argparse.BooleanOptionalAction, default=None,
                   help="scale the learning rate linearly with the ranks (Goyal et al.)")
    p.add_argument("--warmup-epochs", type=float, default=None, help="gradual lr warm-up")
    p.add_argument("--dense-warmup-steps", type=int, default=0,
                   help="steps reduced dense (fp32 MPI_Allreduce) before compression starts, "
                        "as PowerSGD's start_iter (not with DGC's own warm-up, the compressed "
                        "Adams or --staleness)")
    p.add_argument("--fp-last-layer", choices=("auto", "on", "off"), default="auto",
                   help="--recipe same: reduce the last layer dense (auto: on for terngrad)")
    p.add_argument("--dgc-momentum", choices=("auto", "on", "off"), default="auto",
                   help="--recipe same: DGC momentum correction + masking + sparsity warm-up "
                        "(auto: on for dgc)")
    p.add_argument("--dgc-warmup-epochs", type=int, default=4,
                   help="DGC's exponential sparsity warm-up, in epochs (0: none)")
    p.add_argument("--dgc-clip-norm", type=float, default=None,
                   help="DGC's local gradient clipping: each rank's gradients scaled to a joint "
                        "L2 norm of at most this / sqrt(ranks) before accumulating (default: off)")
    p.add_argument("--bucket-bytes", type=int, default=None,
                   help="fusion bucket size (default: 0 for mlp -- each tensor its own -- "
                        "and 25 MiB for the torch models)")
    p.add_argument("--min-compress", type=int, default=256,
                   help="tensors with fewer elements (and 1-D ones) are reduced dense")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="codec/algorithm option: KEY=VALUE applies to every codec that takes "
                        "it, CODEC.KEY=VALUE to that codec only (e.g. dgc.ratio=0.001)")
    p.add_argument("--staleness", type=int, default=0, metavar="S",
                   help="bounded staleness: step t applies the reduced gradient of step t-S "
                        "(GradReducer / GradientBuckets staleness=S; 0: synchronous)")
    p.add_argument("--probe-every", type=int, default=0, metavar="K",
                   help="every K-th step, measure the reduced gradient's error against the "
                        "exact mean (hpccomm.bench.probe); 0: never")
    p.add_argument("--meprop", type=int, default=0, metavar="K",
                   help="torch models: meProp, keep the K largest-magnitude entries of each "
                        "example's output gradient of the hidden linear layers "
                        "(hpccomm.bench.meprop); 0: off")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("-J", "--json", default=None, metavar="FILE")
    return p


def summary(runs, metric: str) -> list:
    """Lines: the test metric per codec, mean +- std over seeds, against fp32."""
    lines, base = [], None
    for label in dict.fromkeys(r["label"] for r in runs):
        mine = [r for r in runs if r["label"] == label]
        bad = sum(r["diverged_at_step"] is not None for r in mine)
        if metric == "accuracy":
            # a diverged run scores what its (non-finite) weights predict: chance or worse
            vals = np.array([0.0 if r["test"] is None else r["test"] for r in mine])
            if label == "none":
                base = vals.mean()
            delta = (f"  ({100 * (vals.mean() - base):+.2f} pp vs fp32)"
                     if base is not None else "")
            text = f"{100 * vals.mean():6.2f} +- {100 * vals.std():5.2f} %"
        else:
            vals = np.array([np.inf if r["test"] is None else r["test"] for r in mine])
            if label == "none":
                base = vals.mean()
            delta = (f"  ({100 * (vals.mean() / base - 1):+.2f} % vs fp32)"
                     if base is not None else "")
            text = f"{vals.mean():6.4f} +- {vals.std():6.4f} bits/char"
        note = f"  [{bad} of {len(mine)} diverged]" if bad else ""
        lines.append(f"#   {label:>16}: {text}{delta}{note}")
    return lines


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from mpi4py import MPI

    import numba

    import hpccomm

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    numba.set_num_threads(max(1, min(args.threads, numba.config.NUMBA_NUM_THREADS)))
    from hpccomm.kernels import threads as kernel_threads
    kernel_threads.set_threads(numba.get_num_threads())
    args.hidden = [int(h) for h in args.hidden.split(",") if h.strip()]
    all_options = parse_options(args.option)
    codecs = [c.strip() for c in args.codec.split(",") if c.strip()]
    for c in codecs:
        if split_rotate(c)[0] not in hpccomm.available_codecs():   # "qsgd+rotate" too
            raise SystemExit(f"unknown codec {c!r}; available: {', '.join(hpccomm.available_codecs())}")
    if args.runner == "ddp" and args.model == "mlp":
        raise SystemExit("--runner ddp needs a torch model (--model cnn or charlm)")
    if args.optimizer in recipes.COMPRESSED_ADAMS and (
            args.model == "mlp" or args.runner == "ddp" or args.staleness or args.probe_every):
        raise SystemExit(f"--optimizer {args.optimizer} runs a torch model (--model cnn or charlm) "
                         "with --runner hpccomm, without --staleness or --probe-every")
    for name in ("freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if args.staleness < 0:
        raise SystemExit("--staleness must be >= 0")
    if args.dgc_clip_norm is not None and not args.dgc_clip_norm > 0:
        raise SystemExit("--dgc-clip-norm must be > 0")
    if args.dense_warmup_steps and args.model != "mlp" and (
            args.staleness or args.runner == "ddp"
            or args.optimizer in recipes.COMPRESSED_ADAMS):
        raise SystemExit("--dense-warmup-steps: not with --staleness, --runner ddp or a "
                         "compressed Adam (its exact steps are its warm-up)")
    if args.staleness and (args.runner == "ddp" or args.probe_every):
        raise SystemExit("--staleness applies to --runner hpccomm without --probe-every")
    from .meprop import validate as validate_meprop
    validate_meprop(args.model, args.meprop)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    setup = recipes.MODELS[args.model]
    data, what = load_data(args)
    if args.runner == "ddp":
        codecs = ["none"]
    if rank == 0:
        print(f"# hpccomm train: {what}, {size} ranks, recipe {args.recipe}, runner "
              f"{args.runner}{' (' + args.ddp_hook + ' hook)' if args.runner == 'ddp' else ''}"
              f"{f', meProp k={args.meprop}' if args.meprop else ''}", flush=True)
        print(f"#{'codec':>34} {'alg':>9} {'EF':>5} {'seed':>4} {'lr':>8} {'val':>7} "
              f"{'test':>7} {'MB sent':>8} {'train s':>8} {'identical':>9}", flush=True)
    runs = []
    for codec in codecs:
        algorithm = algorithm_for(codec, args)
        args.options = case_options(codec, algorithm, all_options)
        run_args = resolve(args, codec)
        label = (f"ddp-{args.ddp_hook}" if args.runner == "ddp"
                 else codec if args.error_feedback == "auto"
                 else f"{codec}:ef={args.error_feedback}")
        if args.optimizer in recipes.COMPRESSED_ADAMS:
            label = f"{args.optimizer}:{label}"
        if args.staleness:
            label += f":s={args.staleness}"
        for seed in seeds:
            r = train_run(comm, data, codec, algorithm, seed, run_args)
            r.update({"label": label, "codec_name": codec, "algorithm": algorithm, "seed": seed,
                      "lr": run_args.lr, "recipe": args.recipe, "ef": run_args.ef,
                      "fp_last_layer": run_args.fp_last, "dgc_momentum": run_args.dgc,
                      "layerwise": run_args.layerwise, "options": run_args.options,
                      "runner": args.runner, "overlap": run_args.overlap,
                      "staleness": args.staleness, "meprop": args.meprop})
            if rank == 0 and "probe" in r and r["probe"]["probed_steps"]:
                print(f"#   probe: step error {r['probe']['step_rel_err']:.3f}, cumulative "
                      f"{r['probe']['cumulative_rel_err']:.3f} over "
                      f"{r['probe']['probed_steps']} steps", flush=True)
            runs.append(r)
            if rank == 0:
                last = r["history"][-1]["val"] if r["history"] else float("nan")
                test = float("nan") if r["test"] is None else r["test"]
                t = r["history"][-1]["time"] if r["history"] else 0.0
                print(f"{r['codec'][:35]:>35} {algorithm:>9} {str(r['error_feedback']):>5} "
                      f"{seed:>4} {run_args.lr:>8.4g} {last:>7.4f} {test:>7.4f} "
                      f"{r.get('bytes_sent_per_rank', 0) / 1e6:>8.2f} {t:>8.2f} "
                      f"{str(r['weights_identical']):>9}"
                      + (f"  diverged at step {r['diverged_at_step']}"
                         if r["diverged_at_step"] is not None else ""), flush=True)
    hosts = comm.allgather(platform.node())
    if rank == 0:
        print(f"# summary: final test {'accuracy' if setup.metric == 'accuracy' else 'loss'}, "
              "mean +- std over seeds")
        print("\n".join(summary(runs, setup.metric)))
        if args.json:
            meta = {"model": args.model, "dataset": args.dataset_name, "ranks": size,
                    "metric": setup.metric, "recipe": args.recipe, "runner": args.runner,
                    "ddp_hook": args.ddp_hook, "netem": os.environ.get("HPCCOMM_NETEM"),
                    "hosts": hosts,
                    "argv": sys.argv[1:] if argv is None else argv,
                    "tool": f"hpccomm {hpccomm.__version__}"}
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump({"meta": meta, "runs": runs}, f, indent=1)
    ok = all(r["weights_identical"] for r in runs)
    return 0 if ok else 3


if __name__ == "__main__":
    sys.exit(main())
