"""The training harness's models.

* :class:`MLP` -- numpy, for ``digits`` and ``mnist1d`` (``--model mlp``): the
  no-torch path, exactly reproducible.
* :func:`cnn1d` -- a 1-D CNN for MNIST-1D (``--model cnn``, torch): three
  convolutions (32, 64, 64 channels) and a 512-unit fully connected layer,
  684 k parameters (2.7 MB of float32 gradient, most of it in the first
  fully connected layer, as in AlexNet / VGG); 96-97 % test accuracy at fp32
  on 8000 MNIST-1D samples, the range the dataset's paper reports for CNNs
  (~94 % on 4000).
* :func:`char_transformer` -- a character-level language model
  (``--model charlm``, torch): a 2-layer pre-norm causal transformer, width
  96, 4 heads, context 64, vocabulary 128, 255 k parameters.

The torch models are built from a seed (the same initial weights on every
rank; :func:`torch_model` by name) and are float32; every model names its
last layer (``last_layer``), which TernGrad's recipe keeps in full precision,
and its hidden linear layers (``meprop_layers``), whose output gradients
``--meprop`` sparsifies (:mod:`hpccomm.bench.meprop`).
"""
from __future__ import annotations

import hashlib
from typing import Dict, List

import numpy as np


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


def torch_digest(module) -> str:
    """SHA-256 of a torch module's parameters, in name order."""
    h = hashlib.sha256()
    for name, p in sorted(module.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()


def cnn1d(seed: int, length: int = 40, classes: int = 10, channels: int = 32, hidden: int = 512):
    import torch
    from torch import nn

    class CNN1D(nn.Module):
        last_layer = ["fc2.weight", "fc2.bias"]
        meprop_layers = ["fc1"]          # its hidden layer (hpccomm.bench.meprop)

        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv1d(1, channels, 5, padding=2)
            self.conv2 = nn.Conv1d(channels, 2 * channels, 5, padding=2, stride=2)
            self.conv3 = nn.Conv1d(2 * channels, 2 * channels, 3, padding=1)
            self.fc1 = nn.Linear(2 * channels * ((length + 1) // 2), hidden)
            self.fc2 = nn.Linear(hidden, classes)

        def forward(self, x):
            h = torch.relu(self.conv1(x[:, None, :]))
            h = torch.relu(self.conv2(h))
            h = torch.relu(self.conv3(h)).flatten(1)
            return self.fc2(torch.relu(self.fc1(h)))

    torch.manual_seed(seed)
    return CNN1D()


def char_transformer(seed: int, vocab: int = 128, context: int = 64, width: int = 96,
                     layers: int = 2, heads: int = 4):
    import torch
    from torch import nn

    class CharTransformer(nn.Module):
        last_layer = ["head.weight", "head.bias"]
        # the feed-forward hidden layers (hpccomm.bench.meprop)
        meprop_layers = [f"blocks.{i}.linear1" for i in range(layers)]

        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.position = nn.Parameter(torch.zeros(context, width))
            self.blocks = nn.ModuleList(
                nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0,
                                           batch_first=True, norm_first=True)
                for _ in range(layers))
            self.norm = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocab)
            self.register_buffer("mask", torch.triu(
                torch.full((context, context), float("-inf")), diagonal=1), persistent=False)

        def forward(self, x):
            t = x.shape[1]
            h = self.embed(x) + self.position[:t]
            for block in self.blocks:
                h = block(h, src_mask=self.mask[:t, :t], is_causal=True)
            return self.head(self.norm(h))

    torch.manual_seed(seed)
    return CharTransformer()


def torch_model(name: str, seed: int):
    """The torch model of ``train --model name`` (``cnn`` or ``charlm``)."""
    return {"cnn": cnn1d, "charlm": char_transformer}[name](seed)
