"""Exact parameter counts (hand-worked) and what each stage / TP shard holds."""

import pytest

from engine import Config
from engine.model.params import chunk_sizes, param_counts, params_per_rank


def _cfg(model: dict, **parallel) -> Config:
    par = {"dp": 1, "tp": 1, "pp": 1, **parallel}
    gpus = par["dp"] * par["tp"] * par["pp"]
    return Config.from_dict({"model": model, "cluster": {"gpu": "h100-sxm", "gpus": gpus}, "parallel": par})


def _preset(name: str) -> Config:
    return _cfg({"preset": name})


def test_gpt2_small_exact():
    c = param_counts(_preset("gpt2-124m").model)
    # 50257·768 + 1024·768 + 12·(4·768² + 4·768 + 2·768·3072 + 3072 + 768 + 2·2·768) + 2·768
    assert c.embedding == 38_597_376
    assert c.position == 786_432
    assert c.layer.attention == 2_359_296 and c.layer.mlp == 4_718_592
    assert c.layer.norms == 3_072 and c.layer.biases == 6_912
    assert c.per_layer == 7_087_872
    assert c.final_norm == 1_536 and c.head == 0
    assert c.total == 124_439_808


def test_llama_presets_exact():
    assert param_counts(_preset("llama2-7b").model).total == 6_738_415_616
    assert param_counts(_preset("llama3-8b").model).total == 8_030_261_248
    assert param_counts(_preset("llama3-70b").model).total == 70_553_706_496


def test_llama2_7b_parts():
    c = param_counts(_preset("llama2-7b").model)
    assert c.layer.attention == 4 * 4096**2
    assert c.layer.mlp == 3 * 4096 * 11008
    assert c.layer.norms == 2 * 4096 and c.layer.biases == 0
    assert c.embedding == c.head == 32000 * 4096


def test_gqa_attention_count():
    c = param_counts(_preset("llama3-8b").model)
    # q and o: 4096², k and v: 4096·1024 each
    assert c.layer.attention == 2 * 4096**2 + 2 * 4096 * 1024


def test_chunk_sizes_like_torch_chunk():
    assert chunk_sizes(10, 4) == [3, 3, 3, 1]
    assert chunk_sizes(50257, 2) == [25129, 25128]
    assert chunk_sizes(8, 4) == [2, 2, 2, 2]


def test_stages_sum_to_model_and_hold_ends():
    cfg = _cfg({"preset": "llama2-7b"}, pp=4, microbatches=4)
    grid = params_per_rank(cfg)
    total = sum(row[0].total for row in grid)
    assert total == param_counts(cfg.model).total
    assert grid[0][0].stages[0].embedding == 32000 * 4096 and grid[0][0].stages[0].head == 0
    assert grid[3][0].stages[0].head == 32000 * 4096 and grid[3][0].stages[0].final_norm == 4096
    assert [row[0].layers for row in grid] == [8, 8, 8, 8]


def test_uneven_split_first_stages_take_the_remainder():
    cfg = _cfg({"preset": "tiny", "layers": 10}, pp=4, microbatches=4)
    assert [row[0].layers for row in params_per_rank(cfg)] == [3, 3, 2, 2]


def test_v_placement_puts_embedding_and_head_on_rank0():
    cfg = _cfg({"preset": "tiny"}, pp=2, schedule="ZBVZeroBubble", virtual_stages=2, microbatches=4)
    grid = params_per_rank(cfg)
    assert grid[0][0].stage_indices == (0, 3)
    assert grid[1][0].stage_indices == (1, 2)
    assert grid[0][0].stages[0].embedding > 0 and grid[0][0].stages[1].head > 0
    assert grid[1][0].total == 4 * param_counts(cfg.model).per_layer
    # nothing doubled: the ranks together hold the model once
    assert sum(row[0].total for row in grid) == param_counts(cfg.model).total


def test_tied_embeddings_copy_on_the_last_stage():
    tied = {"preset": "tiny", "tied_embeddings": True}
    one = params_per_rank(_cfg(tied))
    assert one[0][0].total == param_counts(_cfg(tied).model).total
    two = params_per_rank(_cfg(tied, pp=2, microbatches=2))
    assert two[1][0].stages[0].head == 512 * 128  # the last stage's own copy
    # a stage is its own module (backend.model.cut_stage): a copy even when rank 0 holds both ends
    v = params_per_rank(_cfg(tied, pp=2, schedule="DualPipeV", virtual_stages=2, microbatches=4))
    assert v[0][0].stages[-1].head == 512 * 128


def test_counts_equal_the_backend_model():
    torch = pytest.importorskip("torch")
    model_mod = pytest.importorskip("backend.model")
    for preset in ("tiny", "gpt2-124m", "llama2-7b", "llama3-8b"):
        spec = _preset(preset).model
        with torch.device("meta"):
            built = model_mod.Transformer(spec)
        assert model_mod.count_parameters(built) == param_counts(spec).total, preset
    # every stage the backend cuts holds what params_per_rank says, tied and untied
    for tied in (False, True):
        cfg = _cfg({"preset": "gpt2-124m", "tied_embeddings": tied, "layers": 5}, pp=2, microbatches=2)
        for stage, row in enumerate(params_per_rank(cfg)):
            with torch.device("meta"):
                cut = model_mod.cut_stage(model_mod.Transformer(cfg.model), stage, 2)
            assert model_mod.count_parameters(cut) == row[0].total, (tied, stage)


def test_tp_shards_sum_to_the_model():
    for preset in ("gpt2-124m", "llama3-8b"):
        cfg = _cfg({"preset": preset}, tp=4 if preset == "llama3-8b" else 2)
        row = params_per_rank(cfg)[0]
        c = param_counts(cfg.model)
        t = cfg.parallel.tp
        replicated = c.position + c.final_norm + c.layers * (
            c.layer.norms + (cfg.model.hidden * 2 if cfg.model.bias else 0))  # norms, o and down biases
        assert sum(r.total for r in row) == c.total + (t - 1) * replicated


def test_gpt2_tp2_vocab_chunks():
    row = params_per_rank(_cfg({"preset": "gpt2-124m"}, tp=2))[0]
    assert row[0].stages[0].embedding == 25129 * 768
    assert row[1].stages[0].embedding == 25128 * 768
