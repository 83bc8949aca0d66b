"""hpccomm as a PyTorch DDP communication hook: any codec, one line.

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from hpccomm.torch_ddp import DDPHookState, hpccomm_hook

    dist.init_process_group("gloo", rank=MPI rank, world_size=MPI size, ...)
    model = DDP(net)
    model.register_comm_hook(DDPHookState(codec="onebit", algorithm="twoshot"), hpccomm_hook)

DDP hands the hook each gradient bucket (a flat float32 tensor) as soon as
backward has filled it; the hook starts its reduction through hpccomm over MPI
(:meth:`hpccomm.Allreducer.start`, the process's progress thread) and returns
a pending ``torch.futures.Future`` that the progress thread completes with the
bucket, reduced in place and divided by the number of ranks (DDP's average).
So buckets are reduced while backward still computes the next ones, as with
DDP's own allreduce.  The process group's ranks must be the MPI ranks (the
group itself carries only DDP's start-up broadcasts).

The bucket's layout (the shapes of ``bucket.gradients()``) goes with it, so
``codec="powersgd"`` compresses each weight matrix of the bucket as
PyTorch's own ``powerSGD_hook`` does.  Buckets smaller than
``min_compress`` elements go through a plain ``MPI_Allreduce`` (compressing
them saves nothing); names in the state's
``policy`` are not available here (DDP's buckets mix parameters) -- use
:class:`~hpccomm.torch_grads.GradReducer` for per-layer choices.  Each
bucket's error feedback is kept under the key ``ddp/<index>/<numel>``: DDP
rebuilds its buckets after the first iteration, and a rebuilt bucket starts
with a fresh residual instead of another bucket's.
"""
from typing import Any, Optional

import torch
import torch.distributed as dist

from .core import Allreducer


class DDPHookState:
    """The hook's state: the compressed and the dense reducer (``op="mean"``).
    Keyword arguments go to the compressed :class:`~hpccomm.Allreducer`."""

    def __init__(self, comm=None, *, codec: str = "none", algorithm: Optional[str] = None,
                 min_compress: int = 1024, **reducer_options: Any):
        self.reducer = Allreducer(comm, codec=codec, algorithm=algorithm, op="mean",
                                  **reducer_options)
        self.dense = Allreducer(comm, codec="none", algorithm="mpi", op="mean",
                                gpu_aware=reducer_options.get("gpu_aware", "auto"),
                                on_error=reducer_options.get("on_error", "abort"))
        self.min_compress = int(min_compress)

    def __repr__(self) -> str:
        return f"DDPHookState({self.reducer.describe()}, min_compress={self.min_compress})"


def hpccomm_hook(state: DDPHookState,
                 bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook (``register_comm_hook(state, hpccomm_hook)``;
    DDP checks the return annotation, so it is a real one)."""
    tensor = bucket.buffer()
    n = tensor.numel()
    reducer = state.reducer if n >= state.min_compress else state.dense
    future: torch.futures.Future = torch.futures.Future()

    def complete(request) -> None:
        try:
            request.wait()
        except Exception as exc:  # noqa: BLE001 -- handed to DDP through the future
            future.set_exception(exc)
        else:
            future.set_result(tensor)

    layout = [tuple(g.shape) for g in bucket.gradients()] if reducer is state.reducer else None
    reducer.start(tensor, key=f"ddp/{bucket.index()}/{n}", out=tensor,
                  layout=layout).add_done_callback(complete)
    return future
