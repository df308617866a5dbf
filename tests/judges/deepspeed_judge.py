"""DeepSpeed's own config class as the judge of ShardScope's DeepSpeed reader.

Run with the judges' Python (``.venv-judges``, made by ``make test``; DeepSpeed 0.19.8 there):

    .venv-judges/bin/python tests/judges/deepspeed_judge.py < cases.json > parsed.json

Reads a JSON list of ``{"config": {...}, "dp": N, "tp": T}``; for each, builds
``deepspeed.runtime.config.DeepSpeedConfig(config, mpu=...)`` as ``deepspeed.initialize`` does (one real gloo
process group, and the model-parallel unit interface DeepSpeed documents — ``get_data_parallel_world_size`` and
``get_model_parallel_world_size`` — answering the layout's sizes, as Megatron's ``mpu`` answers them) and prints
what DeepSpeed made of it, or ``{"error": ...}`` where DeepSpeed refuses it.
"""

import contextlib
import io
import json
import os
import sys


class LayoutUnit:
    """The model-parallel unit interface of ``deepspeed.initialize(mpu=...)``, for a layout of dp × tp ranks."""

    def __init__(self, dp: int, tp: int):
        self.dp, self.tp = dp, tp

    def get_data_parallel_world_size(self):
        return self.dp

    def get_model_parallel_world_size(self):
        return self.tp

    def get_data_parallel_rank(self):
        return 0

    def get_model_parallel_rank(self):
        return 0


def main() -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("JUDGE_PORT", "29531"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    said = io.StringIO()
    with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
        import deepspeed
        from deepspeed.runtime.config import DeepSpeedConfig

        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    out = []
    for case in json.load(sys.stdin):
        try:
            with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
                c = DeepSpeedConfig(case["config"], mpu=LayoutUnit(case["dp"], case["tp"]))
            tp_cfg = getattr(c, "tensor_parallel_config", None)
            out.append({"train_batch_size": c.train_batch_size, "micro": c.train_micro_batch_size_per_gpu,
                        "accumulation": c.gradient_accumulation_steps, "zero": int(c.zero_optimization_stage),
                        "bf16": bool(c.bfloat16_config.enabled), "fp16": bool(c.float16_config.enabled),
                        "communication_data_type": str(c.communication_data_type).replace("torch.", ""),
                        "optimizer": c.optimizer_name, "offload_param": str(c.zero_config.offload_param.device
                                                                             if c.zero_config.offload_param else "none"),
                        "autotp_size": int(getattr(tp_cfg, "autotp_size", 0) or 1)})
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - every refusal is reported as data
            out.append({"error": f"{type(exc).__name__}: {exc}"[:800]})
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
