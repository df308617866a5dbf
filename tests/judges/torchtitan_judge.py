"""torchtitan 0.3.0's own ConfigManager as the judge of ShardScope's torchtitan reader.

Run with the judges' Python (``.venv-judges``, made by ``make test``: torchtitan 0.3.0 and what it imports):

    .venv-judges/bin/python tests/judges/torchtitan_judge.py < commands.json > parsed.json

Reads a JSON list of argument lists (what follows ``-m torchtitan.train``), parses each with
``torchtitan.config.manager.ConfigManager().parse_args`` and prints, for each, the fields ShardScope reads, under
the names of ``engine.interop.torchtitan.KEYS`` (or ``{"error": ...}`` where torchtitan refuses the arguments).
"""

import contextlib
import io
import json
import sys


def fields(cfg) -> dict:
    par, tr, comp, ac = cfg.parallelism, cfg.training, cfg.compile, cfg.activation_checkpoint
    mode = {"FullAC": "full", "SelectiveAC": "selective", "MemoryBudgetAC": "memory_budget"}.get(
        type(ac).__qualname__.split(".")[0], "none") if ac is not None else "none"
    converters = [type(c).__qualname__.split(".")[0] for c in (cfg.model_spec.converters or [])] \
        if getattr(cfg.model_spec, "converters", None) else []
    out = {
        "model.name": cfg.model_spec.name, "model.flavor": cfg.model_spec.flavor,
        "training.local_batch_size": tr.local_batch_size, "training.global_batch_size": tr.global_batch_size,
        "training.seq_len": tr.seq_len, "training.mixed_precision_param": tr.mixed_precision_param,
        "training.mixed_precision_reduce": tr.mixed_precision_reduce,
        "compile.enable": comp.enable, "parallelism.enable_async_tensor_parallel": comp.enable_async_tensor_parallel,
        "activation_checkpoint.mode": mode, "float8": "Float8LinearConverter" in converters,
    }
    for key in ("data_parallel_replicate_degree", "data_parallel_shard_degree", "tensor_parallel_degree",
                "pipeline_parallel_degree", "context_parallel_degree", "expert_parallel_degree",
                "pipeline_parallel_schedule", "pipeline_parallel_microbatch_size",
                "pipeline_parallel_layers_per_stage", "enable_sequence_parallel", "fsdp_reshard_after_forward"):
        out[f"parallelism.{key}"] = getattr(par, key)
    return out


def main() -> None:
    from torchtitan.config.manager import ConfigManager

    results = []
    for args in json.load(sys.stdin):
        said = io.StringIO()
        try:
            with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
                cfg = ConfigManager().parse_args(list(args))
            results.append(fields(cfg))
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - the judge reports every refusal as data
            results.append({"error": f"{type(exc).__name__}: {exc} {said.getvalue()[-1500:]}"})
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
