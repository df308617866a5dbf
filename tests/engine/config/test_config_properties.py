"""Property tests: random configs get either a valid Config or the project's own ConfigError."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import Config, ConfigError, names

small_int = st.integers(min_value=-2, max_value=64)
anything = st.one_of(small_int, st.booleans(), st.text(max_size=5), st.floats(allow_nan=True), st.none(),
                     st.lists(st.integers(), max_size=2))


def maybe(strategy):
    return st.one_of(strategy, anything)


model = st.fixed_dictionaries({}, optional={
    "preset": maybe(st.sampled_from(["tiny", "gpt2-124m", "llama3-8b", "nope"])),
    "layers": maybe(st.integers(0, 40)), "hidden": maybe(st.sampled_from([0, 64, 96, 128, 130])),
    "heads": maybe(st.integers(0, 16)), "kv_heads": maybe(st.integers(0, 16)),
    "ffn_hidden": maybe(st.integers(0, 512)), "vocab": maybe(st.integers(0, 1000)),
    "seq_len": maybe(st.integers(0, 128)), "mlp": maybe(st.sampled_from(names.MLP_KINDS + ("x",))),
    "attention": maybe(st.sampled_from(names.ATTENTION_KINDS)), "dropout": maybe(st.floats(-1, 2)),
    "bogus": anything,
})
parallel = st.fixed_dictionaries({}, optional={
    "dp": maybe(st.integers(0, 8)), "tp": maybe(st.integers(0, 8)), "pp": maybe(st.integers(0, 8)),
    "zero": maybe(st.integers(-1, 4)), "replicate": maybe(st.integers(0, 4)),
    "sequence_parallel": maybe(st.booleans()), "schedule": maybe(st.sampled_from(names.SCHEDULES + ("x",))),
    "virtual_stages": maybe(st.integers(0, 4)), "microbatches": maybe(st.integers(0, 16)),
    "fsdp": maybe(st.sampled_from(list(names.FSDP_STRATEGIES))),
})
cluster = st.fixed_dictionaries({}, optional={
    "gpu": maybe(st.sampled_from(["cpu", "h100-sxm", "nope"])), "gpus": maybe(st.integers(0, 64)),
    "gpus_per_node": maybe(st.integers(0, 8)), "preset": maybe(st.sampled_from(["dgx-h100", "x"])),
    "inter_node_bandwidth_gb_per_s": maybe(st.floats(-1, 100)),
})
training = st.fixed_dictionaries({}, optional={
    "micro_batch_size": maybe(st.integers(0, 4)), "precision": maybe(st.sampled_from(names.PRECISIONS)),
    "grad_dtype": maybe(st.sampled_from(names.GRAD_DTYPES)), "optimizer": maybe(st.sampled_from(names.OPTIMIZERS)),
    "recompute": maybe(st.sampled_from(names.RECOMPUTE_KINDS)),
})
raw_config = st.fixed_dictionaries({"model": maybe(model)}, optional={
    "cluster": maybe(cluster), "parallel": maybe(parallel), "training": maybe(training),
    "schema_version": maybe(st.just(1)),
})


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw_config)
def test_validator_returns_config_or_config_error(raw):
    try:
        cfg = Config.from_dict(raw)
    except ConfigError as err:
        assert err.problems, "a ConfigError always lists its problems"
        for p in err.problems:
            assert p.field and p.message
        return
    # A valid config obeys the core invariants and survives a round trip.
    par = cfg.parallel
    assert par.dp * par.tp * par.pp == cfg.cluster.gpus
    assert cfg.model.heads % par.tp == 0 and cfg.model.kv_heads % par.tp == 0
    assert par.pp * par.virtual_stages <= cfg.model.layers
    assert Config.from_dict(cfg.to_dict()) == cfg


@settings(max_examples=300, deadline=None)
@given(
    model=st.sampled_from(["tiny", "gpt2-124m", "llama2-7b", "llama3-70b"]),
    dp=st.sampled_from([1, 2, 4]), tp=st.sampled_from([1, 2, 4]), pp=st.sampled_from([1, 2, 4]),
    zero=st.integers(0, 3), schedule=st.sampled_from(names.SCHEDULES), v=st.integers(1, 3),
    m=st.integers(1, 16), sp=st.booleans(),
)
def test_near_valid_layouts_are_accepted_or_explained(model, dp, tp, pp, zero, schedule, v, m, sp):
    raw = {"model": {"preset": model}, "cluster": {"gpu": "a100-80g", "gpus": dp * tp * pp},
           "parallel": {"dp": dp, "tp": tp, "pp": pp, "zero": zero, "schedule": schedule,
                        "virtual_stages": v, "microbatches": m, "sequence_parallel": sp}}
    try:
        cfg = Config.from_dict(raw)
    except ConfigError as err:
        # every rejection names a parallel field (the model presets themselves are valid)
        assert all(p.field.startswith("parallel.") for p in err.problems), err.problems
        return
    assert cfg.parallel.world_size == cfg.cluster.gpus
