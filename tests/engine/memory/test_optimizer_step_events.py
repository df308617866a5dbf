"""The optimizer step in a GPU rank's allocation events (``engine.memory.lifetimes._Laying._optimizer_step``), from
torch/optim/adam.py: the multi-tensor step's ``torch._foreach_sqrt`` makes one fp32 tensor per stepped parameter,
all alive at once; the for-loop step makes a parameter's root and quotient while the previous parameter's
quotient is still bound; autocast's cached weight casts are gone before either (its context has exited)."""

from __future__ import annotations

from engine.config import Config
from engine.memory.lifetimes import most_live
from engine.memory.per_rank import memory_per_rank
from engine.memory.states import optimizer_foreach


def _rank(par: dict, gpu: str = "a100-80g"):
    cfg = Config.from_dict({"model": {"preset": "tiny"},
                            "cluster": {"gpu": gpu, "gpus": par.get("dp", 1) * par.get("tp", 1)},
                            "parallel": par, "training": {"precision": "bf16-mixed", "optimizer": "adamw"}})
    return cfg, memory_per_rank(cfg).distinct()[0][0]


def _step_term(r) -> int:
    (t,) = [t for t in r.catalogue("temporaries") if t.kind == "optimizer_step"]
    return t.bytes


def _live_step_bytes(events) -> int:
    """The most bytes the step's own tensors hold at once."""
    return most_live(e for e in events if e[1][0] in ("sqrt", "denom"))


def test_the_multi_tensor_step_makes_one_root_per_parameter_after_the_backward():
    cfg, r = _rank({"dp": 2})
    assert optimizer_foreach(cfg)
    ev = r._body.timeline.events()
    roots = [i for i, e in enumerate(ev) if e[0] == "alloc" and e[1][0] == "sqrt"]
    # one per stepped tensor: the tiny model's blocks and its embeddings, head and final norm
    n_tensors = sum(len(numels) * c for (numels, c) in r._body.timeline._event_signature()[2].step[1])
    assert len(roots) == n_tensors > 2 * cfg.model.layers
    assert sum(ev[i][2] for i in roots) == _step_term(r) == 4 * r.optimizer // 8  # AdamW's two fp32 states
    # after the last microbatch's saved tensors are freed; never freed (the step's end changes no peak)
    last_saved_free = max(i for i, e in enumerate(ev) if e[0] == "free" and e[1][0] == "mb")
    assert roots[0] > last_saved_free
    assert not any(e[0] == "free" and e[1][0] == "sqrt" for e in ev)
    assert _live_step_bytes(ev) == _step_term(r)


def test_the_for_loop_step_holds_a_root_and_two_quotients_at_most():
    cfg, r = _rank({"tp": 2})  # TP without SP or FSDP2: DTensors beside plain norms, which foreach refuses
    assert not optimizer_foreach(cfg)
    ev = r._body.timeline.events()
    assert _live_step_bytes(ev) == _step_term(r)
    assert sum(1 for e in ev if e[0] == "alloc" and e[1][0] == "sqrt") == sum(
        1 for e in ev if e[0] == "free" and e[1][0] == "sqrt")


def test_autocast_casts_are_freed_before_the_step():
    _, r = _rank({"dp": 1})
    assert any(t.kind == "autocast_weight_casts" for t in r.catalogue("params") + r.catalogue("temporaries")
               + r.catalogue("activations"))
    ev = r._body.timeline.events()
    first_root = next(i for i, e in enumerate(ev) if e[1][0] == "sqrt")
    casts = [i for i, e in enumerate(ev) if e[0] == "alloc" and e[1][0] == "cast"]
    freed = [i for i, e in enumerate(ev) if e[0] == "free" and e[1][0] == "cast"]
    assert casts and len(freed) == len(casts) and max(freed) < first_root


def test_a_zero1_share_is_not_laid_and_cpu_ranks_lay_no_step():
    for par, gpu in (({"dp": 2, "zero": 1}, "a100-80g"), ({"dp": 2}, "cpu")):
        _, r = _rank(par, gpu)
        assert _step_term(r) > 0
        assert not any(e[1][0] in ("sqrt", "denom") for e in r._body.timeline.events())
