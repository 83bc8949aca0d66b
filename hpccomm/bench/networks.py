"""Per-tensor parameter counts of networks users train data-parallel, built from
their published architecture definitions (every gradient tensor in the order the
forward pass creates it; backward produces them in reverse).

=============  ===========  ==============================================================
network        parameters   source of the definition
=============  ===========  ==============================================================
``resnet50``   25,557,032   He et al., CVPR 2016, Table 1 (50-layer, bottleneck blocks,
                            projection shortcuts), as torchvision's ``resnet50``
                            (batch-norm weight and bias per convolution, 1000 classes)
``vgg16``      138,357,544  Simonyan & Zisserman, ICLR 2015, configuration D, as
                            torchvision's ``vgg16`` (no batch norm, 4096-4096-1000 head)
``bert-base``  109,482,240  Devlin et al., NAACL 2019: 12 layers, hidden 768, 12 heads,
                            FFN 3072, vocabulary 30522, 512 positions, 2 segment types,
                            with the pooler (Hugging Face ``bert-base-uncased``)
``gpt2``       124,439,808  Radford et al. 2019, the 124M model: 12 layers, hidden 768,
                            vocabulary 50257, 1024 positions, tied output embedding
                            (Hugging Face ``gpt2``)
=============  ===========  ==============================================================

The totals are the ones those libraries report; ``tests/test_bench.py`` checks them.
"""
from __future__ import annotations

from typing import Callable, Dict, List


def _conv_bn(layers: List[int], cin: int, cout: int, k: int) -> None:
    layers += [cin * cout * k * k, cout, cout]          # conv weight (no bias), BN weight, bias


def resnet50() -> List[int]:
    layers: List[int] = []
    _conv_bn(layers, 3, 64, 7)
    cin = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            _conv_bn(layers, cin, width, 1)
            _conv_bn(layers, width, width, 3)
            _conv_bn(layers, width, 4 * width, 1)
            if b == 0:                                   # projection shortcut
                _conv_bn(layers, cin, 4 * width, 1)
            cin = 4 * width
    layers += [2048 * 1000, 1000]
    return layers


def vgg16() -> List[int]:
    layers: List[int] = []
    cin = 3
    for cout in (64, 64, 128, 128, 256, 256, 256, 512, 512, 512, 512, 512, 512):
        layers += [cin * cout * 9, cout]
        cin = cout
    for fin, fout in ((512 * 7 * 7, 4096), (4096, 4096), (4096, 1000)):
        layers += [fin * fout, fout]
    return layers


def _linear(layers: List[int], fin: int, fout: int) -> None:
    layers += [fin * fout, fout]


def bert_base() -> List[int]:
    h, ffn = 768, 3072
    layers = [30522 * h, 512 * h, 2 * h, h, h]           # embeddings and their layer norm
    for _ in range(12):
        for _ in range(4):                               # q, k, v, attention output
            _linear(layers, h, h)
        layers += [h, h]
        _linear(layers, h, ffn)
        _linear(layers, ffn, h)
        layers += [h, h]
    _linear(layers, h, h)                                # pooler
    return layers


def gpt2() -> List[int]:
    h = 768
    layers = [50257 * h, 1024 * h]                       # token (tied with the output), position
    for _ in range(12):
        layers += [h, h]
        _linear(layers, h, 3 * h)                        # fused q, k, v
        _linear(layers, h, h)
        layers += [h, h]
        _linear(layers, h, 4 * h)
        _linear(layers, 4 * h, h)
    layers += [h, h]                                     # final layer norm
    return layers


NETWORKS: Dict[str, Callable[[], List[int]]] = {
    "resnet50": resnet50, "vgg16": vgg16, "bert-base": bert_base, "gpt2": gpt2}
