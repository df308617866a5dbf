"""Megatron-LM's command line ↔ ShardScope (engine.interop.megatron). Megatron-LM's argument parser is
not installable here (megatron/training is not in the megatron-core wheel), so its documented semantics
(``validate_args`` in megatron/training/arguments.py) are checked by hand below, and the round trip over the config
space by the property test."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from engine import Config, ConfigError
from engine.interop import InteropError
from engine.interop.megatron import export_megatron, import_megatron
from tests.config_space import random_config
from tests.engine.interop.test_torchtitan import _differing, assert_moves_named

LLAMA2_7B = """
GPUS_PER_NODE=8
torchrun --nproc_per_node 8 --nnodes 4 pretrain_gpt.py \\
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 4 --sequence-parallel \\
    --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 11008 \\
    --seq-length 4096 --max-position-embeddings 4096 --vocab-size 32000 \\
    --swiglu --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights \\
    --disable-bias-linear --hidden-dropout 0 --attention-dropout 0 \\
    --micro-batch-size 1 --global-batch-size 64 --num-layers-per-virtual-pipeline-stage 4 \\
    --bf16 --use-distributed-optimizer --recompute-activations \\
    --lr 3e-4 --train-iters 1000 --data-path /data/x --tokenizer-type Llama2Tokenizer
"""


def test_a_llama2_7b_script_is_the_preset_and_its_layout():
    got = import_megatron(LLAMA2_7B, cluster={"gpu": "a100-80g"})
    c = got.config
    assert c.model.preset == "llama2-7b" and c.model.seq_len == 4096
    assert (c.cluster.gpus, c.parallel.dp, c.parallel.tp, c.parallel.pp) == (32, 4, 2, 4)
    assert (c.parallel.schedule, c.parallel.virtual_stages, c.parallel.microbatches) == ("Interleaved1F1B", 2, 16)
    assert (c.parallel.zero, c.parallel.sequence_parallel, c.training.recompute) == (1, True, "selective")
    assert (c.training.precision, c.training.grad_dtype) == ("bf16-mixed", "fp32")  # accumulate_allreduce in fp32
    assert {"lr", "train-iters", "data-path", "tokenizer-type"} <= set(got.ignored)


@pytest.mark.parametrize("args, expect", [
    ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1", ("full", 0)),
    ("--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads", ("none", 2)),
    ("--use-torch-fsdp2", ("none", 3)),
])
def test_recompute_and_sharding_flags(args, expect):
    base = ("--num-layers 4 --hidden-size 256 --num-attention-heads 4 --vocab-size 1000 --seq-length 128 "
            "--micro-batch-size 2 --bf16 ")
    c = import_megatron(base + args, gpus=8).config
    assert (c.training.recompute, c.parallel.zero) == expect


@pytest.mark.parametrize("args, field", [
    ("--cpu-offloading", "cpu-offloading"),
    ("--recompute-granularity partial", "recompute-granularity"),
    ("--tensor-model-parallel-size 3", "not a multiple"),
    ("--global-batch-size 7", "global-batch-size"),
    ("--tensor-model-parallel-size $TP", "shell variable"),
    ("--use-megatron-fsdp --data-parallel-sharding-strategy everything", "data-parallel-sharding-strategy"),
])
def test_refusals_name_the_argument(args, field):
    with pytest.raises(InteropError, match=field.replace("$", r"\$")):
        import_megatron("--num-layers 4 --hidden-size 256 --num-attention-heads 4 " + args, gpus=8)


def test_the_world_size_is_needed():
    with pytest.raises(InteropError, match="--gpus N"):
        import_megatron("pretrain_gpt.py --num-layers 4")


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(st.integers(0, 2**32))
def test_every_field_an_export_changes_is_named(seed):
    try:
        cfg = Config.from_dict(random_config(random.Random(seed), junk=0.0))
    except ConfigError:
        cfg = None
    assume(cfg is not None)
    out = export_megatron(cfg)
    cluster = {k: v for k, v in cfg.to_dict()["cluster"].items() if k not in ("gpus", "gpus_per_node", "preset")}
    try:
        back = import_megatron(out.text.splitlines()[-1], cluster=cluster).config
    except InteropError as exc:
        assert out.not_expressed, str(exc)
        return
    moved = {f for f in _differing(cfg, back) if not f.startswith(("conventions.", "cluster."))}
    assert_moves_named(moved - {"model.preset"}, out.not_expressed, {  # a preset's numbers come back as its name
        "model": {f"model.{f.name}" for f in dataclasses.fields(cfg.model)},
        "parallel.schedule": {"parallel.virtual_stages"},
        "parallel.replicate": {"parallel.fsdp_reshard_after_forward"}})
