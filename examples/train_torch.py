"""Data-parallel PyTorch training with hpccomm-compressed gradients.

    mpiexec -n 4 python -m mpi4py examples/train_torch.py --codec onebit --epochs 10

Every rank builds the same model (same seed), trains on its shard of each
global minibatch, and reduces the gradients with hpccomm after backward():
a copy-paste template for an existing mpi4py + torch training script.
Needs torch and scikit-learn (pip install 'hpccomm[torch,train]').
"""
import argparse
import hashlib

import numpy as np
import torch
from mpi4py import MPI

from hpccomm.torch_grads import GradReducer


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--codec", default="onebit")
    ap.add_argument("--algorithm", default="twoshot")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    ap.add_argument("--lr", type=float, default=0.05)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size

    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target)
    perm = np.random.default_rng(0).permutation(len(x))
    train, test = perm[:1400], perm[1400:]

    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # the last layer stays full precision; small and 1-D tensors go dense
    reducer = GradReducer(model, comm, codec=args.codec, algorithm=args.algorithm, op="mean",
                          min_compress=256, dense=("4.weight", "4.bias"))
    steps = len(train) // (args.batch * size)
    for epoch in range(args.epochs):
        order = np.random.default_rng(epoch).permutation(train)
        for s in range(steps):
            idx = order[s * args.batch * size:(s + 1) * args.batch * size][rank::size]
            opt.zero_grad(set_to_none=False)
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            reducer()  # gradients averaged over ranks, in place
            opt.step()
        with torch.no_grad():
            acc = (model(x[test]).argmax(1) == y[test]).float().mean().item()
        if rank == 0:
            print(f"epoch {epoch + 1}: loss {loss.item():.4f} test accuracy {acc:.4f}", flush=True)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    identical = len(set(comm.allgather(hashlib.sha256(flat.tobytes()).hexdigest()))) == 1
    if rank == 0:
        print(f"weights identical on all {size} ranks: {identical}")
        stats, dense_stats = reducer.stats
        print(f"compressed: {stats}\ndense:      {dense_stats}")


if __name__ == "__main__":
    main()
