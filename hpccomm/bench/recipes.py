"""Training set-ups of the accuracy study: each model's fp32 hyper-parameters,
each codec's recipe from its paper, and the learning-rate grid.

Two protocols (``train --recipe``):

``same``
    every codec with fp32's hyper-parameters and its default options (error
    feedback on for biased codecs); only DGC keeps its momentum correction
    and TernGrad its full-precision last layer (``--dgc-momentum auto``,
    ``--fp-last-layer auto``), as the harness always did.
``paper``
    the codec's recipe (:data:`PAPER`) and the learning rate chosen for it
    on the validation split from :data:`LR_GRID` (the same grid, scaled from
    the model's fp32 rate, for every codec and for fp32).  The choices live
    in ``lr_chosen.json`` beside this module, written by
    ``python -m hpccomm.bench lrgrid`` (see :mod:`hpccomm.bench.lrgrid`);
    ``--lr-table FILE`` reads another one.
"""
from __future__ import annotations

import json
import os
from typing import Dict, NamedTuple, Optional

#: learning-rate multipliers of the grid: the same for every codec and fp32
LR_GRID = (0.5, 1.0, 2.0)

#: where ``lrgrid`` writes, and ``--recipe paper`` reads, the chosen rates
LR_TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lr_chosen.json")


class ModelSetup(NamedTuple):
    """A model's fp32 hyper-parameters (the learning rate is per rank when
    ``lr_scaling``: multiplied by the ranks, Goyal et al.)."""
    dataset: str
    samples: int
    optimizer: str          # "sgd" (with momentum) or "adam"
    lr: float
    lr_scaling: bool
    batch: int              # samples (sequences) per rank per step at P = 4
    epochs: int             # for charlm: evaluation rounds of ``steps_per_epoch`` steps
    steps_per_epoch: Optional[int]
    warmup_epochs: float
    weight_decay: float
    metric: str             # "accuracy" (higher is better) or "loss" (bits per char)


#: ``--optimizer`` values that are hpccomm.optim's compressed Adams: they reduce
#: by themselves (torch models, through a GradReducer's buckets)
COMPRESSED_ADAMS = ("onebit_adam", "zero_one_adam")

MODELS: Dict[str, ModelSetup] = {
    "mlp": ModelSetup("digits", 5000, "sgd", 0.02, True, 16, 30, None, 2.0, 0.0, "accuracy"),
    "cnn": ModelSetup("mnist1d", 10000, "sgd", 0.0125, True, 32, 12, None, 1.0, 5e-4,
                      "accuracy"),
    "charlm": ModelSetup("stdlib", 0, "adam", 3e-3, False, 8, 8, 50, 0.5, 0.0, "loss"),
}


class Recipe(NamedTuple):
    """How a codec's paper trains with it."""
    options: dict                   # codec options
    error_feedback: Optional[bool]  # None: the codec's default (on when biased)
    fp_last_layer: bool             # the last layer reduced dense
    layerwise: bool                 # one bucket (one scale / threshold) per tensor
    dgc_momentum: bool              # DGC's momentum correction, masking, warm-up
    source: str


PAPER: Dict[str, Recipe] = {
    "none": Recipe({}, None, False, False, False, "fp32 through MPI_Allreduce"),
    "fp16": Recipe({}, None, False, False, False, "IEEE half precision"),
    "bf16": Recipe({}, None, False, False, False, "bfloat16"),
    "onebit": Recipe({}, True, False, True, False,
                     "Seide et al. 2014: error feedback, per-column scales of each tensor"),
    "terngrad": Recipe({"clip": 2.5}, False, True, True, False,
                       "Wen et al. 2017: layer-wise scalers, clipping at 2.5 sigma, "
                       "full-precision last layer"),
    "qsgd": Recipe({"bits": 4, "bucket": 512}, False, False, False, False,
                   "Alistarh et al. 2017: 4 bits, buckets of 512, unbiased (no memory)"),
    "threshold": Recipe({"alpha": 4.0}, True, False, True, False,
                        "Strom 2015: fixed per-tensor tau (4 RMS of the gradient), residual"),
    "topk": Recipe({"ratio": 0.01}, True, False, True, False,
                   "Aji & Heafield 2017: drop 99 % per tensor, residual"),
    "randk": Recipe({"ratio": 0.01, "unbiased": False}, True, False, True, False,
                    "Stich et al. 2018: random-k with memory, no rescaling"),
    "dgc": Recipe({"ratio": 0.001}, None, False, True, True,
                  "Lin et al. 2018: momentum correction, factor masking, "
                  "exponential sparsity warm-up over 4 epochs"),
    "powersgd": Recipe({"rank": 2, "warm_start": True}, True, False, False, False,
                       "Vogels et al. 2019: rank 2, warm start, error feedback"),
}


def recipe(codec: str) -> Recipe:
    if codec not in PAPER:
        raise SystemExit(f"no paper recipe for codec {codec!r}; recipes exist for "
                         f"{', '.join(sorted(PAPER))}")
    return PAPER[codec]


def grid(model: str) -> list:
    """The learning rates the grid tries for ``model`` (per rank when scaled)."""
    return [MODELS[model].lr * m for m in LR_GRID]


def table_key(codec: str, error_feedback: str = "auto") -> str:
    return codec if error_feedback == "auto" else f"{codec}:ef={error_feedback}"


def table_model(model: str, dataset: str = "digits") -> str:
    """The table's entry for a model (the MLP's per dataset)."""
    return f"mlp-{dataset}" if model == "mlp" else model


def load_table(path: Optional[str] = None) -> dict:
    path = path or LR_TABLE
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def chosen_lr(model: str, codec: str, error_feedback: str = "auto",
              path: Optional[str] = None) -> float:
    """The validation-chosen learning rate of ``codec`` on ``model``
    (:func:`table_model`)."""
    table = load_table(path)
    key = table_key(codec, error_feedback)
    try:
        return float(table[model][key]["lr"])
    except KeyError:
        raise SystemExit(
            f"no validation-chosen learning rate for {key} on {model} in "
            f"{path or LR_TABLE}; run: mpiexec -n 4 python -m hpccomm.bench lrgrid "
            f"--model {model.split('-')[0]} --codec {codec}") from None


def dgc_transport(algorithm: str, options: dict):
    """``(codec, options)`` that carry DGC's recipe: ``DGCMomentum`` selects
    (with DGC's sampled threshold, at the warm-up density), and the reducer
    must deliver exactly that selection -- ``topk`` keeping every non-zero,
    without error feedback (DGC's accumulation is its memory).  The
    algorithm's options pass through; the codec's are DGC's, not topk's."""
    from ..options import resolve_options

    _, kept = resolve_options(None, algorithm, options, strict=False)
    return "topk", {**kept, "ratio": 1.0}


def lr_at(step: int, steps_per_epoch: int, args, nranks: int) -> float:
    """Linear scaling with gradual warm-up (Goyal et al.)."""
    target = args.lr * (nranks if args.lr_scaling else 1)
    warm = args.warmup_epochs * steps_per_epoch
    if warm and step < warm:
        return args.lr + (target - args.lr) * step / warm
    return target


def dgc_described(args) -> str:
    """DGC's optimizer side, as the results name it."""
    clip = "" if args.dgc_clip_norm is None else f",clip={args.dgc_clip_norm:g}"
    return f"dgc(ratio={args.dgc_ratio},warmup={args.dgc_warmup_epochs}{clip})"
