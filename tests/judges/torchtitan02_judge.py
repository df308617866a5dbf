"""torchtitan 0.2.2's own ConfigManager as the judge of ShardScope's torchtitan job configs (the TOML flavour of
the 0.1-0.2 releases). ``make test`` installs torchtitan 0.2.2 beside 0.3.0 in the judges' venv, in its
own folder (``.venv-judges/torchtitan-0.2.2``, on PYTHONPATH for this script only).

Reads a JSON list of TOML texts; parses each as ``--job.config_file`` and prints the fields ShardScope reads under
the names of ``engine.interop.torchtitan.KEYS`` (or ``{"error": ...}``).
"""

import contextlib
import io
import json
import os
import sys
import tempfile


def main() -> None:
    from torchtitan.config.manager import ConfigManager

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, text in enumerate(json.load(sys.stdin)):
            path = os.path.join(tmp, f"job{i}.toml")
            with open(path, "w") as f:
                f.write(text)
            said = io.StringIO()
            try:
                with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
                    c = ConfigManager().parse_args(["--job.config_file", path])
                par, tr, ac, f8 = c.parallelism, c.training, c.activation_checkpoint, c.quantize.linear.float8
                row = {"model.name": c.model.name, "model.flavor": c.model.flavor,
                       "model.converters": list(c.model.converters), "training.local_batch_size": tr.local_batch_size,
                       "training.global_batch_size": tr.global_batch_size, "training.seq_len": tr.seq_len,
                       "training.mixed_precision_param": tr.mixed_precision_param,
                       "training.mixed_precision_reduce": tr.mixed_precision_reduce, "compile.enable": c.compile.enable,
                       "activation_checkpoint.mode": ac.mode,
                       "activation_checkpoint.selective_ac_option": ac.selective_ac_option,
                       "float8.recipe_name": f8.recipe_name,
                       "float8.enable_fsdp_float8_all_gather": f8.enable_fsdp_float8_all_gather}
                for key in ("data_parallel_replicate_degree", "data_parallel_shard_degree", "tensor_parallel_degree",
                            "pipeline_parallel_degree", "context_parallel_degree", "expert_parallel_degree",
                            "pipeline_parallel_schedule", "pipeline_parallel_microbatch_size",
                            "pipeline_parallel_layers_per_stage", "enable_async_tensor_parallel",
                            "fsdp_reshard_after_forward", "context_parallel_rotate_method"):
                    row[f"parallelism.{key}"] = getattr(par, key)
                out.append(row)
            except (Exception, SystemExit) as exc:  # noqa: BLE001 - every refusal is reported as data
                out.append({"error": f"{type(exc).__name__}: {exc} {said.getvalue()[-800:]}"})
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
