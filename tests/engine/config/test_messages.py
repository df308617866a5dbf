"""Messages a newcomer reads (issue 27, item 8): no "= None" where there is no value, one problem for an
unknown preset, "did you mean" for a near key, a Hugging Face config.json named as what it is."""

import json

import pytest

from engine import Config, ConfigError
from engine.config.problems import NO_VALUE, Problem, unknown_key


def _problems(text: str, suffix: str = ".toml", tmp_path=None) -> list[str]:
    f = tmp_path / f"c{suffix}"
    f.write_text(text)
    with pytest.raises(ConfigError) as err:
        Config.load(f)
    return [str(p) for p in err.value.problems]


def test_a_problem_without_a_value_shows_none_of_it():
    assert str(Problem("file", NO_VALUE, "is not valid TOML")) == "file: is not valid TOML"
    assert str(Problem("parallel.tp", None, "must be an integer")) == "parallel.tp = None: must be an integer"


def test_broken_toml_and_an_empty_file(tmp_path):
    (msg,) = _problems("[model\npreset = 'tiny'\n", tmp_path=tmp_path)
    assert msg.startswith("file: is not valid TOML") and "None" not in msg
    (msg,) = _problems("", tmp_path=tmp_path)
    assert msg.startswith("model: no [model] section: name a preset") and "hf_config" in msg and "None" not in msg


def test_an_unknown_preset_is_one_problem_with_the_nearest_name(tmp_path):
    (msg,) = _problems("[model]\npreset = 'llama3-8bb'\n", tmp_path=tmp_path)
    assert "unknown preset; did you mean llama3-8b?" in msg and "allowed: tiny" in msg


def test_a_typo_in_a_key_says_which_key_was_meant(tmp_path):
    (msg,) = _problems("[model]\npreset = 'tiny'\n[training]\nmicro_batch_sise = 2\n", tmp_path=tmp_path)
    assert "training.micro_batch_sise = 2: unknown key; did you mean micro_batch_size? allowed:" in msg
    assert unknown_key("zzz", ["alpha", "beta"]) == "unknown key; allowed: alpha, beta"  # nothing near: no guess
    with pytest.raises(ConfigError) as err:
        Config.from_dict({"model": {"preset": "tiny"}}).replace(parallel={"pipline_split": "even"})
    assert "did you mean pipeline_split?" in str(err.value)


def test_a_hugging_face_config_json_given_as_a_config_points_at_hf_config(tmp_path):
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
          "num_hidden_layers": 32, "num_attention_heads": 32, "vocab_size": 128256}
    (msg,) = _problems(json.dumps(hf), suffix=".json", tmp_path=tmp_path)
    assert msg.startswith("file: is a Hugging Face model config") and 'hf_config = "PATH/config.json"' in msg
