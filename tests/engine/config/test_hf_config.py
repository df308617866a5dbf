"""model.hf_config: a Hugging Face config.json read into the spec, overridable, refusing what it
does not understand by name."""

from __future__ import annotations

import dataclasses
import json

import pytest

from assets import HF_CONFIGS_DIR
from engine import Config, ConfigError
from engine.config import ModelSpec
from engine.model.hf_config import HFConfigError, hf_fields, read_hf_config
from engine.model.params import param_counts
from engine.model.presets import model_presets

SHIPPED = sorted(p.name for p in HF_CONFIGS_DIR.iterdir() if (p / "config.json").exists())


def test_every_moe_preset_ships_its_config():
    assert {"deepseek-v3", "qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b", "gpt-oss-20b", "gpt-oss-120b",
            "llama3-8b"} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_a_shipped_config_loads_to_its_preset_exactly(name):
    fields = read_hf_config(HF_CONFIGS_DIR / name / "config.json")
    spec = ModelSpec(**fields)
    preset = ModelSpec(**model_presets()[name])
    assert spec == preset  # field for field (attention defaults to the flash kernel, as the presets use)
    assert param_counts(spec).total == param_counts(preset).total
    assert param_counts(spec).active == param_counts(preset).active


def write(tmp_path, raw, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(raw), encoding="utf-8")
    return path


def test_a_config_file_names_it_relative_to_itself_and_overrides_win(tmp_path):
    hf = tmp_path / "models" / "mixtral"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text((HF_CONFIGS_DIR / "mixtral-8x7b" / "config.json").read_text())
    job = tmp_path / "job.toml"
    job.write_text('[model]\nhf_config = "models/mixtral/config.json"\nseq_len = 4096\nlayers = 16\n'
                   '[cluster]\ngpu = "h100-sxm"\ngpus = 8\n[parallel]\nep = 8\n')
    cfg = Config.load(job)
    assert cfg.model.experts == 8 and cfg.model.seq_len == 4096 and cfg.model.layers == 16
    assert cfg.model.hf_config == str((hf / "config.json").resolve())
    # the written file stands alone: every field, no path
    again = Config.from_dict(cfg.to_dict())
    assert "hf_config" not in cfg.to_dict()["model"]
    assert dataclasses.replace(again.model, hf_config=None) == dataclasses.replace(cfg.model, hf_config=None)


def test_a_missing_file_and_a_preset_beside_it_are_named(tmp_path):
    with pytest.raises(ConfigError) as err:
        Config.from_dict({"model": {"hf_config": "nowhere/config.json"}, "cluster": {"gpu": "cpu"}}, tmp_path)
    (p,) = err.value.problems
    assert p.field == "model.hf_config" and "cannot be read" in p.message
    path = write(tmp_path, json.loads((HF_CONFIGS_DIR / "llama3-8b" / "config.json").read_text()))
    with pytest.raises(ConfigError) as err:
        Config.from_dict({"model": {"hf_config": str(path), "preset": "tiny"}, "cluster": {"gpu": "cpu"}})
    assert "not both" in err.value.problems[0].message


def test_unsupported_model_type_is_named():
    with pytest.raises(HFConfigError, match="model_type 'falcon' is not supported; allowed: llama, mistral"):
        hf_fields({"model_type": "falcon"})


def test_an_unknown_field_is_refused_by_name():
    raw = json.loads((HF_CONFIGS_DIR / "llama3-8b" / "config.json").read_text())
    with pytest.raises(HFConfigError) as err:
        hf_fields({**raw, "parallel_attn": True, "hidden_act": "gelu"})
    text = str(err.value)
    assert "'parallel_attn'" in text and "'hidden_act' = 'gelu'" in text and "allowed: silu" in text


def test_what_the_engine_cannot_represent_is_refused():
    base = json.loads((HF_CONFIGS_DIR / "qwen3-30b-a3b" / "config.json").read_text())
    with pytest.raises(HFConfigError, match="decoder_sparse_step"):
        hf_fields({**base, "decoder_sparse_step": 2})
    with pytest.raises(HFConfigError, match="use_sliding_window"):
        hf_fields({**base, "use_sliding_window": True})
    ds = json.loads((HF_CONFIGS_DIR / "deepseek-v3" / "config.json").read_text())
    with pytest.raises(HFConfigError, match="moe_layer_freq"):
        hf_fields({**ds, "moe_layer_freq": 2})
    oss = json.loads((HF_CONFIGS_DIR / "gpt-oss-20b" / "config.json").read_text())
    kinds = ["full_attention"] * 3 + ["sliding_attention"] * 21
    with pytest.raises(HFConfigError, match="every N-th layer"):
        hf_fields({**oss, "layer_types": kinds})


def test_mistral_qwen2_and_qwen3_dense_types():
    mistral = {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
               "num_key_value_heads": 8, "num_hidden_layers": 32, "vocab_size": 32000,
               "max_position_embeddings": 32768, "sliding_window": 4096, "hidden_act": "silu"}
    f = hf_fields(mistral)
    assert f["sliding_window"] == 4096 and f["kv_heads"] == 8 and "experts" not in f
    assert param_counts(ModelSpec(**f)).total == 7_241_732_096  # Mistral 7B v0.1
    qwen2 = {**mistral, "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
             "num_attention_heads": 28, "num_key_value_heads": 4, "num_hidden_layers": 28, "vocab_size": 152064,
             "use_sliding_window": False, "sliding_window": 131072}
    f = hf_fields(qwen2)
    assert f["qkv_bias"] is True
    assert param_counts(ModelSpec(**f)).total == 7_615_616_512  # Qwen2-7B
    qwen3 = {**mistral, "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
             "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 36, "vocab_size": 151936,
             "head_dim": 128, "use_sliding_window": False, "sliding_window": None, "attention_bias": False}
    f = hf_fields(qwen3)
    assert f["qk_norm"] is True and "head_size" not in f  # 4096 / 32 = 128 already
    assert param_counts(ModelSpec(**f)).total == 8_190_735_360  # Qwen3-8B
