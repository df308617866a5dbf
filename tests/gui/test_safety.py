"""What a careless or unlucky user meets, without launching ranks: a run directory is written once,
a refused launch writes nothing, bad files and bad disks are one message and exit 2, configs that
validate predict, Slurm script fields cannot become shell lines, a cancelled run reads back as
cancelled. (A run's sockets on loopback, a cancel and a full disk mid-run: tests/backend/test_backend_faults.py.)"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from backend.cluster import ClusterError
from backend.cluster.slurm import sbatch_script
from backend.records import CLAIM_FILE, RunDir, RunDirTaken, write_json_atomic
from engine import Config, ConfigError, default_config

ROOT = Path(__file__).resolve().parents[2]
TWO = default_config().replace(cluster={"gpus": 2, "gpus_per_node": 1}, parallel={"dp": 2, "pp": 1, "microbatches": 1})


def shardscope(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "gui.cli", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=120)


def snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def an_earlier_run(d: Path) -> Path:
    """A directory as a finished run leaves it."""
    run = RunDir.claim(d)
    TWO.save(run.config)
    run.emit("started", world=2, steps=1)
    run.emit("finished", seconds=1.0)
    write_json_atomic(run.measurement, {"memory": {"per_rank": []}})
    run.rank_log(0).write_text("rank 0 said things\n")
    return d


# --------------------------------------------------------------------------- a run directory is written once


@pytest.mark.parametrize("command", [["run"], ["measure", "--fake"]])
def test_out_naming_an_earlier_run_is_refused_and_nothing_changes(tmp_path, command):
    cfg = tmp_path / "two.toml"
    TWO.save(cfg)
    d = an_earlier_run(tmp_path / "run")
    before = snapshot(d)
    out = shardscope(*command, str(cfg), "--out", str(d))
    assert out.returncode == 2, out
    assert f"--out {d} already holds an earlier run" in out.stderr and "--fresh" in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert snapshot(d) == before


def test_out_naming_a_folder_of_other_files_is_refused(tmp_path):
    cfg = tmp_path / "two.toml"
    TWO.save(cfg)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    out = shardscope("run", str(cfg), "--out", str(tmp_path / "mine"))
    assert out.returncode == 2 and "already holds files (notes.txt)" in out.stderr
    assert snapshot(tmp_path / "mine") == {"notes.txt": b"keep me"}


def test_a_refused_launch_creates_nothing(tmp_path):
    cfg = tmp_path / "two.toml"
    TWO.save(cfg)
    out = shardscope("run", str(cfg), "--out", str(tmp_path / "new"), "--steps", "0")
    assert out.returncode == 2 and "--steps 0: must be at least 1" in out.stderr
    assert not (tmp_path / "new").exists()
    from backend.launch import launch

    run = launch(TWO, tmp_path / "new2", steps=0)
    assert run.refused and run.result["event"] == "failed" and not (tmp_path / "new2").exists()


def test_of_two_claims_on_one_directory_exactly_one_wins(tmp_path):
    for round_ in range(20):
        target = tmp_path / f"r{round_}"
        if round_ % 2:
            target.mkdir()  # an empty directory someone made: the claim file still decides
        start, results = threading.Barrier(2), []

        def claim(target=target, start=start, results=results):
            start.wait()
            try:
                results.append(RunDir.claim(target))
            except RunDirTaken as exc:
                results.append(exc)

        threads = [threading.Thread(target=claim) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(type(r).__name__ for r in results) == ["RunDir", "RunDirTaken"]
        assert (target / CLAIM_FILE).exists()


def test_fresh_runs_go_into_new_subdirectories(tmp_path):
    d = an_earlier_run(tmp_path / "runs")
    a = RunDir.claim_fresh(d)
    b = RunDir.claim_fresh(d)
    assert a.path.parent == d == b.path.parent and a.path != b.path
    assert (a.path / CLAIM_FILE).exists() and (b.path / CLAIM_FILE).exists()


def test_the_windows_prepared_directory_holds_only_the_config_it_runs(tmp_path):
    d = tmp_path / "prepared"
    d.mkdir()
    TWO.save(d / "config.toml")
    with pytest.raises(RunDirTaken, match="config.toml"):
        RunDir.claim(d, config_file=tmp_path / "other.toml")  # someone's config.toml: not ours to overwrite
    assert RunDir.claim(d, config_file=d / "config.toml").path == d
    with pytest.raises(RunDirTaken, match="being written by another run|earlier run"):
        RunDir.claim(d, config_file=d / "config.toml")


# --------------------------------------------------------------------------- bad files, bad disks


@pytest.mark.parametrize("content, message", [
    (b'[model]\npreset = "tiny"\n# caf\xe9\n', "is not UTF-8 text (byte 0xe9 at offset 29)"),
    (b'[model]\npreset = "tiny"\n[conventions]\ncompute_efficiency = ' + b"9" * 400 + b"\n",
     "is too large for a number"),
    (b'[model]\nhf_config = "a\\u0000b"\n', "a file path cannot hold a NUL character"),
    (b"x = " + b"[" * 5000 + b"]" * 5000 + b"\n", "nested too deeply"),
])
def test_bad_files_are_one_message_and_exit_2(tmp_path, content, message):
    f = tmp_path / "bad.toml"
    f.write_bytes(content)
    for command in ("validate", "predict"):
        out = shardscope(command, str(f))
        assert out.returncode == 2, out
        assert message in out.stderr and "Traceback" not in out.stderr


@contextlib.contextmanager
def tiny_filesystem(tmp_path: Path, size: str, readonly: bool = False):
    """A tmpfs of ``size`` mounted at tmp_path/fs (root only; skipped where mounting is not allowed)."""
    where = tmp_path / "fs"
    where.mkdir()
    opts = f"size={size}" + (",ro" if readonly else "")
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a small tmpfs (a full or read-only file system)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_a_read_only_file_system_is_one_message(tmp_path):
    cfg = tmp_path / "two.toml"
    TWO.save(cfg)
    with tiny_filesystem(tmp_path, "1m", readonly=True) as ro:
        for command in (["run"], ["measure", "--fake"]):
            out = shardscope(*command, str(cfg), "--out", str(ro / "run"))
            assert out.returncode == 2, out
            assert "Read-only file system" in out.stderr and "Traceback" not in out.stderr
            assert len(out.stderr.strip().splitlines()) == 1
        assert list(ro.iterdir()) == []


def test_a_full_disk_leaves_no_half_written_file(tmp_path):
    with tiny_filesystem(tmp_path, "64k") as fs:
        with contextlib.suppress(OSError), open(fs / "filler", "wb") as f:
            f.write(b"x" * 10**6)  # fill the disk to its last byte
        big = default_config().replace(model={"preset": "llama3-405b"})
        with pytest.raises(OSError):
            big.save(fs / "config.toml")
        with pytest.raises(OSError):
            write_json_atomic(fs / "measurement.json", {"x": "y" * 100_000})
        assert sorted(p.name for p in fs.iterdir()) == ["filler"]  # no temporary file left behind


# --------------------------------------------------------------------------- configs that validate predict


def test_moe_with_context_and_expert_parallelism_is_refused_or_predicted():
    base = {"model": {"preset": "qwen3-30b-a3b", "seq_len": 8192}, "cluster": {"gpu": "h100-sxm", "gpus": 2}}
    with pytest.raises(ConfigError, match=r"parallel.ep = 4: must divide the dense region dp_shard·cp·tp = 1·2·1 = 2"):
        Config.from_dict({**base, "parallel": {"dp": 1, "cp": 2, "ep": 4, "zero": 3}})  # was ZeroDivisionError
    from engine.predict import predict

    for zero in (0, 3):
        cfg = Config.from_dict({**base, "parallel": {"dp": 1, "cp": 2, "ep": 2, "zero": zero}})
        assert cfg.parallel.expert_shard_degree == 1
        assert all(r.total > 0 for r in predict(cfg).memory.per_rank)


def test_a_step_too_long_to_simulate_is_refused_with_what_is_allowed():
    """layers 4096 / pp 1024 / microbatches 65536 never returned; the ranges and the step-size rules
    (each naming what is allowed) now refuse what the engine cannot answer in about a second."""
    with pytest.raises(ConfigError) as err:
        Config.from_dict({"model": {"preset": "llama3-8b", "layers": 4096}, "cluster": {"gpus": 1024},
                          "parallel": {"dp": 1, "pp": 1024, "microbatches": 65536}})
    assert {"model.layers", "parallel.pp", "parallel.microbatches"} <= err.value.fields()
    cases = [({"pp": 16, "microbatches": 2048}, "parallel.microbatches",
              "pp·virtual_stages·microbatches = 16·2048 = 32,768 exceeds 16,384; allowed with 16 stage(s): 1 … 1024"),
             ({"pp": 16, "microbatches": 512, "schedule": "GPipe"}, "parallel.microbatches",
              "microbatches × model.layers = 512·126 = 64,512 exceeds 16,384; allowed with 126 layers: microbatches 1 … 130"),
             # any pipeline: the last stage's kept outputs grow every microbatch, so its replay may not loop
             ({"pp": 16, "microbatches": 512, "schedule": "1F1B"}, "parallel.microbatches",
              "microbatches × model.layers = 512·126 = 64,512 exceeds 32,768; allowed with 126 layers: "
              "microbatches 1 … 260, or pp = 1"),
             ({"pp": 84, "microbatches": 84, "model_layers": 126}, "parallel.pp",
              "parallel.pp × model.layers = 84·126 = 10,584 exceeds 8,192"),
             ]
    for par, field, words in cases:
        par = dict(par)
        par.pop("model_layers", None)
        with pytest.raises(ConfigError) as err:
            Config.from_dict({"model": {"preset": "llama3-405b"}, "cluster": {"gpus": 8 * par["pp"]},
                              "parallel": {"tp": 8, **par}})
        assert field in err.value.fields()
        assert all(w in str(err.value) for w in words.split("; ")), str(err.value)


def test_a_million_ranks_predict_with_every_rank_there():
    from engine.predict import predict
    from gui.text import prediction_table

    cfg = Config.from_dict({"model": {"preset": "llama3-405b"}, "cluster": {"gpu": "h100-sxm", "gpus": 1 << 20},
                            "parallel": {"tp": 8, "pp": 16, "zero": 3, "microbatches": 16}})
    pred = predict(cfg)
    mem = pred.memory
    assert len(mem.per_rank) == 1 << 20
    # one body per pipeline stage and FSDP2 share: over 8,192 shard ranks the TP-local k/v (128 rows), q
    # (2,048) and w1/w3 (6,656) leave the dp-ranks from 128, 2,048 and 6,656 on without their rows
    # (torch.chunk), so a middle stage's optimizer states come in four sizes, largest on dp-rank 0
    middle = [g for g in mem.groups if g.first.stages == (1,)]
    assert [g.first.rank for g in middle] == [65536 + 8 * d for d in (0, 128, 2048, 6656)]
    assert [g.first.optimizer for g in middle] == sorted((g.first.optimizer for g in middle), reverse=True)
    assert len({g.first.params for g in middle}) == 1  # the parameters' storage is padded on every rank
    assert mem.per_rank[-1].rank == (1 << 20) - 1 and mem.per_rank[-1].stages == (15,)
    assert mem.per_rank[65536].stages == (1,) and mem.per_rank[65535].stages == (0,)
    assert "0-1023" in prediction_table(pred) and "64128-65535" in prediction_table(pred)


# --------------------------------------------------------------------------- Slurm script fields


@pytest.mark.parametrize("field, value", [("partition", "gpu\nrm -rf ~"), ("time_limit", "1:00\necho pwned"),
                                          ("account", "a b"), ("partition", "gpu;id")])
def test_slurm_fields_that_a_directive_cannot_hold_are_refused(tmp_path, field, value):
    with pytest.raises(ClusterError, match="allowed"):
        sbatch_script(TWO, tmp_path / "r", nodes=2, per_node=1, **{field: value})


def test_a_run_directory_with_a_newline_is_refused_and_blanks_are_quoted(tmp_path):
    with pytest.raises(ClusterError, match="control character"):
        sbatch_script(TWO, tmp_path / "a\nb", nodes=2, per_node=1)
    script = sbatch_script(TWO, tmp_path / "with space", nodes=2, per_node=1)
    assert f'#SBATCH --output="{tmp_path}/with space/logs/slurm-%j.log"' in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    lines = script.splitlines()
    assert all(ln.startswith("#") for ln in lines[:lines.index("set -u") - 1])  # the head is directives only


def test_a_newline_in_a_slurm_option_is_a_usage_error(tmp_path):
    cfg = tmp_path / "two.toml"
    TWO.save(cfg)
    out = shardscope("run", str(cfg), "--target", "slurm", "--partition", "gpu\nid", "--dry-run")
    assert out.returncode == 2 and "--partition 'gpu\\nid': allowed" in out.stderr
    assert "Traceback" not in out.stderr


# --------------------------------------------------------------------------- cancelled is its own status


def test_a_cancelled_run_reads_back_as_cancelled(tmp_path):
    from backend.events import describe
    from gui.runs import read_run_dir

    run = RunDir.claim(tmp_path / "run")
    TWO.save(run.config)
    run.emit("started", world=2, steps=5)
    ev = run.emit("cancelled", reason="cancelled by the user; every process was stopped")
    record = read_run_dir(run.path)
    assert record.status == "cancelled" and "cancelled by the user" in record.reason
    assert describe(ev) == "CANCELLED: cancelled by the user; every process was stopped"
    assert json.loads(run.events.read_text().splitlines()[-1])["event"] == "cancelled"
