"""The CNN under a one-step delay in plain PyTorch, without hpccomm: the
delayed gradient of step t-1 applied at step t by a FIFO (what
staleness=1 delivers, bit for bit at one rank), 300 steps of batch 128 on
MNIST-1D, SGD with momentum 0.9 at the recipe's base rate (0.025) and its
rate scaled to P = 4 (0.1).  docs/results/accuracy.md, "Bounded staleness: accuracy".

    python docs/data/i19/delayed_sgd_plain.py
"""
import collections, numpy as np, torch
from hpccomm.bench import recipes
from hpccomm.bench.datasets import load_dataset
from hpccomm.bench.models import cnn1d
torch.set_num_threads(1)
s = load_dataset("mnist1d", recipes.MODELS["cnn"].samples)
for S in (0, 1):
  for lr, m in ((0.025, 0.9), (0.1, 0.9)):
    net = cnn1d(0); opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=m)
    fifo = collections.deque(); rng = np.random.default_rng(0); losses = []
    for step in range(300):
        idx = rng.integers(0, len(s.x_train), 128)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(torch.from_numpy(s.x_train[idx])), torch.from_numpy(s.y_train[idx]))
        loss.backward(); losses.append(loss.item())
        fifo.append([p.grad.clone() for p in net.parameters()])
        if len(fifo) > S:
            for p, g in zip(net.parameters(), fifo.popleft()): p.grad.copy_(g)
            opt.step()
    print("S", S, "lr", lr, "m", m, "loss first/last 50:", round(np.mean(losses[:50]),3), round(np.mean(losses[-50:]),3))
