"""Layouts the engine predicts but torch's APIs cannot compose: named before anything runs."""

from backend.support import composition_problems
from engine import Config
from gui.runnable import runnable_version


def cfg(**parallel):
    par = {"dp": 1, "tp": 2, "pp": 1, **parallel}
    return Config.from_dict({"model": {"preset": "tiny"}, "cluster": {"gpu": "cpu", "gpus": par["dp"] * par["tp"]},
                             "parallel": par, "training": {"precision": "fp32"}})


def test_zero1_with_tp_is_named_with_what_runs_instead():
    problems = composition_problems(cfg(dp=2, zero=1))
    assert len(problems) == 1 and "ZeroRedundancyOptimizer" in problems[0] and "zero = 2" in problems[0]
    assert composition_problems(cfg(dp=2, zero=2)) == []


def test_the_window_does_not_offer_to_run_it():
    r = runnable_version(cfg(dp=2, zero=1))
    assert r.config is None and not r.is_original
    assert "cannot run with PyTorch's APIs" in r.describe() and "ZeroRedundancyOptimizer" in r.describe()
    ok = runnable_version(cfg(dp=2, zero=2))
    assert ok.is_original and ok.config is not None and ok.describe() == ""


def test_a_runnable_version_that_would_hit_it_is_refused_too():
    big = Config.from_dict({"model": {"preset": "llama3-8b"}, "cluster": {"gpu": "h100-sxm", "gpus": 4},
                            "parallel": {"dp": 2, "tp": 2, "zero": 1}})
    r = runnable_version(big)
    assert r.config is None and "ZeroRedundancyOptimizer" in r.describe()
