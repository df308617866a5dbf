"""``shardscope import`` / ``shardscope export`` (gui/cli_interop.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import Config
from gui.cli import main

ROOT = Path(__file__).resolve().parents[2]
TT = ROOT / "assets" / "examples" / "published" / "torchtitan-9dec370"


def test_import_a_command_file_prints_a_config_that_loads(tmp_path, capsys):
    cmd = tmp_path / "train.sh"
    cmd.write_text("torchrun --nnodes 2 --nproc_per_node 8 \\\n  torchtitan/train.py \\\n"
                   f"  --job.config_file {TT}/train_configs/llama3_8b.toml --metrics.enable_wandb\n")
    assert main(["import", "torchtitan", "--gpu", "h100-96g", str(cmd), "--training.batch_size", "4"]) == 0
    out, err = capsys.readouterr()
    (tmp_path / "got.toml").write_text(out)
    cfg = Config.load(tmp_path / "got.toml")
    assert (cfg.cluster.gpus, cfg.parallel.dp, cfg.training.micro_batch_size) == (16, 16, 4)
    assert "ignored (no bearing on memory or step time): " in err and "metrics.enable_wandb" in err


def test_import_writes_a_file_but_never_over_one(tmp_path, capsys):
    job = tmp_path / "job.toml"
    job.write_text((TT / "train_configs" / "llama3_70b.toml").read_text())
    out = tmp_path / "mine.toml"
    assert main(["import", "torchtitan", "--gpus", "64", "-o", str(out), str(job)]) == 0
    assert Config.load(out).parallel.tp == 8
    out.write_text("# mine\n")
    assert main(["import", "torchtitan", "--gpus", "64", "-o", str(out), str(job)]) == 2
    assert out.read_text() == "# mine\n"
    assert "never writes over" in capsys.readouterr().err


def test_import_refusals_name_the_field_and_exit_2(tmp_path, capsys):
    job = tmp_path / "job.toml"
    job.write_text((TT / "train_configs" / "llama3_70b.toml").read_text())
    assert main(["import", "torchtitan", str(job)]) == 2
    assert "--gpus N" in capsys.readouterr().err
    assert main(["import", "torchtitan", "--gpus", "64", str(job), "--activation_checkpoint.mode", "memory_budget"]) == 2
    assert "activation_checkpoint.mode = 'memory_budget': allowed none, selective, full" in capsys.readouterr().err
    assert main(["import", "torchtitan", str(tmp_path / "missing.toml")]) == 2


def test_export_prints_the_command_and_names_what_it_cannot_say(capsys):
    assert main(["export", "torchtitan", str(ROOT / "assets" / "examples" / "llama3-8b-16gpu.toml")]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[-1].startswith("torchrun --nnodes 2 --nproc_per_node 8 -m torchtitan.train --module llama3 "
                                           "--config llama3_8b")
    assert "# not expressed: parallel.zero = 2" in out and "not expressed: parallel.zero = 2" in err
    assert main(["export", "torchtitan", "--as", "toml", str(ROOT / "assets" / "examples" / "mixtral-8x7b-ep8.toml")]) == 2
    assert "model: mixtral-8x7b has no torchtitan model" in capsys.readouterr().err


def test_accelerate_and_deepspeed_round_trip_through_the_cli(tmp_path, capsys):
    src = ROOT / "assets" / "examples" / "published" / "t1-fsdp.toml"
    for fmt, name in (("accelerate", "acc.yaml"), ("deepspeed", "ds.json")):
        out = tmp_path / name
        assert main(["export", fmt, str(src), "-o", str(out)]) == 0
        cfg_out = tmp_path / f"{fmt}.toml"
        gpus = [] if fmt == "accelerate" else ["--gpus", "8"]
        assert main(["import", fmt, *gpus, "--model", "llama3-8b", "--gpu", "h100-96g",
                     "--set", "training.micro_batch_size=2", "-o", str(cfg_out), str(out)]) == 0
        cfg = Config.load(cfg_out)
        assert (cfg.parallel.dp, cfg.parallel.zero, cfg.training.micro_batch_size) == (8, 3, 2)
    capsys.readouterr()
    assert main(["import", "accelerate", str(tmp_path / "acc.yaml")]) == 2
    assert "--model PRESET" in capsys.readouterr().err
    assert main(["import", "accelerate", "--model", "llama3-8b", "--set", "bogus=1", str(tmp_path / "acc.yaml")]) == 2
    assert "--set bogus=1: allowed SECTION.FIELD=VALUE" in capsys.readouterr().err


def test_import_hf_config_json_directly(capsys, tmp_path):
    hf = ROOT / "assets" / "hf_configs" / "deepseek-v3" / "config.json"
    assert main(["import", "hf", "--gpus", "64", "--set", "parallel.zero=3", str(hf)]) == 0
    out = capsys.readouterr().out
    (tmp_path / "c.toml").write_text(out)
    cfg = Config.load(tmp_path / "c.toml")
    assert (cfg.model.experts, cfg.model.attention, cfg.cluster.gpus, cfg.parallel.zero) == (256, "mla", 64, 3)


def test_report_of_a_config_with_its_plan(tmp_path, capsys):
    out = tmp_path / "r.html"
    cfg = ROOT / "assets" / "examples" / "published" / "t5-interleaved-1f1b.toml"
    assert main(["report", str(cfg), "--plan", "--top", "2", "-o", str(out)]) == 0
    html = out.read_text()
    assert html.count("<svg") == 2 and "The planner's top layouts" in html and "<script" not in html
    assert "Interleaved1F1B" in html and "pp7" in html  # every pipeline rank has its lane
    assert main(["report", str(cfg), "-o", str(out)]) == 2  # never over a file
    assert "never writes over" in capsys.readouterr().err


@pytest.mark.integration
def test_report_with_a_real_run_shows_predicted_vs_measured(tmp_path):
    pytest.importorskip("torch")
    from backend.launch import launch
    from engine import default_config

    raw = default_config().to_dict()
    raw["cluster"]["gpus"] = 2
    raw["parallel"].update({"dp": 1, "pp": 2, "microbatches": 4})
    cfg = Config.from_dict(raw)
    path = tmp_path / "c.toml"
    cfg.save(path)
    run = launch(cfg, tmp_path / "run", steps=2, timeout_s=120)
    assert run.wait(150)["event"] == "finished", run.result
    out = tmp_path / "r.html"
    assert main(["report", str(path), "--run", str(tmp_path / "run"), "-o", str(out)]) == 0
    html = out.read_text()
    assert "Predicted vs measured" in html and "error" in html


def test_megatron_round_trip_through_the_cli(tmp_path):
    src = ROOT / "assets" / "examples" / "llama3-70b-3d.toml"
    cmd = tmp_path / "pretrain.sh"
    assert main(["export", "megatron", str(src), "-o", str(cmd)]) == 0
    out = tmp_path / "back.toml"
    assert main(["import", "megatron", "--gpu", "h100-sxm", "-o", str(out), str(cmd)]) == 0
    back, cfg = Config.load(out), Config.load(src)
    assert back.model == cfg.model and back.model.preset == "llama3-70b"  # the numbers are the preset's
    assert (back.parallel.tp, back.parallel.pp, back.parallel.virtual_stages, back.parallel.zero) == \
        (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.virtual_stages, cfg.parallel.zero)
