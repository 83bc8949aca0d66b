"""The training harness's torch path (``train --model cnn|charlm``): one
training loop, two ways to average the gradients.

``--runner hpccomm`` (default)
    :class:`hpccomm.torch_grads.GradReducer` with the codec, algorithm, error
    feedback and options of the run, ``overlap=True`` unless ``--no-overlap``
    (the buckets are reduced while backward still runs).  DGC's recipe
    selects with :class:`hpccomm.dgc_optimizer.DGCMomentum` after backward,
    so it runs without overlap.
``--runner ddp``
    ``torch.nn.parallel.DistributedDataParallel`` over gloo, with one of its
    own communication hooks (``--ddp-hook none|fp16|powersgd``): what a PyTorch
    user would pick instead.  The process group is set up from MPI (rank 0's
    address -- the one of ``GLOO_SOCKET_IFNAME`` when set -- and a free port,
    broadcast); MPI itself only synchronises the clock and compares weights.

Both runners see the same model, initial weights, data order, optimizer and
learning-rate schedule (and, with ``--meprop K``, the same sparsified
back-propagation, :mod:`hpccomm.bench.meprop`).  The clock (``time`` in each
history entry) counts training steps only: it stops, behind a barrier, while
rank 0 evaluates on the validation split.  At the end every rank hashes its weights; the run
fails unless all hashes agree.
"""
from __future__ import annotations

import functools
import math
import socket
import time
from typing import Dict, List

import numpy as np

from .datasets import eval_windows, load_dataset, stdlib_corpus, windows
from .meprop import attach as attach_meprop
from .models import torch_digest, torch_model
from .probe import GradientProbe
from .recipes import COMPRESSED_ADAMS, dgc_described, dgc_transport, lr_at

LN2 = math.log(2.0)
CONTEXT = 64


class Data:
    """The batches of one run: the same on every rank for a given seed."""

    def __init__(self, model: str, setup, val_windows: int = 256, test_windows: int = 1024):
        self.lm = model == "charlm"
        if self.lm:
            corpus = stdlib_corpus()
            self.text = corpus["train"]
            self.val = eval_windows(corpus["validation"], CONTEXT, val_windows)
            self.test = eval_windows(corpus["test"], CONTEXT, test_windows)
        else:
            s = load_dataset(setup.dataset, setup.samples)
            self.x, self.y = s.x_train, s.y_train
            self.val, self.test = (s.x_val, s.y_val), (s.x_test, s.y_test)

    def steps_per_epoch(self, per_step: int, setup) -> int:
        if self.lm:
            return setup.steps_per_epoch
        return max(1, len(self.x) // per_step)

    def epoch_order(self, seed: int, epoch: int):
        if self.lm:
            return None
        return np.random.default_rng([seed, epoch, 777]).permutation(len(self.x))

    def batch(self, seed: int, step: int, s: int, order, per_step: int, rank: int, size: int):
        if self.lm:
            starts = np.random.default_rng([seed, step, 777]).integers(
                0, len(self.text) - CONTEXT - 1, per_step)
            return windows(self.text, starts[rank::size], CONTEXT)
        idx = order[s * per_step:(s + 1) * per_step][rank::size]
        return self.x[idx], self.y[idx]


def evaluate(torch, net, data: Data, split) -> float:
    """Accuracy (classification) or loss in bits per character (language)."""
    x, y = split
    with torch.no_grad():
        net.eval()
        out = net(torch.from_numpy(x))
        net.train()
        if data.lm:
            loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]),
                                                     torch.from_numpy(y).reshape(-1))
            return float(loss) / LN2
        return float((out.argmax(1).numpy() == y).mean())


def _interface_address(name: str) -> str:
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
    return socket.inet_ntoa(packed[20:24])


def init_gloo(comm) -> None:
    """A gloo process group with MPI's ranks, bootstrapped through MPI."""
    import os

    import torch.distributed as dist

    if dist.is_initialized():
        return
    where = None
    if comm.Get_rank() == 0:
        iface = os.environ.get("GLOO_SOCKET_IFNAME")
        addr = _interface_address(iface) if iface else "127.0.0.1"
        with socket.socket() as s:
            s.bind((addr, 0))
            where = (addr, s.getsockname()[1])
    addr, port = comm.bcast(where, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}",
                            rank=comm.Get_rank(), world_size=comm.Get_size())


def dense_bucket(reducer, index: int, flat):
    """A GradReducer's bucket ``index`` through its dense reducer (``MPI_Allreduce``),
    under keys of its own: the codec's state, residuals included, is left as it was."""
    b = reducer.buckets[index]
    target = flat.reshape(b.shape)
    return reducer.dense_reducer.start(target, key=f"warmup/{b.key}", out=target)


def train_torch(comm, data: Data, codec: str, algorithm: str, seed: int, args) -> dict:
    """One run (see the module docstring); ``args`` carries the resolved
    hyper-parameters and recipe (``train.resolve``)."""
    import torch
    from mpi4py import MPI

    from hpccomm.errors import NonFiniteError

    torch.set_num_threads(1)
    rank, size = comm.Get_rank(), comm.Get_size()
    net = torch_model(args.model, seed)
    if args.meprop:
        attach_meprop(net, args.meprop)       # sparsified back-propagation
    params = dict(net.named_parameters())
    names = list(params)
    reducer, dgc, compressed, ddp = None, None, [], None
    compressed_adam = args.optimizer in COMPRESSED_ADAMS
    if compressed_adam:
        # the optimizer reduces, in a plain GradReducer's buckets: the mean
        # gradient at exact steps, its own compressed payloads at the others;
        # each compressed tensor in its own bucket (onebit's columns follow its shape)
        from hpccomm.torch_grads import GradReducer

        reducer = GradReducer(net, comm, codec="none", op="mean", bucket_bytes=0,
                              min_compress=args.min_compress, overlap=args.overlap)
        forward = net
    elif args.runner == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        init_gloo(comm)
        # DDP's PowerSGD hook on gloo is racy with several buckets: each bucket's
        # hook chains its second allreduce in a callback, and the ranks' callbacks
        # interleave the buckets' collectives differently (gloo: "collective
        # mismatch").  One bucket holding the whole model avoids it.
        model_mb = sum(p.numel() for p in net.parameters()) * 4 / 2 ** 20
        ddp = DistributedDataParallel(
            net, bucket_cap_mb=model_mb + 1 if args.ddp_hook == "powersgd" else 25,
            broadcast_buffers=False)     # the models' only buffer is a constant mask
        if args.ddp_hook == "fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif args.ddp_hook == "powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

            state = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=args.ddp_rank,
                start_powerSGD_iter=2, use_error_feedback=True, warm_start=True,
                random_seed=seed)
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        forward = ddp
    else:
        from hpccomm.torch_grads import GradReducer

        transport, ef, options = codec, args.ef, dict(args.options)
        if args.dgc:
            (transport, options), ef = dgc_transport(algorithm, options), False
        reducer = GradReducer(net, comm, codec=transport, algorithm=algorithm, op="mean",
                              bucket_bytes=0 if args.layerwise else args.bucket_bytes,
                              min_compress=args.min_compress,
                              dense=net.last_layer if args.fp_last else (),
                              overlap=args.overlap and not args.dgc and not args.probe_every,
                              staleness=args.staleness, error_feedback=ef, seed=seed, **options)
        compressed = [n for b in reducer.buckets if not b.dense for n in b.names]
        if args.dgc:
            from hpccomm.dgc_optimizer import DGCMomentum

            # with Adam (charlm) DGC keeps its accumulation, masking and warm-up;
            # its momentum correction is SGD's
            dgc = DGCMomentum({n: tuple(params[n].shape) for n in compressed},
                              momentum=args.momentum if args.optimizer == "sgd" else 0.0,
                              ratio=args.dgc_ratio, warmup_epochs=args.dgc_warmup_epochs,
                              clip_norm=args.dgc_clip_norm, nranks=size, seed=seed, rank=rank)
        forward = net
    if args.optimizer == "sgd":
        # DGC's selected tensors carry its momentum already
        groups = [{"params": [params[n] for n in names if n not in compressed or dgc is None],
                   "momentum": args.momentum},
                  {"params": [params[n] for n in compressed if dgc is not None], "momentum": 0.0}]
        opt = torch.optim.SGD([g for g in groups if g["params"]], lr=args.lr,
                              weight_decay=args.weight_decay)
    elif compressed_adam:
        from hpccomm import optim

        common = dict(lr=args.lr, weight_decay=args.weight_decay, comm=comm, codec=codec,
                      codec_options=dict(args.options), seed=seed,
                      error_feedback=args.ef is not False, grad_reducer=reducer)
        if args.optimizer == "onebit_adam":
            opt = optim.OneBitAdam(net.parameters(), freeze_step=args.freeze_step, **common)
        else:
            opt = optim.ZeroOneAdam(net.parameters(), var_freeze_step=args.freeze_step,
                                    var_update_scaler=args.var_update_scaler,
                                    local_step_scaler=args.local_step_scaler,
                                    local_step_clipper=args.local_step_clipper, **common)
    else:
        opt = torch.optim.Adam(net.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    loss_fn = torch.nn.functional.cross_entropy
    per_step = args.batch * size
    steps_per_epoch = data.steps_per_epoch(per_step, args)

    probe = GradientProbe(comm, args.probe_every if reducer is not None and dgc is None else 0)
    history: List[Dict] = []
    step, diverged_at, elapsed = 0, None, 0.0
    t_backward = 0.0
    comm.Barrier()
    t0 = time.perf_counter()
    # (DGC has its own warm-up; the compressed Adams, their exact steps)
    warmup = (args.dense_warmup_steps
              if reducer is not None and not compressed_adam and dgc is None else 0)
    for epoch in range(args.epochs):
        order = data.epoch_order(seed, epoch)
        losses = []
        for s in range(steps_per_epoch):
            if warmup and step in (0, warmup):     # --dense-warmup-steps: fp32 at first
                reducer.reduce_with(functools.partial(dense_bucket, reducer)
                                    if step < warmup else None)
            lr = lr_at(step, steps_per_epoch, args, size)
            for g in opt.param_groups:
                g["lr"] = lr
            x, y = data.batch(seed, step, s, order, per_step, rank, size)
            opt.zero_grad(set_to_none=False)      # keeps GradReducer's bucket views
            out = forward(torch.from_numpy(x))
            loss = loss_fn(out.reshape(-1, out.shape[-1]), torch.from_numpy(y).reshape(-1))
            finite = bool(torch.isfinite(loss))
            # a diverged run stops on every rank at the same step (one tiny collective)
            if not comm.allreduce(finite, op=MPI.LAND):
                diverged_at = step
                break
            tb = time.perf_counter()
            loss.backward()
            try:
                if dgc is not None:
                    selected = dgc.accumulate({n: params[n].grad.numpy() for n in compressed},
                                              epoch=epoch)
                    with torch.no_grad():
                        for n, v in selected.items():
                            params[n].grad.copy_(torch.from_numpy(v))
                    reducer()
                    dgc.sent(selected)
                elif reducer is not None:
                    probing = probe.active(step)
                    if probing:
                        probe.before([params[n].grad.numpy() for n in names])
                    reducer()
                    if probing:
                        probe.after([params[n].grad.numpy() for n in names])
            except NonFiniteError:         # raised on every rank alike
                diverged_at = step
                break
            t_backward += time.perf_counter() - tb
            # with --staleness the first S steps deliver no gradient: nothing to apply
            if reducer is None or reducer.delivered:
                try:
                    opt.step()
                except NonFiniteError:     # OneBitAdam's reductions: on every rank alike
                    diverged_at = step
                    break
            losses.append(loss.item())
            step += 1
        if diverged_at is not None:
            break
        if args.optimizer == "zero_one_adam" and epoch == args.epochs - 1:
            opt.synchronize()     # the end: the local steps since the last synchronization
        # the clock stops while rank 0 evaluates
        comm.Barrier()
        elapsed += time.perf_counter() - t0
        mean_loss = comm.allreduce(float(np.mean(losses)), op=MPI.SUM) / size
        val = evaluate(torch, net, data, data.val) if rank == 0 else None
        val = comm.bcast(val, root=0)
        history.append({"epoch": epoch + 1, "step": step, "time": elapsed,
                        "train_loss": mean_loss / (LN2 if data.lm else 1.0), "val": val})
        comm.Barrier()
        t0 = time.perf_counter()
    test = evaluate(torch, net, data, data.test) if rank == 0 and diverged_at is None else None
    test = comm.bcast(test, root=0)
    if reducer is not None:
        try:                         # --staleness: the last S steps are never applied
            reducer.discard_in_flight()
        except NonFiniteError:       # a diverged run's steps in flight
            pass
    digests = comm.allgather(torch_digest(net))
    result = {"history": history, "test": test, "diverged_at_step": diverged_at,
              "steps": step, "weights_identical": len(set(digests)) == 1, "digest": digests[0],
              "t_train": elapsed, "t_backward_reduce": comm.allreduce(t_backward, op=MPI.MAX)}
    if probe.every:
        result["probe"] = probe.summary()
    if compressed_adam:
        sent = reducer.bytes_sent + opt.dense.stats.bytes_sent + opt.compressed.stats.bytes_sent
        result["bytes_sent_per_rank"] = comm.allreduce(sent, op=MPI.MAX)
        result["buckets"] = reducer.plan()
        policy = (f"freeze_step={opt.freeze_step}" if args.optimizer == "onebit_adam" else
                  f"var_freeze_step={opt.var_freeze_step}, kappa={opt.var_update_scaler}, "
                  f"alpha={opt.local_step_scaler}, clip={opt.local_step_clipper}")
        result["codec"] = f"{args.optimizer}({opt.compressed.codec.describe()}, {policy})"
        result["error_feedback"] = opt.compressed.memory.enabled
        result["rounds"] = opt.rounds
    elif reducer is not None:
        result["bytes_sent_per_rank"] = comm.allreduce(reducer.bytes_sent, op=MPI.MAX)
        result["buckets"] = reducer.plan()
        result["codec"] = reducer.reducer.codec.describe()
        if dgc is not None:
            result["codec"] = f"{dgc_described(args)}+{result['codec']}"
        result["error_feedback"] = reducer.reducer.memory.enabled
    else:
        result["codec"] = f"ddp-{args.ddp_hook}"
        result["error_feedback"] = args.ddp_hook == "powersgd"
    if ddp is not None:
        import torch.distributed as dist

        dist.barrier()
    return result
