"""torchtitan 0.3.0's own ConfigManager judges ShardScope's torchtitan command lines.

The judge runs in the judges' venv (``make test`` builds ``.venv-judges``: torchtitan 0.3.0, torchao, triton;
``SHARDSCOPE_JUDGES`` names another). Every exported command must parse there, and torchtitan must read from it
what ShardScope's reader reads: the model, batch, sequence, precision, every parallel degree and option,
compile, recomputation and float8.
"""

from __future__ import annotations

import random

from engine import Config
from engine.interop.torchtitan import _DEFAULTS, export_torchtitan_command, read_torchtitan
from tests.engine.interop.test_torchtitan import PUBLISHED, _expressible
from tests.judges.run import run_judge

#: torchtitan 0.3.0's llama3_405b builds its Float8LinearConverter when the config is loaded, and that refuses a
#: machine without an SM89+ GPU ("float8 is only supported on NVIDIA SM89 or later"): the judge cannot read it here
JUDGED = ("llama3-8b", "llama3-70b", "qwen3-30b-a3b")


def _commands() -> list[str]:
    cfgs = [c for c in (Config.load(p) for p in sorted(PUBLISHED.glob("*.toml"))) if c.model.preset in JUDGED]
    rng = random.Random(20261204)
    while len(cfgs) < 40:
        cfg = _expressible(rng)
        if cfg is not None and cfg.model.preset in JUDGED:
            cfgs.append(cfg)
    return [[ln for ln in export_torchtitan_command(c).text.splitlines() if not ln.startswith("#")][-1] for c in cfgs]


def _ours(command: str) -> dict:
    reader, _, _, _ = read_torchtitan(command)
    s = {**_DEFAULTS, **reader.settings}
    return {**s, "float8": any("float8" in c for c in s.get("model.converters") or [])}


def test_torchtitan_reads_every_exported_command_as_shardscope_does():
    commands = _commands()
    theirs = run_judge("torchtitan_judge.py", [c.split(" -m torchtitan.train ", 1)[1].split() for c in commands])
    for command, judged in zip(commands, theirs, strict=True):
        assert "error" not in judged, (command, judged.get("error"))
        ours = _ours(command)
        for key, value in judged.items():
            if key == "parallelism.pipeline_parallel_layers_per_stage" and value is None:
                assert key not in ours, command
                continue
            if key == "parallelism.enable_sequence_parallel" and ours["parallelism.tensor_parallel_degree"] == 1:
                continue  # without TP the flag is inert; the export leaves it at torchtitan's default
            assert ours.get(key) == value, (command, key, ours.get(key), value)


def test_torchtitan_0_2_reads_every_exported_job_config_as_shardscope_does():
    from engine.interop.torchtitan import export_torchtitan_toml

    cfgs = [Config.load(p) for p in sorted(PUBLISHED.glob("*.toml"))]
    rng = random.Random(20261205)
    while len(cfgs) < 40:
        cfg = _expressible(rng)
        if cfg is not None:
            cfgs.append(cfg)
    texts = [export_torchtitan_toml(c).text for c in cfgs]
    theirs = run_judge("torchtitan02_judge.py", texts, path="torchtitan-0.2.2")
    for text, judged in zip(texts, theirs, strict=True):
        assert "error" not in judged, (text, judged.get("error"))
        reader, flavour, _, _ = read_torchtitan(text)
        assert flavour == "0.1-0.2"
        ours = {**_DEFAULTS, "float8.recipe_name": None, "float8.enable_fsdp_float8_all_gather": False,
                "model.converters": [], "training.global_batch_size": -1,
                "parallelism.pipeline_parallel_layers_per_stage": None, **reader.settings}
        for key, value in judged.items():
            assert ours.get(key) == value, (key, ours.get(key), value, text)
