"""accelerate's config YAML ↔ ShardScope (engine.interop.accelerate), judged by accelerate itself: its
launcher reads every exported file (``_validate_launch_command``), turns it into the environment its processes get
(``prepare_multi_gpu_env``), and its plugins (``FullyShardedDataParallelPlugin``, ``ParallelismConfig``,
``AORecipeKwargs``) are built from that environment, as a training script's ``Accelerator`` builds them."""

from __future__ import annotations

import os
import random
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from engine import Config, ConfigError
from engine.interop import InteropError
from engine.interop.accelerate import import_accelerate as _import_table
from gui.interop_files import accelerate_yaml, read_accelerate
from tests.config_space import random_config
from tests.engine.interop.test_torchtitan import _differing, assert_moves_named

ROOT = Path(__file__).resolve().parents[3]

FSDP2 = """
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:
  fsdp_version: 2
  fsdp_reshard_after_forward: true
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_activation_checkpointing: true
  fsdp_offload_params: false
  fsdp_state_dict_type: SHARDED_STATE_DICT
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 2
num_processes: 16
parallelism_config:
  parallelism_config_dp_replicate_size: 2
  parallelism_config_dp_shard_size: 4
  parallelism_config_tp_size: 2
  parallelism_config_cp_size: 1
dynamo_config:
  dynamo_backend: INDUCTOR
"""
MODEL = {"model": {"preset": "llama3-8b", "seq_len": 4096}, "training": {"micro_batch_size": 2}}


def import_accelerate(text: str, **kw):
    return _import_table(read_accelerate(text), **kw)


def test_an_fsdp2_config_with_hsdp_tp_and_compile():
    got = import_accelerate(FSDP2, extra=MODEL, cluster={"gpu": "h100-sxm"})
    c = got.config
    assert (c.cluster.gpus, c.cluster.gpus_per_node) == (16, 8)
    assert (c.parallel.dp, c.parallel.replicate, c.parallel.zero, c.parallel.tp) == (8, 2, 3, 2)
    assert (c.training.recompute, c.training.compile, c.training.precision, c.training.grad_dtype) == \
        ("full", True, "bf16-mixed", "bf16")  # accelerate's FSDP policy reduces in the parameters' dtype
    assert (c.model.seq_len, c.training.micro_batch_size) == (4096, 2)
    assert "main_training_function" in got.ignored and got.assumed == ()


@pytest.mark.parametrize("strategy, zero, replicate", [("FULL_SHARD", 3, 1), ("SHARD_GRAD_OP", 2, 1),
                                                       ("NO_SHARD", 0, 1), ("HYBRID_SHARD", 3, 2),
                                                       ("HYBRID_SHARD_ZERO2", 2, 2), ("2", 2, 1)])
def test_fsdp1_sharding_strategies(strategy, zero, replicate):
    text = (f"distributed_type: FSDP\nnum_processes: 16\nnum_machines: 2\nmixed_precision: bf16\n"
            f"fsdp_config:\n  fsdp_version: 1\n  fsdp_sharding_strategy: {strategy}\n")
    c = import_accelerate(text, extra=MODEL).config
    assert (c.parallel.zero, c.parallel.replicate, c.parallel.dp) == (zero, replicate, 16)


def test_deepspeed_plugin_and_the_assumed_fields():
    text = ("distributed_type: DEEPSPEED\nnum_processes: 8\nmixed_precision: fp16\ndeepspeed_config:\n  zero_stage: 2\n"
            "  gradient_accumulation_steps: 4\n  offload_optimizer_device: none\n  offload_param_device: none\n")
    got = import_accelerate(text, extra={"model": {"preset": "llama2-7b"}})
    c = got.config
    assert (c.parallel.zero, c.parallel.microbatches, c.training.precision) == (2, 4, "fp16-mixed")
    assert any(a.startswith("training.micro_batch_size = 1") for a in got.assumed)
    assert any(a.startswith("cluster.gpu = h100-sxm") for a in got.assumed)
    assert any(n.startswith("deepspeed_config.zero_stage = 2") for n in got.not_expressed)


@pytest.mark.parametrize("text, field", [
    ("distributed_type: FSDP\nnum_processes: 8\nfsdp_config:\n  fsdp_offload_params: true\n", "fsdp_offload_params"),
    ("distributed_type: DEEPSPEED\nnum_processes: 8\ndeepspeed_config:\n  zero_stage: 3\n"
     "  offload_param_device: cpu\n", "offload_param_device"),
    ("distributed_type: XLA\nnum_processes: 8\n", "distributed_type"),
    ("distributed_type: FSDP\nnum_processes: 8\nfsdp_config:\n  fsdp_version: 3\n", "fsdp_version"),
    ("distributed_type: FSDP\nnum_processes: 6\nnum_machines: 4\n", "num_processes"),
    ("num_processes: 8\n", "distributed_type"),
    ("distributed_type: FSDP\nnum_processes: 8\nparallelism_config:\n  parallelism_config_tp_size: 3\n",
     "parallelism_config"),
])
def test_refusals_name_the_field(text, field):
    with pytest.raises(InteropError, match=field):
        import_accelerate(text, extra=MODEL)


def test_the_model_must_be_given():
    with pytest.raises(InteropError, match="--model PRESET"):
        import_accelerate("distributed_type: MULTI_GPU\nnum_processes: 8\n")


# --------------------------------------------------------------------------- round trips, accelerate as the judge

def _script_part(cfg: Config) -> dict:
    """What the training script holds and the YAML does not."""
    m = cfg.to_dict()["model"]
    return {"model": m, "training": {"micro_batch_size": cfg.training.micro_batch_size},
            "parallel": {"microbatches": cfg.parallel.microbatches}}


def _cluster(cfg: Config) -> dict:
    cl = cfg.to_dict()["cluster"]
    return {k: v for k, v in cl.items() if k not in ("gpus", "gpus_per_node")}


def _random(rng: random.Random) -> Config | None:
    try:
        return Config.from_dict(random_config(rng, junk=0.0))
    except ConfigError:
        return None


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(st.integers(0, 2**32))
def test_every_field_an_export_changes_is_named(seed):
    rng = random.Random(seed)  # the config space's own distribution (hypothesis' randoms draw mostly invalid layouts)
    cfg = _random(rng)
    assume(cfg is not None)
    out = accelerate_yaml(cfg)
    try:
        back = import_accelerate(out.text, extra=_script_part(cfg), cluster=_cluster(cfg))
    except InteropError as exc:
        assert out.not_expressed, str(exc)
        return
    moved = {f for f in _differing(cfg, back.config) if not f.startswith("conventions.")}
    assert_moves_named(moved, out.not_expressed + back.not_expressed, {
        "parallel.pp": {"parallel.dp", "parallel.schedule", "parallel.virtual_stages", "parallel.pipeline_split",
                        "parallel.fsdp_reshard_after_forward"},
        "parallel.zero": {"training.grad_dtype"}})


def _accelerate_reads(text: str, tmp: Path) -> dict:
    """What accelerate's own launcher and plugins make of a config file."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    path = tmp / "accelerate.yaml"
    path.write_text(text)
    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    args, defaults, _ = _validate_launch_command(args)
    env = prepare_multi_gpu_env(args)
    seen = {"distributed_type": str(defaults.distributed_type).split(".")[-1], "num_processes": args.num_processes,
            "num_machines": args.num_machines, "mixed_precision": env["ACCELERATE_MIXED_PRECISION"],
            "dynamo": env.get("ACCELERATE_DYNAMO_BACKEND", "NO")}
    with mock.patch.dict(os.environ, env):
        if env.get("ACCELERATE_USE_FSDP") == "true":
            from accelerate.utils import FullyShardedDataParallelPlugin

            plugin = FullyShardedDataParallelPlugin()
            seen.update(fsdp_version=plugin.fsdp_version, reshard=plugin.reshard_after_forward,
                        checkpointing=plugin.activation_checkpointing,
                        offload=type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy")
        if env.get("ACCELERATE_USE_PARALLELISM_CONFIG") == "true":
            from accelerate.parallelism_config import ParallelismConfig

            pc = ParallelismConfig()
            seen.update(replicate=pc.dp_replicate_size, shard=pc.dp_shard_size, tp=pc.tp_size, cp=pc.cp_size)
        if env["ACCELERATE_MIXED_PRECISION"] == "fp8":
            from accelerate.utils import AORecipeKwargs

            seen["float8_all_gather"] = AORecipeKwargs().config.enable_fsdp_float8_all_gather
    return seen


def test_accelerate_reads_each_exported_file_as_shardscope_does(tmp_path):
    rng = random.Random(20261204)
    cfgs = [Config.load(p) for p in sorted((ROOT / "assets" / "examples").glob("*.toml"))]
    cfgs += [Config.load(ROOT / "assets" / "examples" / "published" / "t4-2d.toml")]
    while len(cfgs) < 30:
        cfg = _random(rng)
        if cfg is not None and cfg.cluster.gpus <= 4096:
            cfgs.append(cfg)
    for cfg in cfgs:
        out = accelerate_yaml(cfg)
        ours = import_accelerate(out.text, extra=_script_part(cfg), cluster=_cluster(cfg)).config
        seen = _accelerate_reads(out.text, tmp_path)
        assert seen["num_processes"] == ours.cluster.gpus and seen["num_machines"] == ours.cluster.nodes
        assert seen["mixed_precision"] == ("fp8" if ours.training.float8 != "none" else
                                           {"fp32": "no", "bf16-mixed": "bf16", "fp16-mixed": "fp16"}[
                                               ours.training.precision])
        assert (seen["dynamo"] == "INDUCTOR") == ours.training.compile
        if seen["distributed_type"] == "FSDP":
            assert seen["fsdp_version"] == 2 and seen["offload"] is False
            assert seen["reshard"] == (ours.parallel.zero == 3)
            assert seen["checkpointing"] == (ours.training.recompute == "full")
        else:
            assert ours.parallel.zero in (0, 1) and ours.training.recompute == "none"
        if "tp" in seen:
            assert (seen["replicate"] * seen["shard"], seen["tp"], seen["cp"]) == \
                (ours.parallel.dp, ours.parallel.tp, ours.parallel.cp)
            assert seen["replicate"] == (ours.parallel.replicate if ours.parallel.zero else 1)
        if "float8_all_gather" in seen:
            assert seen["float8_all_gather"] == ours.training.float8_all_gather or ours.parallel.zero not in (2, 3)
