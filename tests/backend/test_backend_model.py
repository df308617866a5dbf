"""Backend unit tests: the model from the spec, stage cuts, data, records (no ranks launched)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine import default_config
from engine.config import ModelSpec
from engine.model.presets import model_presets
from engine.pipeline.layout import split_layers

torch = pytest.importorskip("torch")

from backend import faults  # noqa: E402
from backend.model import SyntheticData, Transformer, count_parameters, cut_stage  # noqa: E402
from backend.records import Measurement, RunDir, assemble, iter_new_lines, read_jsonl  # noqa: E402


def spec(name: str, **over) -> ModelSpec:
    return ModelSpec(**{**model_presets()[name], **over})


def expected_params(s: ModelSpec) -> int:
    """The closed-form count (embedding, per-layer attention / MLP / norms, final norm, head)."""
    norm = s.hidden * (2 if s.norm == "layernorm" else 1)
    b = 1 if s.bias else 0
    attn = s.hidden * s.hidden * 2 + 2 * s.hidden * s.kv_dim + b * (2 * s.hidden + 2 * s.kv_dim)
    n_in = 2 if s.mlp == "swiglu" else 1
    mlp = (n_in + 1) * s.hidden * s.ffn_hidden + b * (n_in * s.ffn_hidden + s.hidden)
    total = s.vocab * s.hidden + s.layers * (attn + mlp + 2 * norm) + norm
    if s.position == "learned":
        total += s.seq_len * s.hidden
    if not s.tied_embeddings:
        total += s.vocab * s.hidden
    return total


def test_gpt2_counts_exactly_124m():
    with torch.device("meta"):
        model = Transformer(spec("gpt2-124m"))
    assert count_parameters(model) == 124_439_808


@pytest.mark.parametrize("name", ["tiny", "gpt2-124m", "llama3-8b"])
@pytest.mark.parametrize("variant", [{}, {"tied_embeddings": True, "bias": True, "norm": "layernorm", "mlp": "gelu"}])
def test_param_count_matches_closed_form(name, variant):
    s = spec(name, **variant)
    with torch.device("meta"):
        model = Transformer(s)
    assert count_parameters(model) == expected_params(s)


def test_named_submodules_for_tp_plans():
    names = dict(Transformer(spec("tiny")).named_modules())
    for sub in ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1",
                "feed_forward.w2", "feed_forward.w3", "attention_norm", "ffn_norm"):
        assert f"layers.0.{sub}" in names
    assert {"tok_embeddings", "norm", "output"} <= set(names)


@pytest.mark.parametrize("num_stages", [2, 3, 8])
def test_stage_cuts_partition_the_model(num_stages):
    s = spec("tiny", layers=8)
    torch.manual_seed(0)
    full = Transformer(s)
    total = 0
    for stage in range(num_stages):
        part = cut_stage(Transformer(s), stage, num_stages)
        assert [int(k) for k in part.layers] == list(split_layers(8, num_stages)[stage])
        assert (part.tok_embeddings is not None) == (stage == 0)
        assert (part.output is not None) == (stage == num_stages - 1)
        total += count_parameters(part)
    assert total == count_parameters(full)


def test_stages_compose_to_the_full_model():
    s = spec("tiny", layers=4)
    torch.manual_seed(0)
    full = Transformer(s)
    parts = [cut_stage(Transformer(s), i, 2) for i in range(2)]
    for p in parts:
        p.load_state_dict({k: v for k, v in full.state_dict().items() if k in p.state_dict()})
    x = torch.randint(s.vocab, (2, s.seq_len))
    torch.testing.assert_close(parts[1](parts[0](x)), full(x))


def test_eager_and_flash_attention_agree():
    x = torch.randint(512, (2, 64))
    torch.manual_seed(0)
    eager = Transformer(spec("tiny", attention="eager"))
    torch.manual_seed(0)
    flash = Transformer(spec("tiny", attention="flash"))
    torch.testing.assert_close(eager(x), flash(x), atol=1e-5, rtol=1e-4)


def test_synthetic_data_is_deterministic_and_learnable():
    s = spec("tiny", layers=2)
    data = SyntheticData(s.vocab, s.seq_len)
    x1, y1 = data.batch(3, 1, 4)
    x2, y2 = data.batch(3, 1, 4)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(x1, data.batch(3, 0, 4)[0])
    assert torch.equal(x1[:, 1:], y1[:, :-1])
    torch.manual_seed(0)
    model = Transformer(s)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3, betas=(0.9, 0.95))
    losses = []
    for step in range(8):
        x, y = data.batch(step, 0, 4)
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0


def test_launching_modules_import_no_torch():
    code = ("import sys, backend, backend.launch, backend.records, backend.faults, backend.worker; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_fault_spec_parsing():
    assert faults.parse("kill@1:2") == ("kill", 1, 2)
    with pytest.raises(ValueError):
        faults.parse("explode@0:1")


def _rank_record(rank, stage, params):
    cats = {"params": params, "grads": params, "optimizer": 2 * params, "activations": 10,
            "comm_buffers": 0, "temporaries": 5, "overhead": 0}
    return {"rank": rank, "stages": [stage], "memory": {"categories": cats}, "step_seconds": [0.5, 0.2, 0.3],
            "losses": [6.0, 5.0, 4.0], "actions": [["F", stage, 0, 0.0, 0.1]]}


def test_assemble_and_round_trip(tmp_path):
    meas = assemble([_rank_record(1, 1, 8), _rank_record(0, 0, 4)])
    assert [r.rank for r in meas.memory.per_rank] == [0, 1]
    row = meas.memory.per_rank[0]
    assert row.total == 4 + 4 + 8 + 10 + 5
    assert set(json.loads(json.dumps(meas.to_dict()))["memory"]["per_rank"][0]) == {
        "rank", "stage", "params", "grads", "optimizer", "activations", "comm_buffers", "temporaries",
        "overhead", "total"}
    assert meas.step.seconds == 0.3 and meas.step.losses == [6.0, 5.0, 4.0]
    assert meas.pipeline.per_rank[1].actions == [["F", 1, 0, 0.0, 0.1]]
    path = tmp_path / "m.json"
    path.write_text(json.dumps(meas.to_dict()))
    assert Measurement.load(path) == meas


def test_torn_lines_are_skipped(tmp_path):
    run = RunDir(tmp_path / "run")
    run.emit("started", world=2)
    with open(run.events, "a") as f:
        f.write('{"event": "step", "k"')  # a crash in the middle of a line
    assert [e["event"] for e in read_jsonl(run.events)] == ["started"]
    objs, offset = iter_new_lines(run.events, 0)
    assert len(objs) == 1 and offset < run.events.stat().st_size


def test_invalid_config_gives_failed_record_without_launching(tmp_path):
    from backend.launch import launch, run_cli

    bad = tmp_path / "bad.toml"
    bad.write_text(default_config().dumps_toml().replace("dp = 2", "dp = 3"))
    run = launch(bad, tmp_path / "run")
    assert run.finished and not run.ok and run.refused
    assert "parallel.dp" in run.result["reason"]
    assert not (tmp_path / "run").exists()  # a refused launch creates nothing
    out = tmp_path / "out.txt"
    with open(out, "w") as stream:
        assert run_cli(bad, tmp_path / "run2", steps=1, json_events=True, stream=stream) == 2
    assert json.loads(out.read_text().splitlines()[-1])["event"] == "failed"
    assert not (tmp_path / "run2").exists()


def test_missing_torch_gives_failed_record(tmp_path):
    from backend.launch import launch

    fake = tmp_path / "python-without-torch"
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    fake.chmod(0o755)
    run = launch(default_config(), tmp_path / "run", steps=1, python=str(fake))
    assert run.finished and not run.ok
    assert "torch is not installed" in run.result["reason"]
    assert "-m pip install 'torch>=2.6'" in run.result["reason"]  # says exactly what to install
    assert run.refused and not (tmp_path / "run").exists()  # refused before anything was written
