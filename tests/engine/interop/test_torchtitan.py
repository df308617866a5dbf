"""torchtitan's configs and command lines ↔ ShardScope (engine.interop.torchtitan)."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from engine import Config, ConfigError
from engine.interop import InteropError, compact_dict
from engine.interop.torchtitan import (
    FLAVOUR_02,
    FLAVOUR_03,
    FLAVOUR_2024,
    MODELS,
    export_torchtitan_command,
    export_torchtitan_toml,
    import_torchtitan,
)
from engine.wrapping import reshard_after_forward, wrapping_plan
from tests.config_space import random_config

ROOT = Path(__file__).resolve().parents[3]
PUBLISHED = ROOT / "assets" / "examples" / "published"
TT_9DEC370 = PUBLISHED / "torchtitan-9dec370"


def _notes(path: Path) -> dict[str, str]:
    notes = {}
    for ln in path.read_text().splitlines():
        if ln.startswith("# published.") and " = " in ln:
            key, value = ln[len("# published."):].split(" = ", 1)
            notes[key.strip()] = value.strip()
    assert "command" in notes, f"{path.name}: one '# published.command = ...' line"
    return notes


@pytest.mark.parametrize("path", sorted(PUBLISHED.glob("*.toml")), ids=lambda p: p.stem)
def test_every_published_config_is_its_benchmark_command_imported(path):
    notes = _notes(path)
    root = PUBLISHED / notes["torchtitan"] if "torchtitan" in notes else TT_9DEC370
    got = import_torchtitan(notes["command"], base_dir=root, cluster={"gpu": notes.get("gpu", "h100-96g")})
    assert got.flavour == (FLAVOUR_02 if "torchtitan" in notes else FLAVOUR_2024)  # e7c0cae (2025/06) is 0.1's
    assert got.config == Config.load(path)
    declared = {n.strip() for n in notes.get("not_expressed", "").split(",") if n.strip()}
    assert {n.split(" = ")[0] for n in got.not_expressed} == declared


def test_the_2024_flags_as_the_benchmarks_wrote_them():
    got = import_torchtitan(
        "torchrun --nnodes 1 --nproc_per_node 8 torchtitan/train.py --job.config_file train_configs/llama3_8b.toml "
        "--training.batch_size 2 --training.compile --float8.enable_float8_linear "
        "--float8.enable_fsdp_float8_all_gather --metrics.enable_wandb", base_dir=TT_9DEC370)
    c = got.config
    assert (c.cluster.gpus, c.cluster.gpus_per_node, c.cluster.gpu.name) == (8, 8, "h100-sxm")
    assert (c.parallel.dp, c.parallel.zero, c.training.micro_batch_size, c.training.recompute) == (8, 3, 2, "selective-op")
    assert (c.training.float8, c.training.float8_all_gather, c.training.compile) == ("tensorwise", True, True)
    assert c.conventions.rms_norm == "fp32-composite"  # model.norm_type = "rmsnorm": torchtitan's own, before #985
    assert "metrics.enable_wandb" in got.ignored and "optimizer.lr" in got.ignored
    assert any("h100-sxm" in a for a in got.assumed)


def test_run_train_sh_with_ngpu_and_config_file():
    got = import_torchtitan("NGPU=4 CONFIG_FILE=train_configs/llama3_70b.toml ./run_train.sh --training.batch_size 1 "
                            "--training.tensor_parallel_degree 4", base_dir=TT_9DEC370)
    c = got.config
    assert (c.cluster.gpus, c.parallel.dp, c.parallel.tp, c.parallel.sequence_parallel) == (4, 1, 4, True)
    assert (c.parallel.zero, c.training.recompute) == (0, "full")  # one shard and no cp: torchtitan skips FSDP


JOB_02 = """
[model]
name = "llama3"
flavor = "8B"
converters = ["quantize.linear.float8"]
[training]
local_batch_size = 4
global_batch_size = 64
seq_len = 4096
[parallelism]
data_parallel_replicate_degree = 2
data_parallel_shard_degree = 4
tensor_parallel_degree = 2
enable_async_tensor_parallel = true
[activation_checkpoint]
mode = "selective"
selective_ac_option = "2"
[compile]
enable = true
[quantize.linear.float8]
recipe_name = "rowwise"
[checkpoint]
enable = true
"""


def test_a_0_2_job_config_with_hsdp_accumulation_and_rowwise_float8():
    got = import_torchtitan(JOB_02, gpus=16)
    c = got.config
    assert got.flavour == FLAVOUR_02
    assert (c.parallel.dp, c.parallel.replicate, c.parallel.zero, c.parallel.tp) == (8, 2, 3, 2)
    assert (c.parallel.async_tp, c.parallel.microbatches, c.training.micro_batch_size) == (True, 2, 4)  # 64 / (4 × 8)
    assert (c.training.recompute, c.training.recompute_every) == ("selective-layer", 2)
    assert (c.training.float8, c.training.float8_all_gather, c.model.seq_len) == ("rowwise", False, 4096)
    assert c.conventions.rms_norm == "fused"
    assert got.ignored == ("checkpoint.enable",)


def test_command_line_overrides_apply_after_the_file_in_every_spelling():
    got = import_torchtitan(JOB_02, gpus=16, args=["--parallelism.tensor-parallel-degree=1", "--compile.no-enable",
                                                   "--parallelism.data_parallel_shard_degree", "-1",
                                                   "--activation_checkpoint.selective_ac_option", "op",
                                                   "--training.global_batch_size=-1"])
    c = got.config
    assert (c.parallel.tp, c.parallel.dp, c.training.compile, c.training.recompute) == (1, 16, False, "selective-op")
    assert c.parallel.microbatches == 1


def test_a_0_3_command_takes_its_config_functions_defaults():
    got = import_torchtitan("torchrun --nnodes 4 --nproc_per_node 8 -m torchtitan.train --module llama3 "
                            "--config llama3_70b --parallelism.pipeline-parallel-degree 2 "
                            "--training.disable-cuda-graphs activation-checkpoint:selective")
    c = got.config
    assert got.flavour == FLAVOUR_03
    assert (c.parallel.tp, c.parallel.pp, c.parallel.dp, c.parallel.microbatches) == (8, 2, 2, 8)
    assert (c.training.micro_batch_size, c.training.recompute) == (1, "selective-op")  # 0.3's SelectiveAC is per op
    assert not any("cuda_graphs" in n for n in got.not_expressed)
    big = import_torchtitan("torchrun --nnodes 8 --nproc_per_node 8 -m torchtitan.train --module llama3 --config "
                            "llama3_405b --compile.no-enable")
    assert (big.config.training.float8, big.config.training.compile, big.config.parallel.async_tp) == \
        ("rowwise", False, False)  # async TP is a compile pass
    assert any("disable_cuda_graphs" in n for n in big.not_expressed)


@pytest.mark.parametrize("text, field", [
    ("--module llama3 --config llama3_8b activation-checkpoint:memory-budget", "activation_checkpoint.mode"),
    ("--module llama3 --config llama3_9b", "--config"),
    ("--job.config_file train_configs/llama3_8b.toml --model.flavor 13B", "model.flavor"),
    ("--job.config_file train_configs/llama3_8b.toml --training.enable_cpu_offload", "enable_cpu_offload"),
    ("--job.config_file train_configs/llama3_8b.toml --experimental.pipeline_parallel_degree 2 "
     "--experimental.pipeline_parallel_schedule Bogus", "pipeline_parallel_schedule"),
    ("torchrun --nproc_per_node 6 train.py --job.config_file train_configs/llama3_70b.toml", "world size"),
    ("--job.config_file train_configs/llama3_8b.toml", "--gpus N"),
    ("--job.config_file train_configs/llama3_8b.toml --training.batch_size two", "training.batch_size"),
    ("--job.config_file nowhere.toml", "nowhere.toml"),
])
def test_what_cannot_become_a_config_is_refused_by_name(text, field):
    gpus = None if field in ("world size", "--gpus N") else 8
    with pytest.raises(InteropError, match=field.replace(".", r"\.").replace("-", r"\-")):
        import_torchtitan(text, base_dir=TT_9DEC370, gpus=gpus)


def test_unknown_keys_are_named_not_dropped():
    got = import_torchtitan(JOB_02 + "\n[parallelism.extra]\nwhatever = 3\n", gpus=16,
                            args=["--parallelism.expert_tensor_parallel_degree", "2", "--fancy.thing", "x"])
    assert "parallelism.extra.whatever = 3" in got.not_expressed
    assert "fancy.thing = 'x'" in got.not_expressed
    assert any(n.startswith("parallelism.expert_tensor_parallel_degree") for n in got.not_expressed)


# --------------------------------------------------------------------------- export, round trips

DENSE = ("llama3-8b", "llama3-70b", "llama3-405b", "llama2-7b")


def _expressible(rng: random.Random) -> Config | None:
    """A layout torchtitan 0.2's job config says in full: torchtitan's split, FSDP2 or DDP, fp32 reduction."""
    preset = rng.choice(DENSE)
    tp, pp, cp = rng.choice((1, 2, 4, 8)), rng.choice((1, 1, 2, 4)), rng.choice((1, 1, 2))
    shard, replicate = rng.choice((1, 2, 4)), rng.choice((1, 1, 2))
    zero = 3 if shard * cp > 1 else 0
    schedule = rng.choice(("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
                           "ZBVZeroBubble", "DualPipeV"))
    virtual = 1 if schedule in ("GPipe", "1F1B") else 2
    float8 = rng.choice(("none", "tensorwise", "rowwise"))
    recompute = rng.choice(("none", "full", "selective-op", "selective-layer"))
    raw = {"model": {"preset": preset, "seq_len": rng.choice((2048, 4096, 8192))},
           "cluster": {"gpu": "h100-sxm", "gpus": shard * replicate * tp * pp * cp, "gpus_per_node": 8},
           "parallel": {"dp": shard * replicate, "replicate": replicate if zero == 3 else 1, "tp": tp, "pp": pp,
                        "cp": cp, "zero": zero, "sequence_parallel": tp > 1, "async_tp": tp > 1 and rng.random() < .5,
                        "microbatches": rng.choice((1, 2, 4)) * (pp if pp > 1 else 1)},
           "training": {"micro_batch_size": rng.choice((1, 2)), "precision": rng.choice(("bf16-mixed", "fp32")),
                        "grad_dtype": "fp32", "recompute": recompute,
                        "recompute_every": rng.choice((2, 3)) if recompute == "selective-layer" else 2,
                        "compile": rng.random() < 0.5, "float8": float8,
                        "float8_all_gather": float8 == "tensorwise" and zero == 3 and rng.random() < 0.5}}
    if pp > 1:
        raw["parallel"].update(schedule=schedule, virtual_stages=virtual, pipeline_split="torchtitan")
    try:
        return Config.from_dict(raw)
    except ConfigError:
        return None


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(st.integers(0, 2**32))
def test_toml_round_trip_is_exact_where_torchtitan_expresses_the_layout(seed):
    rng = random.Random(seed)
    cfg = _expressible(rng)
    assume(cfg is not None)
    out = export_torchtitan_toml(cfg)
    assert out.not_expressed == ()
    back = import_torchtitan(out.text, gpus=cfg.cluster.gpus, cluster={"gpu": "h100-sxm", "gpus_per_node": 8})
    assert back.config == cfg
    assert back.not_expressed == ()


def _named(notes: tuple[str, ...]) -> set[str]:
    return {n.split(" = ", 1)[0] for n in notes}


def _inert(cfg: Config) -> dict:
    """``cfg``'s file with the fields that change nothing in it set to their defaults (a schedule without a pipeline,
    LoRA's fields without LoRA, ...): no importer can know them."""
    d = cfg.to_dict()
    par, tr, model = d["parallel"], d["training"], d["model"]
    defaults = {f.name: f.default for f in dataclasses.fields(cfg.model)}
    inert = []
    if not cfg.model.experts:  # a dense model: the mixture-of-experts fields mean nothing
        inert += ["experts_per_token", "expert_ffn_hidden", "shared_experts", "dense_layers", "router_score",
                  "router_bias", "router_balance_bias", "norm_topk_prob", "routed_scaling_factor", "router_aux_loss",
                  "router_groups", "router_topk_groups"]
    if cfg.model.attention != "mla":
        inert += ["kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"]
    if not cfg.model.sliding_window:
        inert += ["full_attention_every"]
    for k in inert:
        model.pop(k, None)
        if defaults.get(k) is not dataclasses.MISSING:
            model[k] = defaults[k]
    d["cluster"]["gpus_per_node"] = min(cfg.cluster.gpus, cfg.cluster.gpus_per_node)  # one node: its size is moot
    if par["pp"] == 1:
        par.update(schedule="1F1B", virtual_stages=1, pipeline_split="even")
    if par["cp"] == 1:
        par["cp_rotate"] = "allgather"
    if par["zero"] != 3 or reshard_after_forward(3, par["fsdp_reshard_after_forward"], par["pp"] > 1) == \
            reshard_after_forward(3, "default", par["pp"] > 1):
        par["fsdp_reshard_after_forward"] = "default"
    if par["zero"] == 0:
        par["replicate"] = 1
    if tr["recompute"] == "selective-layer" and tr["recompute_every"] == 1:
        tr["recompute"] = "full"
    if tr["recompute"] != "selective-layer":
        tr["recompute_every"] = 2
    if wrapping_plan(cfg).mixed_precision != "fsdp2-policy":  # DDP and autocast reduce the gradients' own dtype
        tr["grad_dtype"] = "fp32"
    if tr["finetune"] == "full":
        tr.update(lora_rank=16, lora_alpha=32.0, lora_targets="all", lora_base_dtype="fp32")
    return d


def _differing(a: Config, b: Config) -> set[str]:
    da, db = _inert(a), _inert(b)
    return {f"{s}.{k}" for s in da if isinstance(da[s], dict) for k in set(da[s]) | set(db[s])
            if da[s].get(k) != db[s].get(k)}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(st.integers(0, 2**32))
def test_every_field_an_export_changes_is_named(seed):
    rng = random.Random(seed)  # the config space's own distribution (hypothesis' randoms draw mostly invalid layouts)
    raw = random_config(rng, junk=0.0)  # any layout, on a model torchtitan has
    raw["model"] = {"preset": rng.choice(sorted(MODELS.values())),
                    **{k: v for k, v in raw["model"].items() if k == "seq_len"}}
    try:
        cfg = Config.from_dict(raw)
    except ConfigError:
        cfg = None
    assume(cfg is not None)
    for export in (export_torchtitan_toml, export_torchtitan_command):
        try:
            out = export(cfg)
        except InteropError as exc:
            assert str(exc).startswith("model:")
            return
        lines = [ln for ln in out.text.splitlines() if ln and not ln.startswith("#")]
        text = out.text if export is export_torchtitan_toml else lines[-1]
        try:
            back = import_torchtitan(text, gpus=cfg.cluster.gpus, cluster={
                "gpu": cfg.to_dict()["cluster"]["gpu"], "gpus_per_node": cfg.cluster.gpus_per_node,
                **{k: v for k, v in cfg.to_dict()["cluster"].items() if k.endswith(("_us", "_per_s", "cores"))}})
        except InteropError as exc:  # what torchtitan cannot run (a world it cannot split) must have been named
            assert out.not_expressed, str(exc)
            continue
        moved = {f for f in _differing(cfg, back.config) if not f.startswith("conventions.") or f in
                 ("conventions.rms_norm", "conventions.pipeline_outputs")}
        assert_moves_named(moved, out.not_expressed + back.not_expressed)


#: fields that mean something only through another one: when that one is named, they may move with it
_DEPENDENTS = {
    "training.finetune": ("training.lora_rank", "training.lora_alpha", "training.lora_targets",
                          "training.lora_base_dtype"),
    "parallel.zero": ("parallel.replicate", "parallel.fsdp_reshard_after_forward", "training.float8_all_gather"),
    "training.recompute": ("training.recompute_every",),
    "training.float8": ("training.float8_all_gather",),
}


def assert_moves_named(moved: set[str], notes: tuple[str, ...], format_dependents: dict | None = None) -> None:
    """Every field that moved in a round trip is named by a note, or depends on one that is (``_DEPENDENTS``, and a
    format's own: fields a format writes in terms of others, e.g. the pipeline's ranks as data parallel)."""
    named = _named(notes)
    dependents = {k: set(v) for k, v in _DEPENDENTS.items()}
    for k, v in (format_dependents or {}).items():
        dependents.setdefault(k, set()).update(v)
    explained = named | {d for n in named for d in dependents.get(n, ())}
    assert moved <= explained, (moved - explained, notes)


def test_compact_dict_loads_back_to_the_same_config():
    for path in [*PUBLISHED.glob("*.toml"), *(ROOT / "assets" / "examples").glob("*.toml")]:
        cfg = Config.load(path)
        assert Config.from_dict(compact_dict(cfg)) == cfg, path.name


def test_export_refuses_a_model_torchtitan_has_not():
    cfg = Config.load(ROOT / "assets" / "examples" / "mixtral-8x7b-ep8.toml")
    with pytest.raises(InteropError, match="model: mixtral-8x7b"):
        export_torchtitan_command(cfg)


def test_the_models_map_names_presets_that_exist():
    for preset in MODELS.values():
        Config.from_dict({"model": {"preset": preset}, "cluster": {"gpu": "cpu", "gpus": 1}})


def test_a_multi_stage_schedule_with_one_stage_a_rank_is_named_not_written():
    """ShardScope runs Interleaved1F1B with one stage a rank; torchtitan gives a multi-stage schedule two or more.
    The export wrote pipeline_parallel_layers_per_stage = 7 for Qwen3 30B's 48 layers over pp 8 (8 stages, one a
    rank), a file torchtitan (and the importer) refuse; it now names the field and keeps torchtitan's default
    (hypothesis found it: seed 99334)."""
    cfg = Config.from_dict({"model": {"preset": "qwen3-30b-a3b"}, "cluster": {"gpu": "a100-40g", "gpus": 512},
                            "parallel": {"dp": 64, "pp": 8, "zero": 3, "schedule": "Interleaved1F1B",
                                         "virtual_stages": 1, "microbatches": 32}})
    out = export_torchtitan_toml(cfg)
    assert "pipeline_parallel_layers_per_stage" not in out.text
    assert any(n.startswith("parallel.virtual_stages = 1 under Interleaved1F1B") for n in out.not_expressed)
    import_torchtitan(out.text, gpus=512, cluster={"gpu": "a100-40g"})
