"""``torch.compile`` of each transformer block (``training.compile``), as torchtitan's ``apply_compile``.

Every block of ``model.layers`` is compiled in place (``nn.Module.compile``, inductor,
``fullgraph=True``) after recompute has wrapped it and before the data-parallel wrapper, so a
checkpointed block is compiled with its checkpoint and FSDP2's hooks stay outside the graph.
Inductor on CPU generates C++ (gcc) kernels. The repeated block structure compiles once and is
reused: torchtitan's reason for compiling per block rather than the whole model.

What PyTorch's MemTracker sees of a compiled block: nothing — torch 2.13's dynamo does not run
under a non-infra TorchDispatchMode such as the tracker ("non-infra torch dispatch mode present,
this is not supported today in torch.compile"; with ``fullgraph=True`` the call fails). So the
one measured step runs the blocks eagerly (``measured_eagerly``: ``torch.compiler.set_stance(
"force_eager")``) while every timed step runs compiled, and the rank's measurement says so in
``memory.notes`` (``COMPILED_MEMORY_NOTE``). What the compiled blocks save for backward is measured
apart: one more forward and backward, compiled, under ``saved_tensors_hooks``
(``backend.measure.SavedTensorPeak``, which AOTAutograd's saved tensors go through), beside the
same count over the eager step; ``memory.saved_for_backward`` = {"eager", "compiled"} bytes at their
peak, from which ``engine.compare.measured`` takes the compiled blocks' activations.
"""

from __future__ import annotations

import torch
from torch import nn

COMPILED_MEMORY_NOTE = (
    "training.compile: torch.compile does not run under PyTorch's MemTracker (a TorchDispatchMode), so the "
    "measured step ran the transformer blocks eagerly: its activations and temporaries are the eager blocks'; "
    "what the compiled blocks save for backward is counted apart by saved_tensors_hooks over one compiled "
    "step (memory.saved_for_backward), what inductor allocates inside its kernels is not measured "
    "(params, grads and optimizer state are exact either way); step times are the compiled blocks'")


def apply_compile(model: nn.Module) -> None:
    """Compile every transformer block of ``model`` in place (inductor, full graph)."""
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    for _, block in model.layers.named_children():
        block.compile(backend="inductor", fullgraph=True)


def measured_eagerly(compiled: bool):
    """The context of a step under MemTracker: compiled blocks run their eager code (a no-op otherwise)."""
    import contextlib

    return torch.compiler.set_stance("force_eager") if compiled else contextlib.nullcontext()
