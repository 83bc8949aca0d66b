"""The training harness's set-ups: recipes, the learning-rate table and grid,
the datasets' splits (no MPI)."""
import json

import numpy as np
import pytest

from hpccomm.bench import recipes
from hpccomm.bench.datasets import STDLIB_FILES, eval_windows, stdlib_corpus, windows
from hpccomm.bench.lrgrid import choose, score
from hpccomm.bench.train import build_parser, resolve


def _args(*argv):
    args = build_parser().parse_args(list(argv))
    args.options = {}
    return args


def test_same_recipe_keeps_fp32_hyper_parameters():
    run = resolve(_args("--model", "cnn"), "terngrad")
    cnn = recipes.MODELS["cnn"]
    assert (run.lr, run.epochs, run.batch, run.optimizer) == (cnn.lr, cnn.epochs, cnn.batch, "sgd")
    assert run.fp_last and not run.layerwise and not run.dgc and run.ef is None
    assert run.bucket_bytes == 25 << 20


def test_paper_recipe_applies_the_codecs_prescription(tmp_path):
    table = tmp_path / "lr.json"
    table.write_text(json.dumps({"cnn": {"terngrad": {"lr": 0.0063}, "dgc": {"lr": 0.02},
                                         "onebit:ef=off": {"lr": 0.1}, "qsgd": {"lr": 0.5}}}))
    args = _args("--model", "cnn", "--recipe", "paper", "--lr-table", str(table))
    tern = resolve(args, "terngrad")
    assert tern.lr == 0.0063 and tern.fp_last and tern.layerwise and tern.ef is False
    assert tern.options == {"clip": 2.5}
    dgc = resolve(args, "dgc")
    assert dgc.dgc and dgc.dgc_ratio == 0.001 and "ratio" not in dgc.options
    # the command line's options and error feedback win over the recipe's
    args.options = {"bits": 8}
    assert resolve(args, "qsgd").options == {"bits": 8, "bucket": 512}
    args.options = {}
    args.error_feedback = "off"
    control = resolve(args, "onebit")
    assert control.ef is False and control.lr == 0.1
    args.error_feedback = "auto"
    args.batch = recipes.MODELS["cnn"].batch // 4       # linear scaling with the batch
    assert resolve(args, "terngrad").lr == pytest.approx(0.0063 / 4)
    args.batch = None
    with pytest.raises(SystemExit, match="lrgrid"):
        resolve(args, "topk")                       # not in the table: says how to get it
    with pytest.raises(SystemExit, match="no paper recipe"):
        resolve(args, "adaptive")


def test_grid_is_the_same_size_for_every_model_and_scaled_from_fp32():
    for name, setup in recipes.MODELS.items():
        g = recipes.grid(name)
        assert len(g) == len(recipes.LR_GRID) and setup.lr in g


def test_the_choice_is_made_on_validation_and_divergence_loses():
    run = {"diverged_at_step": None, "history": [{"val": 0.80}, {"val": 0.90}], "test": 0.10}
    assert score(run, "accuracy") == 0.90              # the last validation value, never test
    assert score({**run, "diverged_at_step": 3}, "accuracy") == -np.inf
    assert score({**run, "history": [{"val": 2.5}]}, "loss") == -2.5
    assert choose({0.01: 0.5, 0.02: 0.9, 0.04: -np.inf}) == 0.02
    assert choose({0.01: 0.9, 0.02: 0.9}) == 0.01        # ties: the smaller rate


def test_stdlib_corpus_is_split_by_file():
    files = [f for fs in STDLIB_FILES.values() for f in fs]
    assert len(files) == len(set(files))
    corpus = stdlib_corpus()
    assert set(corpus) == {"train", "validation", "test"}
    for text in corpus.values():
        assert text.dtype == np.uint8 and text.max() < 128 and len(text) > 100_000


def test_windows_target_the_next_symbol():
    text = np.arange(50, dtype=np.uint8)
    x, y = windows(text, np.array([0, 7, 30]), 5)
    assert x.tolist()[1] == [7, 8, 9, 10, 11] and y.tolist()[1] == [8, 9, 10, 11, 12]
    x, y = eval_windows(text, 10, 100)                  # all that fit, without overlap
    assert x.shape == (4, 10) and x[-1, 0] == 30 and y[-1, -1] == 40


def test_time_to_accuracy_table():
    from hpccomm.bench.timetoacc import reached, table

    h = [{"val": 0.5, "time": 1.0}, {"val": 0.9, "time": 2.0}, {"val": 0.95, "time": 3.0}]
    assert reached(h, 0.9, loss=False) == 2.0 and reached(h, 0.99, loss=False) is None
    assert reached([{"val": 3.0, "time": 1.0}, {"val": 2.0, "time": 4.0}], 2.5, loss=True) == 4.0
    runs = [{"label": "none", "codec_name": "none", "history": h, "test": 0.9},
            {"label": "onebit", "codec_name": "onebit", "history": [{"val": 0.96, "time": 0.5}], "test": 0.9},
            {"label": "slow", "codec_name": "x", "history": [{"val": 0.2, "time": 9.0}], "test": 0.1}]
    out = table(runs, loss=False)
    assert "0.9500" in out.splitlines()[0]                 # fp32's final validation value
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert "6.00×" in rows["onebit"] and "not reached" in rows["slow"]
    assert "0.9000" in table(runs, loss=False, tolerance=0.05).splitlines()[0]


def test_time_to_accuracy_over_the_seeds_mean_curve():
    """Two seeds of fp32 end at 2.0 and 2.2 (target 2.1): the seed at 2.2
    never reaches it, so the median says "not reached"; the mean curve
    reaches it at the last evaluation, at the seeds' mean clock."""
    from hpccomm.bench.timetoacc import mean_curve, table

    def run(label, vals, times):
        return {"label": label, "codec_name": label, "test": 0.0,
                "history": [{"val": v, "time": t} for v, t in zip(vals, times)]}

    runs = [run("none", [3.0, 2.0], [1.0, 2.0]), run("none", [3.2, 2.2], [1.2, 2.4]),
            run("fast", [2.5, 2.1, 2.0], [0.5, 0.9, 1.3]),
            run("fast", [2.3, 2.05, 1.9], [0.4, 0.8, 1.2])]
    assert mean_curve(runs[:2])[1] == {"val": 2.1, "time": 2.2}
    rows = lambda out: {line.split("|")[1].strip(): line  # noqa: E731
                        for line in out.splitlines() if line.startswith("| ")}
    median = rows(table(runs, loss=True))
    assert "not reached" in median["none"] and "not reached" not in median["fast"]
    curve = rows(table(runs, loss=True, curve=True))
    assert "| 2.2 |" in curve["none"] and "| 0.9 |" in curve["fast"]
    assert "2.59×" in curve["fast"]           # 2.2 s / 0.85 s


def test_lrgrid_refuses_staleness(capsys):
    # its table is keyed by codec: a delayed run's rate would replace the codec's
    from hpccomm.bench import lrgrid

    with pytest.raises(SystemExit):
        lrgrid.main(["--model", "cnn", "--staleness", "1"])
    assert "--staleness" in capsys.readouterr().err
