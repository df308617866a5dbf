"""The Config: presets, validation messages, files and round trips."""

import json

import pytest

from engine import Config, ConfigError, default_config
from engine.config import SCHEMA_VERSION
from engine.model.presets import cluster_presets, gpu_presets, model_presets

MODEL_PRESETS = ["tiny", "gpt2-124m", "llama2-7b", "llama3-8b", "llama3-70b", "llama3-405b"]
GPU_PRESETS = ["a100-40g", "a100-80g", "h100-sxm", "h200", "b200", "mi300x", "rtx4090", "cpu"]


def make(**sections):
    raw = {"model": {"preset": "llama2-7b"}, "cluster": {"gpu": "h100-sxm", "gpus": 8}}
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    return Config.from_dict(raw)


def problems_of(**sections):
    with pytest.raises(ConfigError) as info:
        make(**sections)
    return info.value


def test_the_named_presets_exist():
    assert set(MODEL_PRESETS) <= set(model_presets())
    assert set(GPU_PRESETS) <= set(gpu_presets())
    assert cluster_presets()


@pytest.mark.parametrize("model", MODEL_PRESETS)
@pytest.mark.parametrize("gpu", GPU_PRESETS)
def test_every_preset_pair_is_valid(model, gpu):
    cfg = Config.from_dict({"model": {"preset": model}, "cluster": {"gpu": gpu, "gpus": 8}})
    assert cfg.parallel.dp == 8  # dp fills the GPUs when not given
    assert cfg.model.preset == model and cfg.cluster.gpu.name == gpu


@pytest.mark.parametrize("cluster", list(cluster_presets()))
def test_every_cluster_preset_is_valid(cluster):
    cfg = Config.from_dict({"model": {"preset": "tiny"}, "cluster": {"preset": cluster}})
    assert cfg.parallel.world_size == cfg.cluster.gpus


def test_issue_example_file_loads(tmp_path):
    text = """
schema_version = 1
[model]
preset = "llama2-7b"
layers = 32
hidden = 4096
heads = 32
kv_heads = 32
ffn_hidden = 11008
vocab = 32000
seq_len = 4096
tied_embeddings = false
mlp = "swiglu"
norm = "rmsnorm"
attention = "flash"
dropout = 0.0
[cluster]
gpu = "h100-sxm"
gpus = 64
gpus_per_node = 8
[parallel]
dp = 8
tp = 8
pp = 1
zero = 1
sequence_parallel = true
schedule = "1F1B"
virtual_stages = 1
microbatches = 8
[training]
micro_batch_size = 1
precision = "bf16-mixed"
grad_dtype = "bf16"
optimizer = "adamw"
recompute = "none"
"""
    path = tmp_path / "job.toml"
    path.write_text(text)
    cfg = Config.load(path)
    assert cfg.cluster.nodes == 8
    assert cfg.parallel.shard_degree == 8
    assert cfg.global_batch_size == 64
    assert cfg.tokens_per_step == 64 * 4096
    assert cfg.cluster.gpu.memory_bytes == int(round(79.6 * 2**30))


def test_preset_fields_can_be_overridden():
    cfg = make(model={"layers": 16, "seq_len": 2048})
    assert cfg.model.layers == 16 and cfg.model.hidden == 4096 and cfg.model.seq_len == 2048


def test_defaults_of_training_follow_precision():
    assert make(training={"precision": "fp32"}).training.grad_dtype == "fp32"
    assert make(training={"precision": "fp16-mixed"}).training.grad_dtype == "fp16"
    assert make().training.grad_dtype == "bf16"


def test_fsdp_names_map_onto_zero_stages():
    assert make(parallel={"fsdp": "FULL_SHARD"}).parallel.zero == 3
    assert make(parallel={"fsdp": "SHARD_GRAD_OP"}).parallel.zero == 2
    assert make(parallel={"fsdp": "NO_SHARD"}).parallel.zero == 0
    hsdp = make(parallel={"fsdp": "HYBRID_SHARD", "replicate": 2})
    assert hsdp.parallel.zero == 3 and hsdp.parallel.shard_degree == 4


def test_gpu_can_be_a_table_overriding_a_preset():
    cfg = make(cluster={"gpu": {"preset": "h100-sxm", "memory_gib": 94.0}})
    assert cfg.cluster.gpu.memory_gib == 94.0 and cfg.cluster.gpu.peak_bf16_tflops == 989.0
    again = Config.from_dict(cfg.to_dict())
    assert again == cfg


# ----------------------------------------------------------------------- broken configs

BROKEN = [
    ({"parallel": {"dp": 3}}, "parallel.dp", "must equal cluster.gpus"),
    ({"parallel": {"tp": 3, "dp": 1}, "cluster": {"gpus": 3}}, "parallel.tp", "allowed: 1, 2, 4, 8, 16, 32"),
    ({"model": {"kv_heads": 5}}, "model.kv_heads", "must divide model.heads"),
    ({"model": {"hidden": 4100}}, "model.hidden", "multiple of model.heads"),
    ({"model": {"mlp": "relu"}}, "model.mlp", "allowed: gelu | swiglu"),
    ({"model": {"layers": 0}}, "model.layers", "at least 1"),
    ({"model": {"layers": "32"}}, "model.layers", "must be an integer"),
    ({"model": {"tied_embeddings": 1}}, "model.tied_embeddings", "true or false"),
    ({"model": {"preset": "gpt5"}}, "model.preset", "allowed: tiny"),
    ({"model": {"colour": "red"}}, "model.colour", "unknown key"),
    ({"cluster": {"gpu": "tpu-v5"}}, "cluster.gpu", "allowed: a100-40g"),
    ({"cluster": {"gpus": 12, "gpus_per_node": 8}}, "cluster.gpus", "multiple of cluster.gpus_per_node"),
    ({"parallel": {"zero": 4}}, "parallel.zero", "allowed: 0"),
    ({"parallel": {"schedule": "Gpipe", "pp": 2, "dp": 4}}, "parallel.schedule", "allowed: GPipe"),
    ({"parallel": {"sequence_parallel": True}}, "parallel.sequence_parallel", "tp > 1"),
    ({"parallel": {"pp": 2, "dp": 4, "microbatches": 1}}, "parallel.microbatches", "1F1B needs microbatches"),
    ({"parallel": {"pp": 2, "dp": 4, "schedule": "DualPipeV", "virtual_stages": 2, "microbatches": 3}},
     "parallel.microbatches", "DualPipeV needs microbatches"),
    ({"parallel": {"pp": 2, "dp": 4, "schedule": "ZBVZeroBubble", "microbatches": 4}},
     "parallel.virtual_stages", "allowed: 2"),
    ({"parallel": {"pp": 2, "dp": 4, "schedule": "GPipe", "virtual_stages": 2, "microbatches": 4}},
     "parallel.virtual_stages", "allowed: 1"),
    ({"parallel": {"pp": 2, "dp": 4, "schedule": "Interleaved1F1B", "virtual_stages": 2, "microbatches": 5}},
     "parallel.microbatches", "multiple of"),
    ({"parallel": {"pp": 8, "dp": 1, "virtual_stages": 8, "schedule": "Interleaved1F1B", "microbatches": 8}},
     "parallel.pp", "exceeds model.layers"),
    ({"parallel": {"virtual_stages": 2}}, "parallel.virtual_stages", "pp > 1"),
    ({"parallel": {"replicate": 3}}, "parallel.replicate", "must divide parallel.dp"),
    ({"parallel": {"replicate": 2, "zero": 1}}, "parallel.replicate", "zero = 2 or 3"),
    ({"parallel": {"fsdp": "FULL"}}, "parallel.fsdp", "allowed: NO_SHARD"),
    ({"parallel": {"fsdp": "FULL_SHARD", "zero": 1}}, "parallel.zero", "disagrees"),
    ({"training": {"precision": "fp8"}}, "training.precision", "allowed: fp32 | bf16-mixed | fp16-mixed"),
    ({"training": {"precision": "fp32", "grad_dtype": "bf16"}}, "training.grad_dtype", "allowed: fp32"),
    ({"training": {"optimizer": "adam"}}, "training.optimizer", "allowed: adamw | sgd-momentum | sgd"),
    ({"training": {"recompute": "some"}}, "training.recompute", "allowed: none | selective | full"),
    ({"training": {"micro_batch_size": 0}}, "training.micro_batch_size", "at least 1"),
    ({"conventions": {"bubble": "ideal"}}, "conventions.bubble", "allowed: share-of-total"),
]


@pytest.mark.parametrize(("sections", "field", "words"), BROKEN, ids=[b[1] + ":" + b[2][:20] for b in BROKEN])
def test_broken_configs_name_the_field(sections, field, words):
    err = problems_of(**sections)
    matching = [p for p in err.problems if p.field == field]
    assert matching, f"expected a problem on {field}, got {err.problems}"
    assert any(words in p.message for p in matching), [p.message for p in matching]
    assert field in str(err)


def test_every_problem_is_reported_at_once():
    err = problems_of(model={"mlp": "relu", "norm": "batchnorm"}, training={"optimizer": "lion"},
                      parallel={"tp": 3, "dp": 1}, cluster={"gpus": 3})
    assert {"model.mlp", "model.norm", "training.optimizer", "parallel.tp"} <= err.fields()


def test_unknown_top_level_key_and_section_type():
    with pytest.raises(ConfigError) as info:
        Config.from_dict({"model": {"preset": "tiny"}, "modle": {}, "training": 3})
    assert {"modle", "training"} <= info.value.fields()


def test_schema_version_is_checked():
    with pytest.raises(ConfigError) as info:
        Config.from_dict({"schema_version": 2, "model": {"preset": "tiny"}})
    assert "schema_version" in info.value.fields()


def test_missing_model_without_preset_names_the_fields():
    with pytest.raises(ConfigError) as info:
        Config.from_dict({"model": {"layers": 2}})
    assert "missing" in str(info.value) and "hidden" in str(info.value)


def test_direct_construction_is_validated_too():
    cfg = default_config()
    with pytest.raises(ConfigError) as info:
        cfg.replace(parallel={"tp": 3})
    assert "parallel.tp" in info.value.fields()
    with pytest.raises(ConfigError) as info:
        cfg.replace(parallel={"tpp": 2})
    assert "parallel.tpp" in info.value.fields()
    assert cfg.replace(parallel={"dp": 1, "pp": 4}).parallel.pp == 4


def test_bad_files(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\npreset = 'tiny'")
    with pytest.raises(ConfigError, match="not valid TOML"):
        Config.load(bad)
    badj = tmp_path / "bad.json"
    badj.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        Config.load(badj)
    with pytest.raises(ConfigError, match="cannot be read"):
        Config.load(tmp_path / "nope.toml")


def test_loading_never_executes_anything(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.toml"
    path.write_text(f'[model]\npreset = "__import__(\'os\').system(\'touch {marker}\')"\n')
    with pytest.raises(ConfigError):
        Config.load(path)
    assert not marker.exists()


# ----------------------------------------------------------------------- round trips


def _preset_configs():
    for model in MODEL_PRESETS:
        for cluster in cluster_presets():
            yield Config.from_dict({"model": {"preset": model}, "cluster": {"preset": cluster}})
    yield default_config()
    yield make(parallel={"fsdp": "HYBRID_SHARD", "replicate": 2}, training={"optimizer": "sgd"},
               conventions={"bubble": "relative-to-ideal", "runtime_context": False})
    yield make(cluster={"gpu": {"name": "my-card", "memory_gib": 33.0, "peak_bf16_tflops": 100.0,
                                "peak_fp32_tflops": 10.0, "hbm_bandwidth_gb_per_s": 900.0}})


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_round_trip_every_preset(tmp_path, suffix):
    for i, cfg in enumerate(_preset_configs()):
        path = cfg.save(tmp_path / f"c{i}{suffix}")
        assert Config.load(path) == cfg
    assert not list(tmp_path.glob(".*.tmp"))


def test_json_output_is_plain_json():
    data = json.loads(default_config().dumps_json())
    assert data["schema_version"] == SCHEMA_VERSION
    assert data["cluster"]["gpu"] == "cpu"
