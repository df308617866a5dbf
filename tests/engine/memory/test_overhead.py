"""Device overhead follows the device: no CUDA context and no NCCL buffers on CPU ranks over gloo."""

from engine import Config, default_config
from engine.memory.overhead import collective_buffer_bytes, collective_library, communicators
from engine.predict import predict

MIB = 2**20


def test_cpu_ranks_have_no_context_and_no_communicator_buffers_whatever_the_conventions():
    cfg = default_config().replace(conventions={"collective_buffers": True, "runtime_context": True})
    assert cfg.cluster.gpu.name == "cpu" and collective_library(cfg) == "gloo"
    pred = predict(cfg)
    for r in pred.memory.per_rank:
        assert r.overhead == 0
        assert r.total == r.params + r.grads + r.optimizer + r.activations + r.comm_buffers + r.temporaries
        (term,) = r.explain("overhead")
        assert "gloo" in term.label and term.bytes == 0


def test_gpus_keep_their_context_and_one_buffer_per_communicator():
    raw = default_config().to_dict()
    raw["cluster"] = {"gpu": "h100-sxm", "gpus": 4}
    raw["conventions"].update(collective_buffers=True, runtime_context=True)
    cfg = Config.from_dict(raw)
    assert collective_library(cfg) == "nccl" and collective_buffer_bytes(cfg) == 64 * MIB
    comms = communicators(cfg)
    assert comms == ["world", "dp", "pp"]
    r = predict(cfg).memory.per_rank[0]
    assert r.overhead == int(0.5 * 2**30) + len(comms) * 64 * MIB
    assert all(not t.tracked for t in r.explain("overhead"))
    raw["cluster"]["gpu"] = "mi300x"
    amd = Config.from_dict(raw)
    assert collective_library(amd) == "rccl" and collective_buffer_bytes(amd) == 64 * MIB
