"""``python -m hpccomm.bench train``: data-parallel training with compressed
gradients, to measure what compression costs in accuracy.

    mpiexec -n 4 python -m mpi4py -m hpccomm.bench train --dataset digits \\
        --codec none,onebit,topk --seeds 0,1,2 -J train.json

Each rank trains the same MLP (same seed, same initial weights) on its shard
of every global minibatch; the gradients are averaged through hpccomm
(``op="mean"``) in fusion buckets, with the chosen codec, algorithm and error
feedback; every rank applies the same SGD-with-momentum update.  At the end
the ranks' weights are compared bit for bit.

Why numpy and not torch: the models that fit the offline datasets here
(sklearn's 8x8 digits, MNIST-1D) are small MLPs whose forward and backward
passes are a few matrix products; numpy keeps the harness dependency-free and
exactly reproducible, and the torch integration is exercised separately
(:mod:`hpccomm.torch_grads`).

Techniques from the papers, as options: linear learning-rate scaling with
gradual warm-up (Goyal et al.); dense warm-up steps before compression starts;
TernGrad's full-precision last layer (``--fp-last-layer auto``: on for
terngrad); DGC's momentum correction, factor masking and sparsity warm-up
(``--dgc-momentum auto``: on for the dgc codec).

Data: ``--dataset digits`` (scikit-learn's 1797 real 8x8 digits, offline) or
``mnist1d`` (generated procedurally by the ``mnist1d`` package; nothing is
downloaded).  Install both with ``pip install 'hpccomm[train]'``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from typing import Dict, List

import numpy as np

from ..codecs.base import own_algorithm, split_rotate
from ..options import resolve_options
from .harness import case_options, parse_options


# --------------------------------------------------------------------------- data
def load_dataset(name: str, samples: int = 5000):
    """``(x_train, y_train, x_test, y_test)`` as float32 / int64, standardized."""
    if name == "digits":
        from sklearn.datasets import load_digits

        d = load_digits()
        x, y = d.data.astype(np.float32), d.target.astype(np.int64)
        perm = np.random.default_rng(0).permutation(len(x))  # fixed split, any training seed
        cut = int(0.8 * len(x))
        xtr, ytr, xte, yte = x[perm[:cut]], y[perm[:cut]], x[perm[cut:]], y[perm[cut:]]
    elif name == "mnist1d":
        from mnist1d.data import get_dataset_args, make_dataset

        args = get_dataset_args()
        args.num_samples = samples
        d = make_dataset(args)
        xtr, ytr = d["x"].astype(np.float32), d["y"].astype(np.int64)
        xte, yte = d["x_test"].astype(np.float32), d["y_test"].astype(np.int64)
    else:
        raise ValueError(f"unknown dataset {name!r}")
    mean, std = xtr.mean(axis=0), xtr.std(axis=0) + 1e-6
    return (xtr - mean) / std, ytr, (xte - mean) / std, yte


# -------------------------------------------------------------------------- model
class MLP:
    """ReLU MLP with a softmax cross-entropy head, float32, numpy."""

    def __init__(self, sizes: List[int], seed: int):
        rng = np.random.default_rng([seed, 12345])
        self.sizes = sizes
        self.params: Dict[str, np.ndarray] = {}
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
            self.params[f"W{i}"] = (rng.standard_normal((a, b)) * np.sqrt(2.0 / a)).astype(np.float32)
            self.params[f"b{i}"] = np.zeros(b, dtype=np.float32)
        self.layers = len(sizes) - 1

    @property
    def last_layer(self) -> List[str]:
        return [f"W{self.layers - 1}", f"b{self.layers - 1}"]

    def logits(self, x):
        h = x
        for i in range(self.layers):
            h = h @ self.params[f"W{i}"] + self.params[f"b{i}"]
            if i < self.layers - 1:
                h = np.maximum(h, 0)
        return h

    def loss_and_grads(self, x, y):
        acts = [x]
        h = x
        for i in range(self.layers):
            h = h @ self.params[f"W{i}"] + self.params[f"b{i}"]
            if i < self.layers - 1:
                h = np.maximum(h, 0)
            acts.append(h)
        z = acts[-1] - acts[-1].max(axis=1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=1, keepdims=True)
        n = x.shape[0]
        loss = float(-np.log(p[np.arange(n), y] + 1e-12).mean())
        d = p
        d[np.arange(n), y] -= 1
        d /= n
        grads = {}
        for i in reversed(range(self.layers)):
            grads[f"W{i}"] = (acts[i].T @ d).astype(np.float32)
            grads[f"b{i}"] = d.sum(axis=0).astype(np.float32)
            if i > 0:
                d = (d @ self.params[f"W{i}"].T) * (acts[i] > 0)
        return loss, grads

    def accuracy(self, x, y) -> float:
        return float((self.logits(x).argmax(axis=1) == y).mean())

    def digest(self) -> str:
        h = hashlib.sha256()
        for k in sorted(self.params):
            h.update(self.params[k].tobytes())
        return h.hexdigest()


# ----------------------------------------------------------------------- training
def lr_at(step: int, steps_per_epoch: int, args, nranks: int) -> float:
    """Linear scaling with gradual warm-up (Goyal et al.)."""
    target = args.lr * (nranks if args.lr_scaling else 1)
    warm = args.warmup_epochs * steps_per_epoch
    if warm and step < warm:
        return args.lr + (target - args.lr) * step / warm
    return target


def train_one(comm, data, codec: str, algorithm: str, seed: int, args) -> dict:
    import hpccomm
    from hpccomm.fusion import GradientBuckets

    rank, size = comm.Get_rank(), comm.Get_size()
    xtr, ytr, xte, yte = data
    model = MLP([xtr.shape[1], *args.hidden, 10], seed)
    shapes = {k: v.shape for k, v in model.params.items()}
    ef = {"auto": None, "on": True, "off": False}[args.error_feedback]
    fp_last = args.fp_last_layer == "on" or (args.fp_last_layer == "auto" and codec == "terngrad")
    use_dgc = args.dgc_momentum == "on" or (args.dgc_momentum == "auto" and codec == "dgc")
    options = dict(args.options)
    transport = codec
    dgc_ratio = None
    if use_dgc:
        # DGCMomentum selects (with DGC's sampled threshold, at the warm-up density);
        # the reducer must then deliver exactly the selection: topk keeping every
        # non-zero.  DGC's accumulation is the error feedback.
        ef = False
        dgc_ratio = float(options.pop("ratio", 0.001))
        transport = "topk"
        _, options = resolve_options(None, algorithm, options, strict=False)
        options["ratio"] = 1.0
    reducer = hpccomm.Allreducer(comm, codec=transport, algorithm=algorithm, op="mean",
                                 error_feedback=ef, seed=seed, **options)
    dense_reducer = hpccomm.Allreducer(comm, codec="none", algorithm="mpi", op="mean")
    buckets = GradientBuckets(shapes, reducer, dense_reducer=dense_reducer,
                              bucket_bytes=args.bucket_bytes, min_compress=args.min_compress,
                              dense=model.last_layer if fp_last else ())
    dense_all = GradientBuckets(shapes, dense_reducer, dense_reducer=dense_reducer,
                                bucket_bytes=args.bucket_bytes, min_compress=0,
                                prefix="warmup")
    compressed = [n for b in buckets.buckets if not b.dense for n in b.names]
    dgc = None
    if use_dgc:
        from hpccomm.dgc_optimizer import DGCMomentum

        dgc = DGCMomentum({k: shapes[k] for k in compressed}, momentum=args.momentum,
                          ratio=dgc_ratio, warmup_epochs=args.dgc_warmup_epochs,
                          nranks=size, seed=seed, rank=rank)
    velocity = {k: np.zeros_like(v) for k, v in model.params.items()}
    n_train = len(xtr)
    per_step = args.batch * size
    steps_per_epoch = max(1, n_train // per_step)
    history = []
    step = 0
    t_compute = 0.0
    diverged_at = None
    from mpi4py import MPI

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
            lr = lr_at(step, steps_per_epoch, args, size)
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
                buckets.reduce(grads)
                for k, g in grads.items():
                    velocity[k] *= args.momentum
                    velocity[k] += g
                    model.params[k] -= lr * velocity[k]
            step += 1
        if diverged_at is not None:
            break
        local = np.array([np.mean(losses)], dtype=np.float64)
        comm.Allreduce(local.copy(), local)
        history.append({"epoch": epoch + 1, "train_loss": float(local[0] / size),
                        "test_acc": model.accuracy(xte, yte)})
    digests = comm.allgather(model.digest())
    stats = np.array([buckets.bytes_sent + dense_all.bytes_sent,
                      buckets.reduce_time + dense_all.reduce_time, t_compute,
                      buckets.comm_time + dense_all.comm_time], dtype=np.float64)
    worst = np.empty_like(stats)
    comm.Allreduce(stats, worst, op=MPI.MAX)
    described = reducer.codec.describe()
    if use_dgc:
        described = f"dgc(ratio={dgc_ratio},warmup={args.dgc_warmup_epochs})+{described}"
    return {"codec": described, "codec_name": codec, "algorithm": algorithm,
            "error_feedback": reducer.memory.enabled, "dgc_momentum": use_dgc,
            "fp_last_layer": fp_last, "seed": seed, "epochs": history,
            # a diverged run scores what its (non-finite) weights predict: chance or worse
            "final_acc": history[-1]["test_acc"] if diverged_at is None else 0.0,
            "final_loss": history[-1]["train_loss"] if diverged_at is None else float("nan"),
            "diverged_at_step": diverged_at,
            "bytes_sent_per_rank": int(worst[0]), "t_reduce": float(worst[1]),
            "t_comm": float(worst[3]),
            "t_compute": float(worst[2]), "weights_identical": len(set(digests)) == 1,
            "steps": step, "buckets": buckets.plan()}


def build_parser():
    p = argparse.ArgumentParser(prog="python -m hpccomm.bench train",
                                description="Data-parallel MLP training with compressed gradients "
                                            "(run under mpiexec).")
    p.add_argument("--dataset", choices=("digits", "mnist1d"), default="digits")
    p.add_argument("--samples", type=int, default=5000, help="mnist1d: samples to generate")
    p.add_argument("--codec", default="none", help="comma-separated codecs (one run each)")
    p.add_argument("--algorithm", default="twoshot",
                   help="algorithm for the compressed codecs (default twoshot; none uses mpi)")
    p.add_argument("--error-feedback", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--seeds", default="0", help="comma-separated seeds")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    p.add_argument("--hidden", default="128,64", help="hidden layer widths")
    p.add_argument("--lr", type=float, default=0.02, help="learning rate for one rank")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--lr-scaling", action=argparse.BooleanOptionalAction, default=True,
                   help="scale the learning rate linearly with the ranks (Goyal et al.)")
    p.add_argument("--warmup-epochs", type=float, default=2.0, help="gradual lr warm-up")
    p.add_argument("--dense-warmup-steps", type=int, default=0,
                   help="steps reduced dense before compression starts")
    p.add_argument("--fp-last-layer", choices=("auto", "on", "off"), default="auto",
                   help="reduce the last layer dense (auto: on for terngrad)")
    p.add_argument("--dgc-momentum", choices=("auto", "on", "off"), default="auto",
                   help="DGC momentum correction + masking + sparsity warm-up (auto: on for dgc)")
    p.add_argument("--dgc-warmup-epochs", type=int, default=4,
                   help="DGC's exponential sparsity warm-up, in epochs (0: none)")
    p.add_argument("--bucket-bytes", type=int, default=0,
                   help="fusion bucket size; 0 reduces each tensor with its own shape")
    p.add_argument("--min-compress", type=int, default=256,
                   help="tensors with fewer elements (and 1-D ones) are reduced dense")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="codec/algorithm option: KEY=VALUE applies to every codec that takes "
                        "it, CODEC.KEY=VALUE to that codec only (e.g. dgc.ratio=0.001)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("-J", "--json", default=None, metavar="FILE")
    return p


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
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    data = load_dataset(args.dataset, args.samples)
    if rank == 0:
        print(f"# hpccomm train: {args.dataset} ({len(data[0])} train / {len(data[2])} test), "
              f"MLP {[data[0].shape[1], *args.hidden, 10]}, {size} ranks x batch {args.batch}, "
              f"{args.epochs} epochs, lr {args.lr} (scaling {args.lr_scaling}, warm-up "
              f"{args.warmup_epochs} epochs), momentum {args.momentum}", flush=True)
        print(f"#{'codec':>34} {'alg':>9} {'EF':>5} {'seed':>4} {'final acc':>9} {'loss':>7} "
              f"{'MB sent':>8} {'reduce s':>8} {'compute s':>9} {'identical':>9}", flush=True)
    runs = []
    for codec in codecs:
        # none goes through MPI_Allreduce; powersgd through its own algorithm
        algorithm = "mpi" if codec == "none" else (own_algorithm(codec) or args.algorithm)
        args.options = case_options(codec, algorithm, all_options)
        for seed in seeds:
            r = train_one(comm, data, codec, algorithm, seed, args)
            runs.append(r)
            if rank == 0:
                print(f"{r['codec']:>35} {algorithm:>9} {str(r['error_feedback']):>5} {seed:>4} "
                      f"{r['final_acc']:>9.4f} {r['final_loss']:>7.4f} "
                      f"{r['bytes_sent_per_rank'] / 1e6:>8.2f} {r['t_reduce']:>8.2f} "
                      f"{r['t_compute']:>9.2f} {str(r['weights_identical']):>9}"
                      + (f"  diverged at step {r['diverged_at_step']}"
                         if r["diverged_at_step"] is not None else ""), flush=True)
    if rank == 0:
        print("# summary: final test accuracy, mean +- std over seeds")
        base = None
        for codec in codecs:
            accs = np.array([r["final_acc"] for r in runs if r["codec_name"] == codec])
            if codec == "none":
                base = accs.mean()
            delta = f"  ({100 * (accs.mean() - base):+.2f} pp vs fp32)" if base is not None else ""
            bad = sum(r["diverged_at_step"] is not None for r in runs if r["codec_name"] == codec)
            note = f"  [{bad} of {accs.size} diverged, counted as 0 %]" if bad else ""
            print(f"#   {codec:>10}: {100 * accs.mean():6.2f} +- {100 * accs.std():5.2f} %"
                  f"{delta}{note}")
        if args.json:
            meta = {"dataset": args.dataset, "ranks": size, "epochs": args.epochs,
                    "batch": args.batch, "lr": args.lr, "hidden": args.hidden,
                    "momentum": args.momentum, "lr_scaling": args.lr_scaling,
                    "warmup_epochs": args.warmup_epochs, "tool": f"hpccomm {hpccomm.__version__}"}
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump({"meta": meta, "runs": runs}, f, indent=1)
    ok = all(r["weights_identical"] for r in runs)
    return 0 if ok else 3


if __name__ == "__main__":
    sys.exit(main())
