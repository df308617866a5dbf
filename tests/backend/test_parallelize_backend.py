"""backend.parallel.parallelize applies the wrapping plan (engine.wrapping) and nothing else decides it.

The integration test builds bf16-mixed dp2 × tp2 with the real ``backend.train.Trainer`` on four
gloo ranks (tiny model, one step) and looks inside the forward: FSDP2's ``replicate`` holds the
TP DTensors, its MixedPrecisionPolicy gathers the parameters in bf16, and no autocast runs on top.
"""

from __future__ import annotations

import json
import math
import os
import socket
from pathlib import Path

import pytest

from engine import default_config
from engine.wrapping import wrapping_plan

torch = pytest.importorskip("torch")

BF16 = {"precision": "bf16-mixed", "grad_dtype": "bf16"}


def _cfg(dp=1, tp=1, zero=0, training=None):
    return default_config().replace(cluster={"gpus": dp * tp},
                                    parallel={"dp": dp, "tp": tp, "pp": 1, "zero": zero, "microbatches": 2},
                                    training=training or {})


@pytest.mark.parametrize(("kw", "autocast", "param_dtype"), [
    ({"dp": 2, "tp": 2, "training": BF16}, False, torch.bfloat16),  # replicate + its policy only
    ({"dp": 2, "zero": 3, "training": BF16}, False, torch.bfloat16),  # fully_shard + its policy only
    ({"dp": 2, "training": BF16}, True, None),  # DDP: autocast
    ({"tp": 2, "training": BF16}, True, None),  # TP alone: autocast
    ({"dp": 2, "tp": 2}, False, None),  # fp32: neither
])
def test_precision_follows_the_plan(kw, autocast, param_dtype):
    from backend.parallel.precision import autocast_context, fsdp_mp_policy

    plan = wrapping_plan(_cfg(**kw))
    ctx = autocast_context(plan, "cpu")
    assert isinstance(ctx, torch.autocast) == autocast
    if autocast:
        assert ctx.fast_dtype == torch.bfloat16
    policy = fsdp_mp_policy(plan)
    assert policy.param_dtype == param_dtype
    assert policy.reduce_dtype == (torch.bfloat16 if param_dtype else None)


def test_train_and_fake_worker_do_not_re_decide_the_wrapping():
    root = Path(__file__).resolve().parents[2]
    for name in ("backend/train.py", "backend/fake_worker.py"):
        text = (root / name).read_text(encoding="utf-8")
        for decision in ("zero in (2, 3)", "dp > 1 and par.tp > 1", "apply_fsdp(", "apply_ddp(",
                         "apply_replicate(", "make_zero1_optimizer(", "torch.autocast("):
            assert decision not in text, (name, decision)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, cfg_path: str, out_dir: str) -> None:
    """One rank: the real Trainer, one forward/backward/step, what the forward saw written out."""
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    torch.set_num_threads(1)
    from backend.train import Trainer
    from engine.config import Config

    trainer = Trainer(Config.load(cfg_path), out=None)
    (_, model), = trainer.modules
    seen = []

    def look(mod, args):
        w = mod.weight
        seen.append({"autocast": torch.is_autocast_enabled("cpu"), "weight": str(w.dtype),
                     "weight_type": type(w).__name__, "input": str(args[0].dtype)})

    hook = model.layers["0"].attention.wq.register_forward_pre_hook(look)
    loss, _ = trainer.forward_backward(trainer.batch(1))
    trainer.optimizer_step()
    hook.remove()
    from torch.distributed.fsdp import FSDPModule

    rec = {"plan": trainer.plan.data_parallel, "mixed": trainer.plan.mixed_precision, "seen": seen,
           "fsdp2": isinstance(model, FSDPModule), "loss": loss,
           "param_dtypes": sorted({str(p.dtype) for p in model.parameters()})}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(rec), encoding="utf-8")
    trainer.close()


@pytest.mark.integration
def test_bf16_dp_by_tp_runs_replicate_with_its_policy_and_no_autocast(tmp_path):
    import torch.multiprocessing as mp

    cfg = _cfg(dp=2, tp=2, training=BF16)
    assert wrapping_plan(cfg).mixed_precision == "fsdp2-policy"
    cfg.save(tmp_path / "config.toml")
    world = cfg.parallel.world_size
    mp.start_processes(_rank, args=(world, _free_port(), str(tmp_path / "config.toml"), str(tmp_path)),
                       nprocs=world, join=True, start_method="spawn")
    for r in range(world):
        rec = json.loads((tmp_path / f"rank{r}.json").read_text(encoding="utf-8"))
        assert (rec["plan"], rec["mixed"], rec["fsdp2"]) == ("replicate", "fsdp2-policy", True)
        assert len(rec["seen"]) == cfg.parallel.microbatches  # one forward per microbatch
        for fwd in rec["seen"]:
            assert not fwd["autocast"], fwd  # the policy casts; autocast is not entered on top
            assert fwd["weight"] == "torch.bfloat16" and fwd["weight_type"] == "DTensor", fwd  # gathered in bf16
            assert fwd["input"] == "torch.bfloat16", fwd  # the residual stream runs in bf16
        assert rec["param_dtypes"] == ["torch.float32"]  # fp32 master parameters between steps
        assert math.isfinite(rec["loss"]) and rec["loss"] > 0
