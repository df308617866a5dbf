"""The whole config space, junk included (hypothesis over ``tests/config_space.py``): every input is
either refused with the config error, naming a field, or predicted with finite, non-negative numbers
that the CLI's table renders. (``benchmarks/fuzz_configs.py`` runs 10,000 draws and times them.)"""

from __future__ import annotations

import json

from config_space import bad_numbers, random_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import Config, ConfigError
from engine.predict import predict
from gui.text import prediction_table


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.randoms(use_true_random=False), st.sampled_from([0.0, 0.3, 1.0]))
def test_every_config_is_refused_by_field_or_predicted_with_sound_numbers(rng, junk):
    raw = random_config(rng, junk)
    try:
        cfg = Config.from_dict(raw)
    except ConfigError as exc:
        assert exc.problems and all(p.field for p in exc.problems)
        assert "Traceback" not in str(exc)
        return
    pred = predict(cfg)
    assert prediction_table(pred)
    assert bad_numbers(pred) == [], json.dumps(raw, default=str)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=400) | st.text(max_size=400))
def test_any_file_content_is_refused_by_field_or_read(content):
    """Bytes or text as a config file: the config error (naming "file" or a field), never another."""
    text = content.decode("utf-8", errors="replace") if isinstance(content, bytes) else content
    for load in (Config.loads_toml, Config.loads_json):
        try:
            load(text)
        except ConfigError as exc:
            assert exc.problems and all(p.field for p in exc.problems)
