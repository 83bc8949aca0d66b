"""The torch training harness on real MPI: tiny runs of the CNN and the
character-level model through hpccomm and through PyTorch DDP."""
import functools

import pytest

from .helpers import COMM, SIZE

# the harness's plumbing at 1-3 ranks (what it trains through is tested further);
# narrow: tests/run.py's runs at more ranks do not import this file (torch, mnist1d)
pytestmark = [pytest.mark.mpi, pytest.mark.narrow,
              pytest.mark.skipif(SIZE > 3, reason="the harness is checked at 1-3 ranks")]
torch = pytest.importorskip("torch")
pytest.importorskip("mnist1d")


@functools.lru_cache(maxsize=None)
def _data(model):
    from hpccomm.bench import recipes
    from hpccomm.bench.torch_train import Data

    data = Data(model, recipes.MODELS[model]._replace(samples=300), val_windows=8,
                test_windows=8)
    if model == "cnn":      # a few steps are enough
        data.x, data.y = data.x[:24 * SIZE], data.y[:24 * SIZE]
    return data


def _run(model, codec, *argv):
    from hpccomm.bench.torch_train import train_torch
    from hpccomm.bench.train import algorithm_for, build_parser, resolve

    args = build_parser().parse_args(["--model", model, "--epochs", "2", "--batch", "4",
                                      "--steps-per-epoch", "3", *argv])
    args.hidden, args.options = [], {}
    data = _data(model)
    return train_torch(COMM, data, codec, algorithm_for(codec, args), 3, resolve(args, codec))


def test_cnn_overlap_is_bit_identical_and_the_ranks_agree():
    on = _run("cnn", "onebit", "--recipe", "same")
    off = _run("cnn", "onebit", "--recipe", "same", "--no-overlap")
    assert on["weights_identical"] and off["weights_identical"]
    assert on["digest"] == off["digest"]
    assert len(on["history"]) == 2 and on["history"][1]["time"] >= on["history"][0]["time"]
    assert 0.0 <= on["test"] <= 1.0 and (SIZE == 1 or on["bytes_sent_per_rank"] > 0)


def test_cnn_staleness_keeps_the_ranks_in_lockstep():
    stale = _run("cnn", "terngrad", "--recipe", "same", "--staleness", "1")
    sync = _run("cnn", "terngrad", "--recipe", "same")
    assert stale["weights_identical"] and stale["steps"] == sync["steps"] > 1
    assert stale["digest"] != sync["digest"]     # delayed updates, one fewer


@pytest.mark.slow
def test_cnn_dgc_recipe_and_compression_changes_the_result():
    dgc = _run("cnn", "dgc", "--recipe", "same")
    fp32 = _run("cnn", "none", "--recipe", "same")
    assert dgc["weights_identical"] and fp32["weights_identical"]
    if SIZE > 1:     # a run that ignored the codec would land on fp32's weights
        assert dgc["digest"] != fp32["digest"]
        assert dgc["bytes_sent_per_rank"] < fp32["bytes_sent_per_rank"]


@pytest.mark.slow
def test_charlm_reports_bits_per_character():
    r = _run("charlm", "powersgd", "--recipe", "same")
    assert r["weights_identical"] and r["steps"] == 6
    # an untrained model over 128 symbols: about 7 bits per character
    assert 4.0 < r["history"][0]["val"] < 8.0 and 4.0 < r["test"] < 8.0


@pytest.mark.slow
@pytest.mark.skipif(SIZE < 2, reason="DDP needs two ranks")
@pytest.mark.parametrize("hook", ["fp16", "powersgd"])
def test_ddp_runner_with_its_hooks(hook):
    r = _run("cnn", "none", "--runner", "ddp", "--ddp-hook", hook)
    assert r["weights_identical"] and r["codec"] == f"ddp-{hook}"
    fp32 = _run("cnn", "none")
    assert r["digest"] != fp32["digest"]        # the hook compressed


def test_cnn_meprop_keeps_the_ranks_agreeing_and_the_full_width_is_plain_backprop():
    plain = _run("cnn", "none")
    full = _run("cnn", "none", "--meprop", "512")
    sparse = _run("cnn", "none", "--meprop", "8")
    assert plain["weights_identical"] and full["weights_identical"] and sparse["weights_identical"]
    assert full["digest"] == plain["digest"]        # K = fc1's width: nothing dropped
    assert sparse["digest"] != plain["digest"]
    # codec none with a named sparse algorithm: the gradient's non-zeros, exactly
    exact = _run("cnn", "none", "--meprop", "8", "--algorithm", "sparse_allgather")
    assert exact["weights_identical"] and exact["codec"] == sparse["codec"]
    if SIZE > 1:
        assert exact["bytes_sent_per_rank"] < sparse["bytes_sent_per_rank"]


def test_train_command_records_meprop_and_refuses_a_bad_k_on_every_rank(tmp_path):
    import json

    from hpccomm.bench.train import main

    out = COMM.bcast(str(tmp_path / "meprop.json"), root=0)
    small = ["--model", "cnn", "--samples", "300", "--epochs", "1", "--batch", "8"]
    assert main([*small, "--meprop", "16", "-J", out]) == 0
    COMM.Barrier()
    with open(out, encoding="utf-8") as f:
        run = json.load(f)["runs"][0]
    assert run["meprop"] == 16 and run["weights_identical"]
    for bad, match in [("513", "512"), ("-2", "positive")]:
        with pytest.raises(SystemExit, match=match):
            main([*small, "--meprop", bad])


def test_cnn_with_onebit_adam_compresses_after_the_freeze():
    """``--optimizer onebit_adam``: the optimizer reduces by itself (exact Adam
    for 2 steps, then the momentum in one bit); the ranks agree, fewer bytes
    go out than with Adam on the dense gradient, and the weights differ from
    a run that never freezes within its 12 steps (a small learning rate: a
    2-step warm-up leaves v too noisy for more)."""
    args = ("--recipe", "same", "--optimizer", "onebit_adam", "--lr", "3e-5")
    ob = _run("cnn", "onebit", *args, "--freeze-step", "2")
    dense = _run("cnn", "onebit", *args, "--freeze-step", "100")
    assert ob["weights_identical"] and dense["weights_identical"]
    assert ob["diverged_at_step"] is None and ob["steps"] == dense["steps"] == 12
    assert ob["codec"].startswith("onebit_adam(onebit") and "freeze_step=2" in ob["codec"]
    if SIZE > 1:
        assert ob["digest"] != dense["digest"]
        assert ob["bytes_sent_per_rank"] < dense["bytes_sent_per_rank"]


def test_cnn_with_zero_one_adam_skips_rounds_and_ends_the_same_everywhere():
    """``--optimizer zero_one_adam``: exact steps on the variance schedule,
    compressed ones, then local steps from ``--freeze-step`` on (gaps 1, 1,
    2, 2, 4 with scaler 2 and clipper 4); the run's last step is local, and
    the harness's closing ``synchronize()`` leaves every rank the same bits."""
    zo = _run("cnn", "onebit", "--recipe", "same", "--optimizer", "zero_one_adam",
              "--lr", "3e-5", "--freeze-step", "4", "--var-update-scaler", "2",
              "--local-step-scaler", "2", "--local-step-clipper", "4")
    assert zo["weights_identical"] and zo["diverged_at_step"] is None and zo["steps"] == 12
    assert zo["codec"].startswith("zero_one_adam(onebit") and "alpha=2, clip=4" in zo["codec"]
    # T_v = {0, 1, 2}; T_u after the freeze: 4, 5, 7, 9, 13: local 6, 8, 10, 11
    assert zo["rounds"] == {"exact": 3, "compressed": 5, "local": 4}


def test_dense_warmup_steps_reduce_fp32_first():
    """``--dense-warmup-steps N``: the first N steps go through MPI_Allreduce.
    Longer than the run, it is the fp32 run bit for bit; shorter, it is
    neither fp32 nor the codec from the start."""
    fp32 = _run("cnn", "none", "--recipe", "same")
    onebit = _run("cnn", "onebit", "--recipe", "same")
    all_dense = _run("cnn", "onebit", "--recipe", "same", "--dense-warmup-steps", "100")
    some = _run("cnn", "onebit", "--recipe", "same", "--dense-warmup-steps", "4")
    assert all_dense["digest"] == fp32["digest"]
    assert some["weights_identical"] and some["digest"] not in (fp32["digest"], onebit["digest"])
    assert some["bytes_sent_per_rank"] > onebit["bytes_sent_per_rank"] or SIZE == 1


def test_dgc_local_gradient_clipping_is_applied_and_named():
    """``--dgc-clip-norm``: a small norm changes the run (the gradients are
    clipped before DGC accumulates them), the results name it, and the ranks
    still agree; a norm that is not positive is refused."""
    from hpccomm.bench.train import main

    plain = _run("cnn", "dgc", "--recipe", "paper")
    clipped = _run("cnn", "dgc", "--recipe", "paper", "--dgc-clip-norm", "0.01")
    assert clipped["weights_identical"] and "clip=0.01" in clipped["codec"]
    assert "clip" not in plain["codec"] and plain["codec"].startswith("dgc(")
    assert clipped["digest"] != plain["digest"]
    with pytest.raises(SystemExit, match="clip-norm"):
        main(["--model", "cnn", "--codec", "dgc", "--dgc-clip-norm", "0"])
