"""hpccomm as a DDP communication hook, under mpiexec, with a gloo process
group whose ranks are the MPI ranks (env-free tcp:// rendezvous on loopback,
the port chosen by rank 0 and broadcast over MPI)."""
import socket

import numpy as np
import pytest

from .helpers import COMM, RANK, SIZE, digest, same_on_all_ranks

pytestmark = [pytest.mark.mpi, pytest.mark.narrow]
torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from hpccomm.torch_ddp import DDPHookState, hpccomm_hook  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def gloo_group():
    port = None
    if RANK == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = COMM.bcast(port)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=RANK,
                            world_size=SIZE)
    yield
    dist.destroy_process_group()


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(40, 64, bias=False), torch.nn.Linear(64, 8))


def integer_batch(step):
    """Inputs that make every gradient an integer multiple of 60, so that a
    division by P <= 6 before or after the sum is exact."""
    rng = np.random.default_rng([step, RANK])
    return torch.from_numpy(60.0 * rng.integers(-3, 4, size=(5, 40)).astype(np.float32))


def grads_after_steps(hook_state, steps=3, integer=True):
    net = make_model()
    if integer:
        with torch.no_grad():
            for p in net.parameters():
                p.copy_(torch.round(p * 4))
    model = DDP(net, bucket_cap_mb=0.01)   # several buckets
    if hook_state is not None:
        model.register_comm_hook(hook_state, hpccomm_hook)
    out = []
    for step in range(steps):
        model.zero_grad()
        x = integer_batch(step)
        model(x).sum().backward()
        out.append([digest(p.grad.numpy()) for p in model.parameters()])
    return out, [p.grad.numpy().copy() for p in model.parameters()]


def test_none_codec_hook_gives_ddps_gradients():
    """codec="none" through the hook equals DDP's own gloo allreduce bit for
    bit (exact on these integer-valued gradients)."""
    want, _ = grads_after_steps(None)
    state = DDPHookState(codec="none", algorithm="mpi", min_compress=1)
    got, _ = grads_after_steps(state)
    assert got == want
    assert state.reducer.stats.calls >= 3


@pytest.mark.parametrize("codec,algorithm", [("onebit", "twoshot"), ("topk", "allgather"),
                                             ("bf16", "twoshot")])
def test_compressed_hook_is_used_and_identical_on_every_rank(codec, algorithm):
    state = DDPHookState(codec=codec, algorithm=algorithm, min_compress=1000)
    got, grads = grads_after_steps(state, integer=False)
    want, _ = grads_after_steps(None, integer=False)
    assert state.reducer.stats.calls >= 3 and state.dense.stats.calls == 0
    assert all(same_on_all_ranks(g) for g in grads)
    assert all(np.isfinite(g).all() for g in grads)
    if codec != "bf16":                              # lossy: not DDP's gradients
        assert got[0] != want[0]
    # buckets below min_compress go dense: then exactly DDP's own allreduce
    small = DDPHookState(codec=codec, algorithm=algorithm, min_compress=10**9)
    dense_got, _ = grads_after_steps(small, integer=True)
    assert small.reducer.stats.calls == 0 and small.dense.stats.calls >= 3
    assert dense_got == grads_after_steps(None, integer=True)[0]


def test_hook_error_reaches_ddp_on_every_rank():
    """A NaN gradient on one rank under a lossy codec: the hook's future
    carries the NonFiniteError, which DDP raises from backward (as a
    RuntimeError with its message) on every rank."""
    from .helpers import raise_everywhere

    model = DDP(make_model(), bucket_cap_mb=0.01)
    model.register_comm_hook(DDPHookState(codec="onebit", algorithm="twoshot",
                                          min_compress=256), hpccomm_hook)
    x = integer_batch(0)
    if RANK == SIZE - 1:
        x[0, 0] = float("nan")

    def step():
        model(x).sum().backward()

    (name, message), same = raise_everywhere(step)
    assert same and name is not None, message
    assert f"rank {SIZE - 1}: input holds" in message and "NaN/Inf" in message, message


@pytest.mark.parametrize("rank", [1, 2])
def test_powersgd_sends_what_pytorchs_powersgd_hook_counts(rank):
    """The same model through PyTorch's ``powerSGD_hook`` and through hpccomm's
    ``powersgd`` (one bucket, two dense steps, then two compressed): the
    elements after compression PyTorch counts equal hpccomm's wire floats,
    and both equal ``r (n + m)`` per weight matrix plus the bias, per step."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    def train(register, calls=None):
        model = DDP(make_model(), bucket_cap_mb=25)      # one bucket
        register(model)
        for step in range(4):
            model.zero_grad()
            model(integer_batch(step)).sum().backward()
            if calls is not None:
                calls.append(ours.reducer.stats.last)
        return [p.grad.numpy().copy() for p in model.parameters()]

    theirs = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                start_powerSGD_iter=2, min_compression_rate=2)
    train(lambda m: m.register_comm_hook(theirs, psgd.powerSGD_hook))
    ours = DDPHookState(codec="powersgd", rank=rank, start_iter=2, min_compress=1)
    calls = []
    grads = train(lambda m: m.register_comm_hook(ours, hpccomm_hook), calls)
    compressed = [c.extra["wire_floats"] for c in calls if "matrices" in c.extra["powersgd"]]
    # Linear(40, 64): weight 64 x 40; Linear(64, 8): weight 8 x 64 and bias 8
    per_step = rank * (64 + 40) + rank * (8 + 64) + 8
    assert compressed == [per_step, per_step]
    assert theirs.compression_stats()[2] == 2 * per_step
    assert all(same_on_all_ranks(g) for g in grads)
