"""FSDP2 as torchtitan runs it: reshard policy, FSDP2 under pipelining, float8 all-gather — hand-worked
bytes on the tiny preset (hidden 128, 8 heads, 4 KV heads, FFN 352, vocabulary 512, SwiGLU, RMSNorm).

One block: norms 2 × 128, q 128·128 = 16,384, k and v 64·128 = 8,192 each, o 16,384, gate / up /
down 352·128 = 45,056 each: 184,576 elements, of which 184,320 in 7 Linear weights. Embeddings
512·128 = 65,536. pp = 2: stage 0 holds the embeddings + 4 blocks (Ψ = 803,840).
"""

import pytest

from engine import Config
from engine.memory import memory_per_rank
from engine.time.step import step_time

BLOCK, LINEAR, EMB = 184_576, 184_320, 65_536
STAGE0 = EMB + 4 * BLOCK


def cfg(dp=2, pp=2, zero=3, m=4, reshard="default", grad="bf16", float8="none", f8ag=False, schedule="1F1B"):
    return Config.from_dict({
        "model": {"preset": "tiny"}, "cluster": {"gpu": "h100-sxm", "gpus": dp * pp},
        "parallel": {"dp": dp, "pp": pp, "zero": zero, "microbatches": m, "schedule": schedule,
                     "fsdp_reshard_after_forward": reshard},
        "training": {"precision": "bf16-mixed", "grad_dtype": grad, "float8": float8, "float8_all_gather": f8ag}})


def term(c, kind, rank=0):
    found = [t for t in memory_per_rank(c).per_rank[rank].explain("comm_buffers") if t.kind == kind]
    assert len(found) == 1, [t.kind for t in memory_per_rank(c).per_rank[rank].explain("comm_buffers")]
    return found[0]


def test_zero3_pp2_default_holds_every_unit_always_reshards():
    # m = 2 = p − r on pp-rank 0 of 1F1B: both forwards run before the first backward, so a unit that
    # reshards after forward is only held current (with the stage's root, its embeddings) at the activation peak
    assert term(cfg(m=2), "fsdp_unsharded_params").bytes == 2 * STAGE0 == 1_607_680  # default: no reshard under PP
    assert term(cfg(m=2, reshard="always"), "fsdp_unsharded_params").bytes == 2 * (EMB + BLOCK) == 500_224
    assert term(cfg(m=2, reshard="never"), "fsdp_unsharded_params").bytes == 1_607_680
    # the all-gather output of the largest unit (a block) either way; with no resharding (after forward:
    # the default under PP; after backward: torch 2.13 torch/distributed/pipelining/stage.py,
    # backward_maybe_with_nosync: "self.submod.set_reshard_after_backward(False)") each unit is gathered
    # once, in the stage's first forward, so the output is not alive at the peak
    (out,) = [t for t in memory_per_rank(cfg(m=2)).per_rank[0].catalogue("comm_buffers")
              if t.kind == "all_gather_output"]
    assert out.bytes == 2 * BLOCK == 369_152
    assert not [t for t in memory_per_rank(cfg(m=2)).per_rank[0].explain("comm_buffers")
                if t.kind == "all_gather_output"]


def test_unsharded_after_first_backward():
    # m = 4 > p − r: rank 0 runs forwards after its first backward. A backward leaves every unit it gathered so
    # (set_reshard_after_backward(False)), but the stage's next forward reshards each in its post-forward
    # (reshard_after_forward): a backward after a forward holds the stage's root (its embeddings), the current block
    # and the next block's all-gather output, a backward after a backward (the cool-down) every unit and nothing
    # left to all-gather (the output's lifetime ``gathering``: every action but a backward right after a backward)
    c = cfg(m=4, reshard="always")
    terms = {t.kind: t for t in memory_per_rank(c).per_rank[0].catalogue("comm_buffers")}
    current, output = terms["fsdp_unsharded_params"].bytes, terms["all_gather_output"].bytes
    assert current == 2 * (EMB + BLOCK) and output == 2 * BLOCK
    assert current + terms["fsdp_units_kept_after_backward"].bytes == 2 * STAGE0
    rank0 = memory_per_rank(c).per_rank[0]
    laid = rank0._body.timeline
    lives = {t.kind: laid.lifetime("comm_buffers", i) for i, t in enumerate(laid.terms["comm_buffers"])}
    assert lives["fsdp_units_kept_after_backward"] == "after_a_backward"
    assert lives["all_gather_output"] == "gathering"
    # the last stage alternates F and B from its first backward on: never a backward right after a backward
    last = {t.kind: t for t in memory_per_rank(c).per_rank[2].catalogue("comm_buffers")}
    assert last["fsdp_unsharded_params"].bytes \
        + last["fsdp_units_kept_after_backward"].bytes == 2 * (4 * BLOCK + 128 + EMB)  # 4 blocks + final norm, head
    # without pipelining ZeRO-3 "always" holds the current block's unit, the next one's all-gather output
    # and the root unit (fully_shard(model): embeddings, final norm, head), gathered through
    # the forward and the backward
    unpiped = cfg(dp=4, pp=1, m=4, reshard="always")
    assert term(unpiped, "fsdp_unsharded_params").bytes == 2 * BLOCK
    assert term(unpiped, "all_gather_output").bytes == 2 * BLOCK
    assert term(unpiped, "fsdp_root_params").bytes == 2 * (EMB + 128 + EMB)


def test_gpipes_later_backwards_find_every_unit_gathered_and_gather_nothing():
    # GPipe's Bs follow one another: each leaves every unit it gathered so (torch 2.13 stage.py,
    # backward_maybe_with_nosync: set_reshard_after_backward(False) before every backward, the REDUCE_GRAD reshards),
    # so the last stage's loss before its second B holds the stage's every unit (4 blocks, final norm, head), and no
    # all-gather output: the output lives at every action but a backward right after a backward (``gathering``;
    # measure --fake of Qwen3 235B pp4 GPipe ZeRO-3 ep4, two blocks a stage: 2.52 GiB of units, no output)
    from engine.memory import lifetimes as L
    timeline = memory_per_rank(cfg(m=4, reshard="always", schedule="GPipe")).per_rank[2]._body.timeline
    at = timeline.peak_in_phase(L.LOSS)
    assert timeline.peak_moment(at).startswith("stage 1 B of microbatch 1, at its start: the loss")
    held = {t.kind: t.bytes for t in timeline.snapshot(at)["comm_buffers"]}
    assert held["fsdp_unsharded_params"] + held["fsdp_units_kept_after_backward"] == 2 * (4 * BLOCK + 128 + EMB)
    assert "all_gather_output" not in held


def test_a_rank_whose_every_stage_is_one_unit_prefetches_none():
    # each pipeline stage module is an FSDP2 root of its own and prefetches within its own units: pp4 × 2 virtual
    # stages of the tiny preset's 8 blocks is one block a stage, and pp-rank 1 holds stages 1 and 5 (no embeddings, no
    # head), so each stage's current units are one block's, and it all-gathers nothing beside them (measure --fake of
    # Llama 3 8B tp8 pp4 LoopedBFS v2 ZeRO-3 "always": one unit gathered at its B)
    def pp_rank1(schedule):
        c = Config.from_dict({
            "model": {"preset": "tiny"}, "cluster": {"gpu": "h100-sxm", "gpus": 8},
            "parallel": {"dp": 2, "pp": 4, "virtual_stages": 2, "zero": 3, "microbatches": 4, "schedule": schedule,
                         "fsdp_reshard_after_forward": "always"},
            "training": {"precision": "bf16-mixed", "grad_dtype": "bf16"}})
        return [(t.kind, t.stage, t.bytes) for t in memory_per_rank(c).per_rank[2].catalogue("comm_buffers")]
    held = pp_rank1("LoopedBFS")
    assert [(s, b) for k, s, b in held if k == "fsdp_stage_current_params"] == [(1, 2 * BLOCK), (5, 2 * BLOCK)]  # bf16
    assert not {k for k, _, _ in held} & {"fsdp_stage_all_gather_output", "fsdp_stage_forward_all_gather_output",
                                          "all_gather_output", "fsdp_unsharded_params"}


def test_always_gathers_until_the_first_backward():
    def gathers(c):
        (item,) = [i for i in step_time(c).comm.per_pp_rank[0].items if "all-gather" in i.what and i.dim == "dp"]
        return item.calls
    units = 5  # embeddings + 4 blocks on stage 0
    assert gathers(cfg(m=4, reshard="always")) == units * (2 + 1)  # 2 forwards before its first B, then that B
    assert gathers(cfg(m=4)) == units  # default under PP: once per step
    assert gathers(cfg(dp=4, pp=1, m=4, reshard="always")) == 2 * 4 * 10  # 10 units, forward + backward per microbatch


@pytest.mark.parametrize(("grad", "nbytes"), [("bf16", 2), ("fp32", 4)])
def test_grad_accumulation_dtype(grad, nbytes):
    t = term(cfg(m=4, grad=grad), "fsdp_unsharded_grads")
    assert t.bytes == nbytes * STAGE0 and (("fp32" if grad == "fp32" else "bf16") in t.label)
    # without pipelining, gradient accumulation (m > 1) accumulates in the reduce dtype too
    assert term(cfg(dp=4, pp=1, m=4, grad=grad), "fsdp_unsharded_grads").bytes == nbytes * (EMB + 8 * BLOCK + 128 + EMB)
    # m = 1 without pipelining: a block's reduce-scatter input (the last block's, kept through the next one's
    # backward: the peak here), in the reduce dtype
    assert term(cfg(dp=4, pp=1, m=1, grad=grad), "fsdp_early_reduce").bytes == nbytes * BLOCK


def test_pipelined_fsdp2_accumulates_every_unit_even_with_one_microbatch():
    c = cfg(m=1, schedule="GPipe", grad="fp32")
    (t,) = [t for t in memory_per_rank(c).per_rank[0].catalogue("comm_buffers") if t.kind == "fsdp_unsharded_grads"]
    assert t.bytes == 4 * STAGE0


def test_float8_all_gather_bytes():
    block8 = 2 * (BLOCK - LINEAR) + LINEAR + 4 * 7  # norms in bf16, 7 Linear weights in 1 B + an fp32 scale
    assert block8 == 184_860
    c = cfg(dp=4, pp=1, m=1, float8="tensorwise", f8ag=True)
    assert term(c, "fsdp_unsharded_params").bytes == block8  # the current block; the next one's all-gather output
    assert term(c, "all_gather_output").bytes == block8
    assert term(c, "fsdp_root_params").bytes == 2 * (EMB + 128 + EMB)  # the root unit stays in bf16
    # every unit: embeddings and norm + head stay in bf16
    c = cfg(dp=2, pp=2, m=4, float8="tensorwise", f8ag=True)
    assert term(c, "fsdp_unsharded_params").bytes == 2 * EMB + 4 * block8
    # float8 without its all-gather gathers bf16
    assert term(cfg(dp=4, pp=1, m=1, float8="tensorwise"), "all_gather_output").bytes == 2 * BLOCK
    # FSDP gathers move the same bytes
    (item,) = [i for i in step_time(c).comm.per_pp_rank[0].items if "all-gather" in i.what and i.dim == "dp"]
    assert item.calls * item.size_bytes == pytest.approx(2 * EMB + 4 * block8)


def test_float8_refused_without_fp8_tensor_cores():
    from engine import ConfigError

    raw = {"model": {"preset": "tiny"}, "cluster": {"gpu": "a100-80g", "gpus": 1},
           "training": {"precision": "bf16-mixed", "float8": "rowwise"}}
    with pytest.raises(ConfigError) as err:
        Config.from_dict(raw)
    assert any(p.field == "training.float8" and "float8 tensor cores" in p.message for p in err.value.problems)
    raw["cluster"]["gpu"] = "h100-sxm"
    assert Config.from_dict(raw).cluster.gpu.peak_fp8_tflops == 1979.0


def test_fresh_gradient_beside_a_reduce_dtype_accumulation():
    # fp32 accumulation of bf16 gradients: the largest unit's bf16 gradient waits for post-backward
    # (at a B's own moment, the first block's MLP backward, only w2's: engine.memory.buffers._made_by_the_b_moment)
    assert term(cfg(m=4, grad="fp32"), "fsdp_fresh_grad_made").bytes == 2 * 128 * 352
    assert not [t for t in memory_per_rank(cfg(m=4)).per_rank[0].explain("comm_buffers") if t.kind == "fsdp_fresh_grad"]


def test_pipeline_split_flows_into_every_stage_split():
    from engine.model.params import params_per_rank
    from engine.time.durations import stage_durations

    raw = {"model": {"preset": "tiny"}, "cluster": {"gpu": "h100-sxm", "gpus": 4},
           "parallel": {"pp": 4, "microbatches": 4, "pipeline_split": "torchtitan"}}
    tt = Config.from_dict(raw)
    assert [row[0].layers for row in params_per_rank(tt)] == [2, 3, 2, 1]  # split_layers(8, 4, "torchtitan")
    even = tt.replace(parallel={"pipeline_split": "even"})
    assert [row[0].layers for row in params_per_rank(even)] == [2, 2, 2, 2]
    d_tt, d_even = stage_durations(tt), stage_durations(even)
    assert d_tt.forward_s[1] > d_even.forward_s[1] and d_tt.forward_s[3] < d_even.forward_s[3]


@pytest.mark.parametrize("reshard", [True, False])
def test_split_backward_trains_later_stages_only_without_resharding_after_forward(reshard):
    """torch 2.13: a split backward's I takes its parameter groups from ``submod.parameters()`` after the
    forward; FSDP2 resharded after forward leaves those as DTensors the graph does not hold, so a later
    stage's blocks get no weight gradient at all (the first stage runs a full backward). Two stages on one
    rank, ZBV, each block fully_shard'ed: with ``reshard_after_forward`` both stages' blocks get the
    gradients plain modules get, without it stage 1's get none. So the backend refuses 'always' with a
    split-backward schedule (``engine.backend_limits.composition_problems``)."""
    torch = pytest.importorskip("torch")
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble

    from engine.backend_limits import predict_only

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

        def forward(self, x):
            return x + self.b(torch.relu(self.a(x)))

    def grads(sharded: bool) -> list[list[float | None]]:
        torch.manual_seed(0)
        stages = [torch.nn.Sequential(Block(), Block()) for _ in range(2)]
        if sharded:
            for st in stages:
                for blk in st:
                    fully_shard(blk, mesh=mesh, reshard_after_forward=reshard)
                fully_shard(st, mesh=mesh, reshard_after_forward=reshard)
        pipe = [PipelineStage(st, i, 2, torch.device("cpu")) for i, st in enumerate(stages)]
        torch.manual_seed(1)
        ScheduleZBVZeroBubble(pipe, n_microbatches=2, loss_fn=lambda o, t: o.pow(2).mean()).step(
            torch.randn(4, 8, 16), target=torch.zeros(4, 8, 16))
        out = []
        for st in stages:
            g = [blk.a.weight.grad for blk in st]
            out.append([None if x is None else float((x.full_tensor() if hasattr(x, "full_tensor") else x).abs().sum())
                        for x in g])
        return out

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plain, fsdp = grads(False), grads(True)
    finally:
        dist.destroy_process_group()
    assert fsdp[0] == pytest.approx(plain[0])  # the first stage: a full backward
    if reshard:
        assert fsdp[1] == [None, None]
    else:
        assert fsdp[1] == pytest.approx(plain[1])
    why = predict_only(Config.from_dict({
        "model": {"preset": "tiny"}, "cluster": {"gpu": "h100-sxm", "gpus": 4},
        "parallel": {"dp": 2, "pp": 2, "zero": 3, "microbatches": 4, "schedule": "ZBVZeroBubble", "virtual_stages": 2,
                     "fsdp_reshard_after_forward": "always" if reshard else "default"}}))
    assert any("no block of a later stage ever gets a weight gradient" in w for w in why) == reshard


def test_unpipelined_zero3_reduces_unit_by_unit_with_the_root_gathered_throughout():
    """dp 4, one microbatch, bf16 gradients: Ψ = 2·EMB + 8·BLOCK + 128 = 1,607,808 (the head is not tied).
    Hand-worked from torch's FSDP2 (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py, post_backward):
    each block's post-backward reshards, drops the previous reduce-scatter input and reduces its own; the root's
    runs in the backward's final callback."""
    psi, root = 2 * EMB + 8 * BLOCK + 128, EMB + 128 + EMB
    assert psi == 1_607_808
    r = memory_per_rank(cfg(dp=4, pp=1, m=1)).per_rank[0]
    terms = {}
    for c in ("grads", "activations", "comm_buffers", "temporaries"):
        for t in r.catalogue(c):
            terms.setdefault(t.kind, []).append(t.bytes)
    assert terms["fsdp_root_params"] == [2 * root]  # bf16, through the forward and the backward
    assert terms["fsdp_unsharded_params"] == [2 * BLOCK] and terms["all_gather_output"] == [2 * BLOCK]
    assert terms["fsdp_late_reduce"] == [2 * BLOCK]  # the previous block's reduce-scatter input, bf16
    assert terms["fsdp_head_grad"] == [2 * (128 + EMB)]  # the final norm's and head's, made first
    # the sharded gradients (fp32, 4 B × Ψ / 4) — all at the end; late in the backward all but the root's and
    # layers 0-1's; early, the last block's
    assert terms["fsdp_sharded_grads"] == [psi]
    assert terms["fsdp_reduced_grads"] == [psi - root - 2 * BLOCK]
    # early (the B's own moment, after the last block's post-backward: more than its start here, as a fake step of
    # this config measures): that block's sharded gradients and reduce-scatter input, less its saved tensors
    share, freed, rs = terms["fsdp_early_reduce"]  # (grads, activations, comm_buffers)
    assert (share, rs) == (BLOCK, 2 * BLOCK) and -freed < share + rs
    # the end: the embeddings' gradient, and the largest of the root's post-backward's three sides beyond what the
    # moment holds (the gathered root, every sharded gradient, the head's and embeddings' bf16 gradients): before
    # it the last block's input without the root's sharded gradients (2·root + 2·BLOCK − root); at its copy-in its
    # own input (2·root), the root resharded and its sharded gradients not yet made (− root); after it beside them,
    # the gradients' list cleared but for the larger, the head's (2·root − 2·EMB)
    end = max(2 * root + 2 * BLOCK - root, 2 * root - root, 2 * root - 2 * EMB) - 2 * root
    assert terms["fsdp_root_reduce"] == [2 * EMB] and terms["fsdp_root_end"] == [end]
    # it peaks at the B's own moment: the tiny model's saved tensors outweigh what the reductions add
    assert r.peak_moment.startswith("stage 0 B of microbatch 0 (")
    # pipelined, the root is one of the stage's units (every unit gathered, no late moment)
    assert not [t for t in memory_per_rank(cfg(m=4)).per_rank[0].catalogue("comm_buffers")
                if t.kind == "fsdp_root_params"]


def test_the_roots_share_of_the_sharded_gradients_is_by_its_own_shard_degree_under_expert_parallelism():
    """The root's post-backward at the copy-in holds its reduce-scatter input, its sharded gradients not yet made: their
    bytes are the root's own shards (dp 4: a quarter of each of its tensors, fp32), not its share by elements of every
    unit's sharded gradients — under expert parallelism the routed experts shard over efsdp (dp / ep = 2), which made
    that share twice too large (measure --fake of Qwen3 235B dp16 ep8 ZeRO-3: −4.4 → −1.1 %). Qwen3 30B-A3B cut to 2
    blocks: the embeddings 151,936 × 2,048 and the head with its norm 151,936 × 2,048 + 2,048, each split in 4."""
    c = Config.from_dict({"model": {"preset": "qwen3-30b-a3b", "layers": 2, "seq_len": 1024},
                          "cluster": {"gpu": "h100-sxm", "gpus": 4},
                          "parallel": {"dp": 4, "ep": 2, "zero": 3, "microbatches": 1},
                          "training": {"precision": "bf16-mixed", "grad_dtype": "fp32"}})
    emb, head = 151_936 * 2_048, 151_936 * 2_048 + 2_048
    root_rs = 4 * (emb + head)  # the fp32 reduce-scatter input, unsharded
    s_root = 4 * (emb // 4 + head // 4)
    (t,) = [t for t in memory_per_rank(c).per_rank[0].catalogue("comm_buffers") if t.kind == "fsdp_root_end"]
    assert f"{root_rs - s_root:,}" in t.formula  # the copy-in side
