"""The plan room: ``search`` (every layout of a model on N GPUs, ranked by predicted throughput, with
bounds that prune it), ``moe`` (the same with expert parallelism) and ``results`` (what a plan returns
and why each layout wins or loses)."""
