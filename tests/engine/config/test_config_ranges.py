"""Every numeric field of a Config has a documented range: the edge is accepted, just outside is not."""

from __future__ import annotations

import dataclasses
import math

import pytest

from engine import Config, ConfigError
from engine.config import FIELD_RANGES, ClusterSpec, Conventions, GPUSpec, ModelSpec, ParallelSpec, TrainingSpec

BASE = Config.from_dict({"model": {"preset": "llama2-7b"}, "cluster": {"gpu": "h100-sxm", "gpus": 8}})

# Fields that must move with an edge value so that the rest of the config stays valid.
COMPANIONS: dict[tuple[str, float], dict[str, object]] = {
    ("model.hidden", 1): {"model.heads": 1, "model.kv_heads": 1},
    ("model.heads", 4096): {"model.hidden": 4096},
    ("model.heads", 1): {"model.kv_heads": 1},
    ("model.kv_heads", 4096): {"model.heads": 4096, "model.hidden": 4096},
    ("parallel.tp", 4096): {"model.heads": 4096, "model.kv_heads": 4096, "model.hidden": 4096,
                            "model.ffn_hidden": 4096 * 3, "parallel.dp": 1, "cluster.gpus": 4096},
    ("parallel.pp", 90): {"model.layers": 90, "parallel.dp": 1, "cluster.gpus": 90, "cluster.gpus_per_node": 90,
                          "parallel.schedule": "GPipe"},
    ("parallel.virtual_stages", 512): {"model.layers": 1024, "parallel.pp": 2, "parallel.dp": 4,
                                       "parallel.schedule": "Interleaved1F1B", "parallel.microbatches": 2},
    ("parallel.cp", 1048576): {"parallel.dp": 1, "cluster.gpus": 1048576, "model.seq_len": 2097152},
    ("parallel.dp", 1): {"cluster.gpus": 1},
    ("parallel.dp", 1048576): {"cluster.gpus": 1048576},
    ("parallel.replicate", 1048576): {"parallel.dp": 1048576, "cluster.gpus": 1048576, "parallel.zero": 3},
    ("cluster.gpus", 1): {"parallel.dp": 1},
    ("cluster.gpus", 1048576): {"parallel.dp": 1048576},
    ("cluster.gpus_per_node", 1024): {"cluster.gpus": 1024, "parallel.dp": 1024},
    ("cluster.gpus_per_node", 1): {"cluster.gpus": 1, "parallel.dp": 1},
    ("parallel.ep", 1048576): {"model.experts": 1048576, "parallel.dp": 1048576, "cluster.gpus": 1048576},
}


def _integer(path: str) -> bool:
    *parents, key = path.split(".")
    cls = {"model": ModelSpec, "cluster": ClusterSpec, "parallel": ParallelSpec, "training": TrainingSpec,
           "conventions": Conventions, "cluster.gpu": GPUSpec}[".".join(parents)]
    return {f.name: f.type for f in dataclasses.fields(cls)}[key] in (int, "int")


def build(updates: dict[str, object]) -> Config:
    """BASE with some dotted fields changed, constructed directly (so check() sees the raw values)."""
    sections = {name: getattr(BASE, name) for name in ("model", "cluster", "parallel", "training", "conventions")}
    gpu_updates = {k.split(".")[2]: v for k, v in updates.items() if k.startswith("cluster.gpu.")}
    for name in sections:
        mine = {k.split(".", 1)[1]: v for k, v in updates.items()
                if k.split(".", 1)[0] == name and not k.startswith("cluster.gpu.")}
        if name == "cluster" and gpu_updates:
            mine["gpu"] = dataclasses.replace(BASE.cluster.gpu, **gpu_updates)
        sections[name] = dataclasses.replace(sections[name], **mine)
    return Config(**sections)


def problems_on(path: str, updates: dict[str, object]) -> list:
    try:
        build(updates)
    except ConfigError as err:
        return [p for p in err.problems if p.field == path]
    return []


def edges(path: str):
    """(value at the edge, value just outside) for both ends of the field's range."""
    r = FIELD_RANGES[path]
    if _integer(path):
        lo_in, lo_out = (r.lo + 1, r.lo) if r.lo_open else (r.lo, r.lo - 1)
        hi_in, hi_out = (r.hi - 1, r.hi) if r.hi_open else (r.hi, r.hi + 1)
        return [(int(lo_in), int(lo_out)), (int(hi_in), int(hi_out))]
    lo_in = math.nextafter(r.lo, math.inf) if r.lo_open else float(r.lo)
    lo_out = float(r.lo) if r.lo_open else math.nextafter(r.lo, -math.inf)
    hi_in = math.nextafter(r.hi, -math.inf) if r.hi_open else float(r.hi)
    hi_out = float(r.hi) if r.hi_open else math.nextafter(r.hi, math.inf)
    return [(lo_in, lo_out), (hi_in, hi_out)]


CASES = [(path, inside, outside) for path in FIELD_RANGES for inside, outside in edges(path)]


@pytest.mark.parametrize(("path", "inside", "outside"), CASES, ids=[f"{c[0]}={c[2]}" for c in CASES])
def test_each_bound_accepts_its_edge_and_rejects_just_outside(path, inside, outside):
    companions = COMPANIONS.get((path, inside), {})
    cfg = build({**companions, path: inside})  # the whole config is valid at the edge
    *parents, key = path.split(".")
    obj = cfg
    for name in parents:
        obj = getattr(obj, name)
    assert getattr(obj, key) == inside
    found = problems_on(path, {**companions, path: outside})
    assert found, f"{path} = {outside} was accepted"
    assert f"allowed: {FIELD_RANGES[path].describe()}" in found[0].message
    assert path in str(found[0])


def test_every_numeric_field_has_a_range():
    classes = {"model": ModelSpec, "cluster": ClusterSpec, "cluster.gpu": GPUSpec, "parallel": ParallelSpec,
               "training": TrainingSpec, "conventions": Conventions}
    numeric = {f"{section}.{f.name}" for section, cls in classes.items() for f in dataclasses.fields(cls)
               if f.type in ("int", "float", int, float)}
    assert numeric == set(FIELD_RANGES)
    for path, r in FIELD_RANGES.items():
        assert r.lo < r.hi and r.source, path


def test_a_billion_layers_is_refused_with_the_range():
    with pytest.raises(ConfigError) as err:
        Config.from_dict({"model": {"preset": "tiny", "layers": 1_000_000_000}, "cluster": {"gpu": "cpu"}})
    (problem,) = [p for p in err.value.problems if p.field == "model.layers"]
    assert str(problem) == "model.layers = 1000000000: allowed: 1 … 1024; must be at most 1024"


def test_bounds_cover_real_models_and_clusters():
    r = FIELD_RANGES
    assert r["model.layers"].contains(126) and r["model.hidden"].contains(16384) and r["model.heads"].contains(128)
    assert r["model.ffn_hidden"].contains(73728) and r["model.vocab"].contains(3_000_000)
    assert r["model.seq_len"].contains(4_000_000) and r["cluster.gpus"].contains(200_000)
    assert r["parallel.dp"].contains(100_000)


@pytest.mark.parametrize("path", [p for p in FIELD_RANGES if not _integer(p)])
def test_nan_and_wrong_types_are_refused(path):
    assert problems_on(path, {path: float("nan")})
    assert problems_on(path, {path: "12"})[0].message.startswith("must be a number")


def test_an_integer_field_refuses_a_fraction():
    assert problems_on("model.layers", {"model.layers": 2.5})[0].message.startswith("must be an integer")


def test_torchtitan_knobs_are_checked_together():
    from engine import Config, ConfigError, default_config
    from engine.pipeline.layout import split_layers

    base = default_config().to_dict()

    def problems(**sections):
        raw = {k: dict(v) for k, v in base.items() if isinstance(v, dict)}
        for sec, kv in sections.items():
            raw[sec].update(kv)
        try:
            Config.from_dict(raw)
        except ConfigError as err:
            return err.fields()
        return set()

    assert problems(training={"float8": "tensorwise"}) == {"training.float8"}  # the default is fp32
    assert problems(training={"float8": "tensorwise", "precision": "bf16-mixed", "grad_dtype": "bf16"}) == set()
    assert problems(training={"float8_all_gather": True}) == {"training.float8_all_gather"}
    assert problems(parallel={"async_tp": True}) == {"parallel.async_tp"}
    assert problems(parallel={"fsdp_reshard_after_forward": "never"}) == {"parallel.fsdp_reshard_after_forward"}
    assert problems(parallel={"fsdp_reshard_after_forward": "never", "zero": 3}) == set()
    assert problems(parallel={"pipeline_split": "torchtitan"}) == set()  # 8 layers over pp 2
    assert problems(parallel={"pipeline_split": "diagonal"}) == {"parallel.pipeline_split"}
    assert problems(training={"recompute": "selective-layer", "recompute_every": 0}) == {"training.recompute_every"}
    # torchtitan's split: the embedding and norm + head weigh one block each
    assert [len(r) for r in split_layers(8, 4, "torchtitan")] == [2, 3, 2, 1]
    assert [len(r) for r in split_layers(126, 8, "torchtitan")] == [15, 16, 16, 16, 16, 16, 16, 15]
    assert [len(r) for r in split_layers(10, 4)] == [3, 3, 2, 2]
