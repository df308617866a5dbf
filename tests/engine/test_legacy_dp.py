"""Legacy nn.DataParallel (parallel.dp_mode = "dataparallel"): config rules, GPU 0's extra load, the
traffic through GPU 0 and the step that stops scaling — hand-worked on the tiny preset.

Tiny, fp32, AdamW, b = 2, s = 64, V = 512, N = 4 GPUs: Ψ = 1,607,808, so 4Ψ = 6,431,232 B.
"""

from __future__ import annotations

import pytest

from engine import ConfigError, default_config
from engine.config import Config
from engine.legacy_dp import scaling, transfers
from engine.memory import memory_per_rank
from engine.predict import predict

PSI = 1_607_808
S, B, V = 64, 2, 512


def legacy(n=4, **parallel):
    return default_config().replace(cluster={"gpus": n},
                                    parallel={"dp": n, "pp": 1, "microbatches": 1, "dp_mode": "dataparallel",
                                              **parallel})


def test_dp_mode_rules_name_the_fields():
    with pytest.raises(ConfigError) as e:
        default_config().replace(parallel={"dp_mode": "dataparallel"})  # the default has pp = 2
    (p,) = e.value.problems
    assert p.field == "parallel.dp_mode" and "parallel.pp = 2" in p.message and "parallel.tp = 1" in p.message
    with pytest.raises(ConfigError) as e:
        legacy(zero=1)
    assert "parallel.zero = 1" in str(e.value)
    with pytest.raises(ConfigError) as e:
        default_config().replace(parallel={"dp_mode": "dp"})
    assert "allowed: ddp | dataparallel" in str(e.value)
    with pytest.raises(ConfigError) as e:
        Config.from_dict({"model": {"preset": "tiny"}, "cluster": {"gpu": "h100-sxm", "gpus": 16, "gpus_per_node": 8},
                          "parallel": {"dp": 16, "dp_mode": "dataparallel"}})
    assert "one node" in str(e.value)
    cfg = legacy()
    assert Config.loads_toml(cfg.dumps_toml()) == cfg


def test_gpu0_carries_the_optimizer_the_loss_and_the_reduce():
    cfg = legacy()
    mem = predict(cfg).memory
    one = memory_per_rank(cfg.replace(cluster={"gpus": 1}, parallel={"dp": 1, "dp_mode": "ddp"})).per_rank[0]
    g0, others = mem.per_rank[0], mem.per_rank[1:]
    assert len(mem.per_rank) == 4
    # GPU 0: the module (4Ψ), .grad (4Ψ), AdamW (8Ψ) — exactly one GPU's full fine-tuning states
    assert (g0.params, g0.grads, g0.optimizer) == (4 * PSI, 4 * PSI, 8 * PSI)
    # + the other 3 replicas' fp32 log-probabilities, 3 × 4·s·b·V
    assert g0.activations == one.activations + 3 * 4 * S * B * V
    # + their gathered logits and loss gradient 3 × 2·4·s·b·V, + its replica's grads before the reduce-add
    assert g0.temporaries == one.temporaries + 3 * 2 * 4 * S * B * V + 4 * PSI
    for r in others:
        assert (r.params, r.grads, r.optimizer) == (4 * PSI, 4 * PSI, 0)  # broadcast copy, transient grads
        assert r.activations == one.activations - 4 * S * B * V  # no loss on the replicas
        assert r.temporaries == 4 * S * B * V  # its logits until gathered (the loss temporaries are GPU 0's)
        assert r.total < g0.total


def test_traffic_through_gpu0_hand_worked():
    ids, bcast, gather, scatter_grads, reduce = (t.bytes_through_gpu0 for t in transfers(legacy()))
    assert ids == 3 * 8 * S * B == 3_072  # token ids to 3 GPUs
    assert bcast == 4 * PSI  # ring broadcast: GPU 0 sends the parameters once
    assert gather == scatter_grads == 3 * 4 * S * B * V  # 3 replicas' fp32 logits in, their gradients out
    assert reduce == 4 * PSI  # every replica's gradients reduced onto GPU 0
    assert transfers(legacy(n=1)) == []


def test_step_breakdown_sums_and_stops_scaling():
    cfg = Config.from_dict({"model": {"preset": "gpt2-124m"}, "cluster": {"gpu": "h100-sxm", "gpus": 8},
                            "parallel": {"dp": 8, "dp_mode": "dataparallel"},
                            "training": {"micro_batch_size": 8, "precision": "bf16-mixed"}})
    st = predict(cfg).step
    assert st.seconds == pytest.approx(sum(st.breakdown.values()))
    for key in ("compute", "python_gil_exposed", "loss_on_gpu0", "dp_comm_exposed", "optimizer"):
        assert st.breakdown[key] > 0, key
    rows = {r["gpus"]: r for r in scaling(cfg)}
    assert set(rows) == {1, 2, 4, 8}
    ddp_gain = rows[8]["ddp_tokens_per_s"] / rows[1]["ddp_tokens_per_s"]
    dp_gain = rows[8]["dataparallel_tokens_per_s"] / rows[1]["dataparallel_tokens_per_s"]
    assert ddp_gain > 6 and dp_gain < 2  # DDP scales, nn.DataParallel flattens out
    assert rows[8]["gpu0_bytes"] > 4 * rows[8]["other_gpu_bytes"]  # the imbalance
    # exposed communication grows with N: gather/scatter through GPU 0 are (N − 1)×
    comm = [predict(cfg.replace(cluster={"gpus": n}, parallel={"dp": n})).step.breakdown["dp_comm_exposed"]
            for n in (2, 4, 8)]
    assert comm[0] < comm[1] < comm[2]


def test_gpu0_takes_the_whole_batchs_loss_where_one_gpu_peaks_in_its_backward():
    """Where the single GPU peaks in a backward (LoRA's MLP backward over a long sequence and a short vocabulary),
    GPU 0 still peaks at the loss, the other replicas' log-probabilities and loss gradients on it: the larger of
    its two moments (golden entry 353, Llama 3 405B LoRA dp8: GPU 0's loss terms read 0 when the one-GPU peak moved)."""
    from engine.memory.lifetimes import LOSS

    cfg = legacy(n=4).replace(model={"seq_len": 128}, training={"finetune": "lora", "lora_targets": "mlp",
                                                                 "recompute": "full"})
    one = memory_per_rank(cfg.replace(cluster={"gpus": 1}, parallel={"dp": 1, "dp_mode": "ddp"})).per_rank[0]
    tl = one._body.timeline
    assert tl.peak.phase != LOSS  # the one GPU's peak is not the loss's moment
    at_loss = tl.snapshot(tl.peak_in_phase(LOSS))
    logp = sum(t.bytes for t in at_loss["activations"] if t.kind == "log_probabilities")
    g0 = predict(cfg).memory.per_rank[0]
    extra = [t for t in g0.explain("activations") if t.kind == "log_probabilities" and "other 3 replicas" in t.label]
    assert logp > 0 and [t.bytes for t in extra] == [3 * logp]
