"""The training harness's offline datasets, each with a fixed
train / validation / test split (the same for every training seed).

* ``digits``: scikit-learn's 1797 real 8x8 digits; 80 % / 20 % train / test
  (the split the accuracy study always used), the last 15 % of the training
  part held out for validation.
* ``mnist1d``: generated procedurally by the ``mnist1d`` package (nothing is
  downloaded): ``samples`` examples, the package's 80 % / 20 % train / test,
  15 % of the training part held out for validation.
* ``stdlib``: a character-level corpus made of a fixed list of Python
  standard-library source files (:data:`STDLIB_FILES`), present in every
  Python installation; split *by file* so that no file contributes to two
  splits.  Bytes >= 128 become 0 (the vocabulary is ASCII, 128 symbols).

Hyper-parameters are chosen on validation, never on test.  Features are
standardized with the training part's mean and standard deviation.
"""
from __future__ import annotations

import os
import sysconfig
from typing import Dict, List, NamedTuple

import numpy as np

VALIDATION = 0.15

#: (train, validation, test) files of the ``stdlib`` corpus, relative to the
#: standard library's directory; every one of them exists since Python 3.8
STDLIB_FILES = {
    "train": ["argparse.py", "ast.py", "calendar.py", "collections/__init__.py",
              "configparser.py", "csv.py", "dataclasses.py", "datetime.py", "difflib.py",
              "enum.py", "fractions.py", "functools.py", "gettext.py", "heapq.py",
              "inspect.py", "ipaddress.py", "locale.py", "logging/__init__.py", "pathlib.py",
              "pickle.py", "pprint.py", "random.py", "shutil.py", "statistics.py",
              "string.py", "subprocess.py", "tarfile.py", "threading.py"],
    "validation": ["textwrap.py", "typing.py"],
    "test": ["zipfile.py", "_pydecimal.py", "imaplib.py"],
}


class Split(NamedTuple):
    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def _hold_out(x, y, fraction: float = VALIDATION):
    cut = len(x) - int(round(fraction * len(x)))
    return x[:cut], y[:cut], x[cut:], y[cut:]


def load_dataset(name: str, samples: int = 5000) -> Split:
    """A classification dataset as float32 features and int64 labels."""
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
    xtr, ytr, xva, yva = _hold_out(xtr, ytr)
    mean, std = xtr.mean(axis=0), xtr.std(axis=0) + 1e-6
    return Split((xtr - mean) / std, ytr, (xva - mean) / std, yva, (xte - mean) / std, yte)


def stdlib_corpus(root: str = None) -> Dict[str, np.ndarray]:
    """``{"train", "validation", "test"}``: each split's files concatenated as
    uint8 symbols in ``0..127``."""
    root = root or sysconfig.get_paths()["stdlib"]
    out = {}
    for split, files in STDLIB_FILES.items():
        parts: List[np.ndarray] = []
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                a = np.frombuffer(fh.read(), dtype=np.uint8).copy()
            a[a >= 128] = 0
            parts.append(a)
        out[split] = np.concatenate(parts)
    return out


def windows(text: np.ndarray, starts: np.ndarray, length: int):
    """``(x, y)`` int64 arrays of shape ``(len(starts), length)``: the symbols
    at ``starts + 0..length-1`` and the ones after them (next-symbol targets)."""
    idx = starts[:, None] + np.arange(length)[None, :]
    return text[idx].astype(np.int64), text[idx + 1].astype(np.int64)


def eval_windows(text: np.ndarray, length: int, count: int):
    """The first ``count`` non-overlapping windows of ``text`` (a fixed
    evaluation set; all of them when ``count`` exceeds what fits)."""
    n = min(count, (len(text) - 1) // length)
    return windows(text, np.arange(n) * length, length)
