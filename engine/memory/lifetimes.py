"""When each term of a rank is alive during one training step, the rank's peak, and its allocation events.

The other modules of this package say *how many bytes* each term is (``Term.bytes``) and, for
activations, at how many microbatches in flight (``Term.in_flight``). This one says *when* each
is alive, so that a rank's peak is what is alive at one moment, not the sum of every term at its
own largest. The bytes of every term stay as those modules give them; a term that scales with the
microbatches in flight is split into its bytes per microbatch (``bytes // in_flight``).

The moments of a step are the compute actions of the rank, in the order torch executes them
(``engine.pipeline.schedules``' action lists: ``pipeline_actions`` under pipelining, F then B per microbatch
without). Each term has one lifetime, chosen by its ``kind`` (``LIFETIMES``):

  step                 alive all step: parameters, gradients, optimizer states (the states are
                       counted at their full size throughout, as the backend measures them: exact
                       sizes beside the tracker's peak), DDP buckets (the Reducer allocates them at
                       construction), the p2p receive buffers (allocated once per microbatch at the
                       first step), autocast's cached weight casts (but at the optimizer step, outside
                       autocast: ``STEP_FREED_KINDS``), FSDP2's unsharded parameters
                       where every unit stays gathered between forward and backward
  microbatch           a stage-microbatch's saved activations: from its F until its full backward B,
                       or until its W where the backward is split (I then W). The last stage's loss
                       side (``HEAD_KINDS``: what the final norm, the head and the loss save) is not
                       alive at the F's own moment (the blocks' forward, before the head runs) nor at
                       a B's own moment (the blocks' backward, after the head's backward freed it);
                       the loss moment holds it, and a split backward keeps it until the W, but for the
                       loss's log-probabilities, freed after the I (``LOSS_AT_INPUT_KINDS``)
  to_step_end          the last stage's kept outputs (logits) under ``conventions.pipeline_outputs = "kept"``:
                       from the microbatch's F to the step's end
  input_to_weight      a split backward's retained gradients of a stage-microbatch (``INPUT_TO_WEIGHT_KINDS``):
                       made by its I, freed after its W
  after_input          a split backward's input gradient of a stage-microbatch (``INPUT_GRADIENT_KINDS``): made
                       by its I, kept to the step's end (the optimizer step included); and where the schedule
                       keeps its sends (``sends_held``) a B's sent to another rank: to the end of the backward
  after_output         a stage-microbatch's output sent to another rank where the schedule keeps its sends
                       (``OUTPUT_SENT_KINDS``): the send's Work holds it from the B (or I) that frees the
                       microbatch to the end of the backward
  stage_accumulated    on a rank of several pipeline stages (FSDP2), one stage's unsharded gradients:
                       from the end of its first B or W (made during it: a split backward's I makes no
                       weight gradient) through its m-th B or W, after which torch's REDUCE_GRAD for that
                       stage (``_add_reduce_grad``) drops them
  stage_reduced        there, one stage's sharded gradients: from that REDUCE_GRAD to the step's end
                       (``STAGE_LIFETIMES``; each term has its ``stage``)
  stage_weight         transient during each W of one stage (its ``stage``): what a split backward's weight
                       pass recomputes (``engine.memory.activations.weight_pass_terms``)
  stage_converted      there, under a split backward where FSDP2 accumulates in another dtype than the
                       parameters': one stage's accumulation, from the first post-backward that finds a
                       gradient (its first B, or the first I after a W) through its REDUCE_GRAD
  stage_fresh          there, one stage's weight gradients in the parameter dtype, in ``.grad``: from each
                       W (its own moment included) to the I that adds them in, or to the REDUCE_GRAD
  stage_kept           there, under ZeRO-3 resharding after forward, one stage's units kept gathered since its last
                       backward, to its next forward or its REDUCE_GRAD (``_kept_since_backward``)
  stage_current        there, at each F of one stage and each of its B, I or W right after a forward: the stage's
                       root unit and its current block's (``_kept_since_backward``)
  stage_gathering      there, at each B, I or W of one stage right after a forward of it: the all-gather output of
                       the next block its backward gathers (after a backward every unit is gathered already)
  stage_forward_gathering there, at each F of one stage not right after a backward of it: the all-gather output of
                       its next unit
  every_action         transient during every F, B, I and W and at the end of the backward: FSDP2's root
                       unit unpipelined (gathered through the forward and through the backward to its
                       post-backward in the final callback), under pipelining its current (+ prefetched)
                       unit and the all-gather output (on the all-gather stream; on a rank of one stage
                       resharding after forward, ``gathering``), ZeRO-3's gathered unit
  backward             transient during B, I and W: a unit's fresh gradient, the reduce-scatter input, the last
                       stage's final norm and head's fresh gradient (made first, reduced at the B's end); not
                       at the first stage's I, which runs no backward (stage.py's ``backward_one_chunk`` computes
                       no input gradient there and leaves the whole backward to the W)
  backward_input       transient during B and I (and the first stage's W, a full backward; not its I): the block
                       recomputed in its backward; a MoE stage's routed-experts backward (its weight gradients;
                       what the backward freed by then)
  loss                 transient at the loss moment that opens each B or I of the last stage: the fp32
                       logits and their gradient (see below)
  full_backward        transient during a full backward only (a B; the first stage's W, which stage.py runs
                       as one): the first block's MLP backward
                       (``engine.memory.activations.block_backward_terms``: the gradients it makes, and
                       the down input w2's backward frees; FSDP2's fresh weight gradients made by then, w2's)
                       and, on the last stage, the blocks' output gradient
  first_forwards       transient during the first F of each local stage: under pipelining with units
                       never resharded (``set_reshard_after_backward(False)`` and no resharding after
                       forward) FSDP2 all-gathers each unit once, at its stage's first forward
  end_of_backward      at the end-of-backward moment only: FSDP2's sharded gradients. Each unit's
                       post-backward makes its own with its reduce-scatter, and only where gradient
                       sync is on: under pipelining at the schedule's REDUCE_GRAD
                       (``perform_reduce_grad``, after the last backward), without it in the last
                       microbatch's backward (the training loop sets ``set_requires_gradient_sync``
                       for the last microbatch only; with m = 1 that is the only backward);
                       ``zero_grad(set_to_none)`` drops them after the optimizer step
  until_end_of_backward at every action and loss moment, not at the end of the backward: FSDP2's unsharded
                       parameters of every unit where no unit reshards after forward (ZeRO-2, ZeRO-3
                       not resharded after forward, replicate) and no pipeline schedule keeps them past the
                       backward: each unit is gathered in its forward and resharded in its
                       post-backward (``reshard_after_backward``, True by default)
  during_actions       at every action's own moment only (not at a loss moment, not at the end of the
                       backward): what a block's attention holds while it runs, forward or backward
                       (context parallelism's ring workspace), expert parallelism's all-to-all buffers,
                       unpipelined FSDP2's current block unit and the next one's all-gather output
  forwards             at every F's own moment only: FSDP2's all-gather output where each unit is gathered
                       once per forward and kept to its backward (no pipeline; ZeRO-2, ZeRO-3 not
                       resharded after forward): the backward gathers nothing
  optimizer_step       at the optimizer-step moment only: what ``optimizer.step()`` allocates while it runs
                       (AdamW's denominators: ``engine.memory.states.optimizer_step_bytes``)
  post_backward        at the end-of-backward moment only: a dense block unit's whole fresh gradient (FSDP2
                       converting: its post-backward adds it in); what the root unit's backward makes after every
                       block's backward has freed its saved tensors — under TP the token embedding's
                       gradient at full V × h (DTensor's ``embedding_dense_backward`` strategies,
                       torch/distributed/tensor/_ops/_embedding_ops.py, have no vocab-sharded output: the
                       vocab-parallel embedding's weight gradient is made Partial at full size, then
                       reduce-scattered to its row shard), gone before the optimizer step; and under
                       ``conventions.pipeline_outputs = "kept"`` the last stage's merged output (``step()``'s
                       ``torch.cat`` of every microbatch's logits: pipelined, so never beside that gradient,
                       which only an unpipelined single-microbatch step makes)
  late_backward        at the late-backward moment only (an unpipelined step of one microbatch under ZeRO-3
                       resharding after forward): the sharded gradients FSDP2 has reduced by the second
                       block's backward, and the saved tensors of the first block, still to run; under
                       replicate by the last block's (layer 0's), every other unit resharded
  backward_end         at the end of each full backward B (a moment of its own after the B's, its microbatch
                       freed), where the rank has a term of it or of ``later_backward_end``: under pipelining,
                       FSDP2's fresh gradient of the token embedding's unit, whose backward is the first stage's
                       last op (its blocks' transients freed by then), where it is converted into another dtype
  later_backward_end   there, but not at the end of a stage's first B: that fresh gradient where it is added in the
                       same dtype (the first is the accumulation); under pipelining with autocast and plain
                       gradients, the 16-bit weight gradients waiting for their cast's backward. Autocast
                       caches its weight casts for the whole step (one context around the schedule's step), so
                       their ``ToCopyBackward0`` nodes were made in the stage's first forward, and autograd's
                       ready queue runs the highest sequence number first (torch/csrc/autograd/engine.cpp,
                       ``CompareNodeTaskTime``): every later microbatch's backward runs them last
  later_full_backward  at a B's own moment, but not at a stage's first B: under pipelining with autocast and plain
                       gradients, what its phases hold differently from the first's — the 16-bit weight gradients
                       waiting for their casts' backward (see ``later_backward_end``) beside the attention's
                       backward, and none of their fp32 casts at the MLP's (``activations._autocast_waiting_phases``)
  early_backward       at a B's own moment only (not at the late-backward moment; and at the first stage's W, a
                       full backward: torch's ``backward_weight_one_chunk`` runs ``stage_backward`` there): what the B holds once its
                       first block has reduced (its sharded gradients, less its saved tensors), where
                       that exceeds the start; under a split backward the MoE backward's moment of a full B
                       (the experts' weight gradients where they outweigh the combine's backward)
  input_backward       at an I's own moment only: under a split backward the MoE backward's moment of an I,
                       which computes input gradients only (the combine's backward; no expert weight gradient:
                       those come in the W)
  after_a_backward     at a B, I or W whose stage ran a backward just before it (no forward between), at a B's end, and
                       at a loss moment after such a backward: under pipelining with ZeRO-3 resharding after forward
                       on a rank of one stage, the stage's units that its backward left gathered
                       (``set_reshard_after_backward(False)``) and no forward resharded since
  gathering            at every F, B, I and W but one whose stage ran a backward just before it, and at the end of the
                       backward: under pipelining with ZeRO-3 resharding after forward on a rank of one stage, the
                       all-gather output of the unit FSDP2 gathers next; a backward right after a backward finds every
                       unit gathered (``after_a_backward``) and gathers none (measure --fake of Qwen3 235B pp4 GPipe
                       ZeRO-3, two blocks a stage: its later Bs hold the stage's four units, no output)
  reduce_grad          at the REDUCE_GRAD moment only (a pipelined FSDP2 rank of one stage, before the end of the
                       backward): what its first units' reduce-scatters hold beside every accumulated gradient and
                       gathered unit (``engine.memory.buffers._reduce_grad``)
  backward_after_forward at a B or I whose stage ran a forward just before it: under pipelining with ZeRO-3
                       resharding after forward on a rank of one stage, the blocks such a backward has run, kept
                       gathered beyond what it freed (``fsdp_units_kept_in_a_backward``)
  first_backward       at the rank's first B's own moment only (not at the late-backward moment): plain gradients
                       (no FSDP2) on a rank of one stage, the ``.grad`` autograd has made by then (the head's and
                       final norm's on the last stage; beside a MoE moment the later blocks' and shared experts'),
                       which no gradient term counts before the first backward ends
  after_first_weight   from the end of the rank's first B or W to the step's end: under a split backward the
                       parameters' plain gradients, which torch makes in the W (``stage_backward_weight``
                       assigns ``.grad``; the I computes input gradients only); laid anew at each moment
  after_first_backward from the end of the rank's first B or I to the step's end (made during it): a later
                       stage's input gradient, held for its send to the previous stage until the next
                       backward makes the next (gone at the end of the backward), FSDP2's unsharded gradients
                       (accumulated without sync until the synchronised backward or REDUCE_GRAD,
                       whose post-backward drops each unit's: gone at the end-of-backward moment,
                       ``END_FREED_KINDS``), and
                       under pipelining its unsharded parameters (``set_reshard_after_backward(False)``)

Before every B or I of the last stage there is a *loss moment*: the loss's backward runs first, with
the stage-microbatches and kept outputs of that action but none of its other transients (no unit
gathered for backward yet, no fresh gradient, no recomputed block), so of the transients only
``loss`` is alive then, with ``after_first_backward`` if an earlier backward ran. The action's own
moment no longer holds the loss. After the rank's last action comes the *end-of-backward moment*:
every stage-microbatch freed, the kept outputs, the step terms, ``after_first_backward`` and
``end_of_backward``, and the transients of the last unit's post-backward (``every_action``,
``backward``: the root unit gathered, its gradient being reduced); no loss, no recomputed block.
Where the rank has something of the ``late_backward`` lifetime, a *late-backward moment* comes between
its one B and the end of the backward: the B's transients as at its own moment, the microbatch's saved
tensors freed (the B has walked its blocks), and ``late_backward``. It is where FSDP2's sharded gradients,
made block by block as each unit's post-backward reduces it, outweigh the saved tensors the backward has
freed by then; the B's own moment is its start, where every saved tensor is alive and no gradient is made.
Then the *optimizer-step moment*: what the end of the backward holds but the last unit's
transients, with ``optimizer_step`` (the training loop's ``zero_grad(set_to_none=True)`` comes after
the step, so every gradient is still there).

A moment's live bytes are the step terms, the stage-microbatches alive then (at an F: after it
allocates; at a B, I or W: before it frees), the kept outputs so far, and the transients of that
action. **The peak is the first moment with the most live tracked bytes**, and the rank's categories
are the snapshot at that moment: the terms alive then, per-microbatch terms at the microbatches
alive then (their label and formula say so), the others whole; a term not alive then is not in the
snapshot. So the total stays the sum of the categories, and each category the sum of its terms.
Untracked overhead terms (runtime context, collective-library buffers, allocator slack) are not
tensors: they are added on top, as before.

``allocation_events`` turns the same timeline into the caching allocator's input
(``engine.memory.allocator.replay``): ("alloc", key, nbytes[, stream]) and ("free", key), FSDP2's
gathered buffers on the all-gather stream and its sharded gradients on the reduce-scatter stream.
Without a :class:`Grain` one block per term (per stage-microbatch for activations); with one (GPU
ranks, ``per_rank.allocation_grain``) block by block, as the training loop allocates: see
``allocation_events``. Both are cached on a hashable signature of the rank (schedule, rank, the bytes of each lifetime):
identical ranks and repeated slider positions cost a dictionary lookup.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import numpy as np

from engine.memory.report import Term
from engine.names import MEMORY_CATEGORIES
from engine.pipeline.schedules import ACTION_KINDS, pipeline_actions, sends_held, single_rank_plan

_F, _B, _I, _W = (ACTION_KINDS.index(k) for k in "FBIW")

#: what the late-backward moment holds of plain gradients (DDP, ZeRO-1: ``buffers._plain_late_backward``) and of the
#: first block's saved tensors there: moments only, no event rows — the allocation events' first backward walk lays
#: the plain gradients as its blocks free their saved tensors (``after_first_backward``, ``_Laying.late``) and holds
#: layer 0's saved tensors until its own backward; and what the end of an unpipelined step's last backward holds over
#: several microbatches before the root's post-backward (``buffers._root_post_backward_after_accumulation``) and an I's
#: own weight-op output gradients under context parallelism (``activations.split_backward_terms``): laid by the events
#: as one piece each, they split the replay's segments where the real step makes them one by one
MOMENT_ONLY_KINDS = frozenset({"plain_late_grads", "plain_early_grads", "plain_late_activations",
                               "fsdp_root_reduce_accumulated", "split_backward_grads_made", "cp_saved_refiled"})

#: per-stage terms of the moments only, no event rows: what a W's own moment does not hold yet of the stage's weight
#: gradients it makes (its recomputes peak first; the events lay those gradients, ``stage_fresh``, after the W's
#: recomputes are freed: ``_Laying.moment``), and the recomputed block a plain stage's B or I does not make (the
#: events lay it at every B's walk)
MOMENT_ONLY_STAGE_KINDS = frozenset({"fsdp_stage_fresh_unmade", "recomputed_block_plain"})

#: the transient lifetimes, in the order of their columns in the moment matrix
TRANSIENT = ("every_action", "backward", "backward_input", "loss", "full_backward", "first_forwards",
             "end_of_backward", "until_end_of_backward", "during_actions", "forwards", "optimizer_step",
             "post_backward", "late_backward", "early_backward", "backward_end", "later_backward_end",
             "input_backward", "after_a_backward", "backward_after_forward", "reduce_grad",
             "later_full_backward", "gathering", "first_backward", "after_first_weight", "after_first_backward")

#: the late-backward moment's own lifetime among ``TRANSIENT`` (``_with_late_moment``)
_LATE_BACKWARD = TRANSIENT.index("late_backward")
_FULL_BACKWARD = TRANSIENT.index("full_backward")
_POST_BACKWARD = TRANSIENT.index("post_backward")
_EARLY_BACKWARD = TRANSIENT.index("early_backward")
_FIRST_BACKWARD = TRANSIENT.index("first_backward")
_BACKWARD_END = TRANSIENT.index("backward_end")
_LATER_BACKWARD_END = TRANSIENT.index("later_backward_end")
_AFTER_A_BACKWARD = TRANSIENT.index("after_a_backward")
_REDUCE_GRAD = TRANSIENT.index("reduce_grad")

#: the transient lifetimes laid anew at each moment they are alive (the last, ``after_first_backward``, is
#: laid once, when it starts, and kept)
PER_MOMENT = TRANSIENT[:-2]

#: the transient lifetimes laid once, when they start, and kept to the step's end (the last two)
_WEIGHT_LATE = TRANSIENT.index("after_first_weight")

#: per local stage, from the moments' ``acc``, ``red``, ``wr``, ``cv`` and ``fr`` (each term's ``stage``): on a rank
#: of several pipeline stages FSDP2's unsharded gradients of a stage accumulate from its first backward to its
#: REDUCE_GRAD, and its sharded gradients exist from then on (``lifetime_overrides``)
STAGE_LIFETIMES = ("stage_accumulated", "stage_reduced", "stage_weight", "stage_converted", "stage_fresh",
                   "stage_gathered", "stage_backward_end", "stage_later_backward_end", "stage_later_weight",
                   "stage_fresh_start", "stage_backward_action", "stage_kept",
                   "stage_current", "stage_gathering", "stage_forward_gathering")

#: the event rows' tag of each per-stage lifetime
_STAGE_TAG = {"stage_accumulated": "acc", "stage_reduced": "red", "stage_weight": "wr", "stage_converted": "cv",
              "stage_fresh": "fr", "stage_gathered": "ga", "stage_backward_end": "be", "stage_later_backward_end": "lbe",
              "stage_later_weight": "lw", "stage_fresh_start": "fs", "stage_backward_action": "bi", "stage_kept": "gk",
              "stage_current": "cu", "stage_gathering": "sg", "stage_forward_gathering": "sf"}

#: the moments' per-stage columns of ``STAGE_LIFETIMES``, in order (``Moments``' fields of those names)
_STAGE_COLUMNS = tuple(_STAGE_TAG[life] for life in STAGE_LIFETIMES)
#: of them, the columns of a stage's B ends: the events lay their rows as the moment's transients (allocated and
#: freed within it, named by it), not kept from one moment to the next as the other per-stage rows are
_STAGE_END_COLUMNS = ("be", "lbe", "cu", "sg", "sf")
#: the columns of a stage's own actions: a W's, laid as the W's transients with its weight pass (``wr``, ``lw``), or
#: moments only (``fs``, and ``bi``: a B's or an I's own moment; ``MOMENT_ONLY_STAGE_KINDS``)
_STAGE_W_COLUMNS = ("wr", "lw", "fs", "bi")

#: every lifetime (see the module docstring)
LIFETIME_NAMES = ("step", "microbatch", "to_step_end", "input_to_weight", "after_input", "after_output") + TRANSIENT

#: term kind -> lifetime; activation terms of a stage with microbatches in flight are "microbatch"
#: whatever their kind (``lifetime_of``). Kinds not listed are alive all step (the safe side: a
#: term never drops out of a peak for want of a rule).
LIFETIMES: dict[str, str] = {
    "parameters": "step", "gradients": "step", "plain_grads_accumulating": "stage_accumulated",
    "optimizer_states": "step", "master_weights": "step",
    "frozen_base": "step", "adapters": "step", "ddp_buckets": "step", "p2p_activation_receive": "step",
    "pipeline_outputs": "to_step_end", "pipeline_output_merge": "post_backward",
    "p2p_gradient_receive": "step", "autocast_weight_casts": "step", "none": "step",
    "all_gather_output": "every_action", "all_gather_input": "every_action", "unsharded_params": "every_action",
    "fsdp_fresh_grad": "backward", "fsdp_fresh_grad_made": "full_backward", "fsdp_fresh_grad_end": "post_backward",
    "fsdp_head_fresh_grad": "backward", "reduce_scatter_input": "backward", "embedding_full_gradient": "post_backward",
    "recomputed_block": "backward_input",
    "moe_backward": "backward_input", "moe_backward_freed": "backward_input",
    "moe_full_backward": "early_backward", "moe_full_backward_freed": "early_backward",
    "moe_input_backward": "input_backward", "moe_input_backward_freed": "input_backward",
    "loss": "loss", "fsdp_root_regather": "loss", "head_backward": "loss", "head_forward": "loss",
    "fsdp_units_kept_after_backward": "after_a_backward",
    "fsdp_units_kept_in_a_backward": "backward_after_forward",
    "fsdp_reduce_grad": "reduce_grad", "fsdp_stage_kept_params": "stage_kept",
    "fsdp_stage_current_params": "stage_current", "fsdp_stage_all_gather_output": "stage_gathering",
    "fsdp_stage_forward_all_gather_output": "stage_forward_gathering",
    "mlp_backward": "full_backward", "mlp_backward_freed": "full_backward", "cp_saved_refiled": "full_backward",
    "autocast_cast_gradients": "later_backward_end", "fsdp_embedding_fresh_grad": "backward_end",
    "fsdp_embedding_added_grad": "later_backward_end",
    "embedding_output_gradient": "backward_end", "embedding_output_kept": "backward_end",
    "blocks_output_gradient": "full_backward", "held_input_gradient": "after_first_backward",
    "split_backward_grads": "input_to_weight", "input_gradients_kept": "after_input",
    "stage_outputs_sent": "after_output", "weight_pass": "stage_weight",
    "weight_pass_fresh": "stage_later_weight", "weight_pass_grads": "stage_weight",
    "weight_pass_float8": "stage_weight", "weight_pass_experts": "stage_weight",
    "first_weight_end": "stage_weight", "first_weight_end_later": "stage_later_weight",
    "fsdp_stage_fresh_unmade": "stage_fresh_start", "recomputed_block_plain": "stage_backward_action",
    "split_backward_grads_freed": "stage_weight", "split_backward_grads_made": "input_backward",
    "float8_input_backward": "input_backward",
    "cp_attention": "backward_input", "attention_backward": "full_backward", "autocast_waiting_attention": "later_full_backward",
    "cp_attention_forward": "forwards", "fsdp_kept_all_gather": "forwards", "forward_down_projection": "forwards",
    "fsdp_unsharded_grads": "after_first_backward", "fsdp_embedding_full_grad": "after_first_backward",
    "fsdp_sharded_grads": "end_of_backward",
    "fsdp_stage_fresh_grads": "stage_fresh",
    "optimizer_step": "optimizer_step", "lora_forward_casts": "forwards", "float8_forward_cast": "forwards",
    "float8_forward_input_cast": "forwards", "fsdp_first_grads_made": "first_backward",
    "first_grads_phase_freed": "first_backward",
    "lora_recompute_casts": "backward_input",
    "fsdp_root_params": "every_action", "fsdp_unit_grads": "backward_input", "fsdp_late_reduce": "late_backward",
    "fsdp_head_grad": "backward", "fsdp_expert_reduce": "backward_input",
    "fsdp_root_reduce": "post_backward", "fsdp_root_end": "post_backward",
    "fsdp_root_reduce_accumulated": "post_backward",
    "fsdp_reduced_grads": "late_backward",
    "late_block_activations": "late_backward", "plain_late_grads": "late_backward",
    "plain_late_activations": "late_backward", "plain_early_grads": "first_backward",
    "fsdp_early_reduce": "early_backward",
    # expert parallelism's all-to-all buffers: one MoE layer's, while it runs (a fake Qwen3 235B step, ep8,
    # holds none at its loss moment)
    "moe_all_to_all": "during_actions",
    # "fsdp_unsharded_params" depends on the wrapping plan: ``lifetime_of``
}

#: terms that are part of another term at an earlier moment (the sharded gradients some units have made by
#: then), not more of it: a rank's whole states are its catalogue without them
PARTIAL_STATE_KINDS = frozenset({"fsdp_early_reduce", "fsdp_reduced_grads", "plain_grads_accumulating",
                                 "plain_late_grads", "plain_early_grads"})

#: a unit's whole fresh gradient at its post-backward: a term of the end of the backward (``post_backward``), and in
#: the events also made by every block's backward in a B's walk, after its transients, before its post-backward adds
#: it in (an event-only transient, laid where it stays within the peak: the allocator sees each one)
UNIT_FRESH_KINDS = frozenset({"fsdp_fresh_grad_end"})
_UNIT_FRESH = "unit_fresh"

#: what a unit's backward has made of its fresh gradient by a B's own moment (``full_backward``): in the events made
#: by every block of a B's walk, as the moment's other per-block transients are (``_UNIT_MADE`` rows)
UNIT_MADE_KINDS = frozenset({"fsdp_fresh_grad_made"})
_UNIT_MADE = "unit_made"

#: the end of an unpipelined FSDP2 backward (the ``fsdp_root_end`` term: the largest of the root's post-backward's
#: sides beyond what the moment holds, ``engine.memory.buffers._unit_by_unit_reduce``): torch's ``foreach_reduce``
#: reshards the root, drops the last block's reduce-scatter input and allocates the root's whole, in the reduce dtype;
#: the events lay the term's row as that sequence (``_Laying._root_end``, ``Grain.root_end``)
_ROOT_END = "root_end"

#: the stream FSDP2's all-gathers allocate on (the default stream is 0)
ALL_GATHER_STREAM = 1

#: the stream FSDP2's reduce-scatter output, the sharded gradient, is allocated on (``foreach_reduce``
#: allocates ``reduce_output`` under ``device_handle.stream(reduce_scatter_stream)`` and the sharded
#: gradients are views of it)
REDUCE_SCATTER_STREAM = 2

#: the activation kinds that are a stage's blocks (laid block by block with a :class:`Grain`)
BLOCK_KINDS = frozenset({"layers", "moe_layers"})

#: what lives from the first backward on but is gone by the end of the backward: FSDP2's accumulated
#: unsharded gradients. The reducing post-backward hands each unit's to its reduce-scatter and drops it
#: (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py, post_backward:
#: "fsdp_param.unsharded_accumulated_grad = None"), so the end-of-backward moment, which holds the
#: sharded gradients, no longer holds them; and a later stage's input gradient, held for its send to
#: the previous stage (measured: gone once the last backward's send completes); and under pipelining FSDP2's unsharded
#: parameters kept from the stage's first backward: the schedule's REDUCE_GRAD (stage.py's perform_reduce_grad) sets
#: set_reshard_after_backward(True) and runs each group's post_backward, which reshards them
END_FREED_KINDS = frozenset({"fsdp_unsharded_grads", "fsdp_embedding_full_grad", "held_input_gradient",
                             "fsdp_unsharded_params"})

#: of those, what the events lay as one tensor made at the end of the rank's first backward, not a piece per block as
#: autograd makes the units' gradients: the token embedding's gradient at full V × h under TP (its unit's backward is
#: the step's last; measure --fake of Llama 3 8B tp4 SP cp2 ZeRO-2 fp32, seed 20261244 #26: one 2,004 MiB
#: allocation where the cache held 3.8 GiB free in smaller blocks, a new segment)
WHOLE_KINDS = frozenset({"fsdp_embedding_full_grad"})
#: the event rows' lifetime of a tensor alive from the first backward to the step's end that the events lay whole,
#: after the blocks' pieces (``Terms.plain_grad_whole``: the TP token embedding's plain gradient at full V × h)
LATE_WHOLE = "after_first_backward_whole"

#: what is alive all step but not at the optimizer step: autocast's cached weight casts. The training
#: loop runs each forward and its backward inside ``torch.autocast``, whose exit clears the cache
#: (torch/amp/autocast_mode.py: ``if torch.autocast_decrement_nesting() == 0: torch.clear_autocast_cache()``)
#: once the backward has freed the saved references; the optimizer steps outside it
STEP_FREED_KINDS = frozenset({"autocast_weight_casts"})

#: the last stage's loss side: what the final norm, the head and the loss save per microbatch. Their
#: backward runs first in a B (after the loss's own, at the loss moment), and autograd frees what a
#: node saved once it has run, so they are gone by the blocks' backward: the B's own moment. A split
#: backward's I retains the graph for its W (``stage_backward_input``), so there they live until the W
HEAD_KINDS = frozenset({"final_norm", "head_input", "log_probabilities"})
#: of the loss side, what a split backward frees after the I rather than the W: the loss's nodes are above the
#: head's matmul (the head weight's group keeps that node, and with it what lies below: the final norm's and the
#: head's saved inputs), and ``stage_backward_input`` detaches the loss after its autograd.grad, so the graph
#: above goes (torch/distributed/pipelining/_backward.py; ``measure --fake`` of Llama 3 70B interleaved zero
#: bubble: one microbatch's log-probabilities alive at the last stage's W peak, not the four in flight)
LOSS_AT_INPUT_KINDS = frozenset({"log_probabilities"})

#: a pipeline's last stage's output (its logits), which torch.distributed.pipelining's stage keeps in ``fwd_cache``
#: from the forward and holds to the end of the microbatch's ``backward_one_chunk``: a full backward's B, or a
#: split backward's I (stage.py: the last stage keeps only the loss in ``backward_state`` for the W, and
#: detaches its output). An earlier stage's output stays in ``backward_state`` to the W: the body's lifetime
STAGE_OUTPUT_KINDS = frozenset({"stage_logits"})

#: what a stage-microbatch frees at its I's end, laid as its own tensor after the blocks (``so``): the last stage's
#: kept logits, and the tensors a stage's last block with experts saved above every weight's node (``stage_backward_input``
#: detaches the stage's output; ``engine.memory.activations._moe_top_of_stages``)
FREED_AT_INPUT_KINDS = STAGE_OUTPUT_KINDS | {"moe_top_saved"}

#: what a split backward keeps of a stage-microbatch from its I to its W, per stage (term ``stage`` and
#: ``in_flight``): torch.distributed.pipelining's ``stage_backward_input`` hooks the nodes where each
#: weight's path meets the input's and keeps the gradients flowing into them (``param_group["grads"]``)
#: for ``stage_backward_weight``, and sets the stage input's ``.grad``
INPUT_TO_WEIGHT_KINDS = frozenset({"split_backward_grads"})

#: a stage's input gradients a split backward makes, one per I (``after_input``: per stage, ``in_flight`` the I's of
#: the stage): torch's ``stage_backward_input`` sets each on the stage input's ``.grad`` — a receive buffer, one
#: per microbatch, kept by the stage across steps — and nothing drops it before the next step's
#: ``clear_runtime_states`` (``stage_backward``, a full B, sets it back to None once read:
#: torch/distributed/pipelining/_backward.py)
INPUT_GRADIENT_KINDS = frozenset({"input_gradients_kept"})

#: a stage's outputs sent to another rank, one per microbatch, where the schedule keeps its sends' Works to the end
#: of its actions (``after_output``: per stage, ``in_flight`` the microbatches): the output leaves the stage's
#: ``fwd_cache`` at the microbatch's B (or I) but the ``dist.isend`` Work still holds it
#: (``engine.pipeline.schedules.sends_held``)
OUTPUT_SENT_KINDS = frozenset({"stage_outputs_sent"})

#: the term kinds whose buffers the allocation events lay on FSDP2's all-gather stream: its all-gather inputs and
#: outputs, and (an approximation the events keep) the unsharded parameters, which torch's copy-out allocates on the
#: compute stream (``foreach_all_gather_copy_out`` in ``wait_for_unshard``) but the events lay per moment, freed and
#: laid again at each, where the compute stream's tensors of the next moment would take their blocks
ALL_GATHER_STREAM_KINDS = frozenset({"all_gather_output", "fsdp_unsharded_params", "all_gather_input",
                                     "unsharded_params", "fsdp_root_params", "fsdp_stage_kept_params",
                                     "fsdp_stage_current_params", "fsdp_stage_all_gather_output",
                                     "fsdp_stage_forward_all_gather_output"})

#: the term kinds whose buffers FSDP2 allocates on its reduce-scatter stream: the sharded gradients
REDUCE_SCATTER_STREAM_KINDS = frozenset({"fsdp_sharded_grads", "fsdp_reduced_grads"})

#: FSDP2's sharded gradients (the grads category's terms of these kinds), which the allocation events lay a unit at a
#: time (``Terms.grad_piece``): each unit's post-backward allocates its reduce-scatter output
SHARDED_GRAD_KINDS = frozenset({"fsdp_sharded_grads", "fsdp_reduced_grads", "fsdp_early_reduce"})


def fsdp_params_lifetime(sharded: bool, reshard_after_forward: bool | None, after_backward: bool,
                         pipelined: bool = True, per_stage: bool = False) -> str:
    """The lifetime of FSDP2's unsharded-parameters term, as ``engine.memory.buffers`` chose it:
    unpipelined, the current block's unit → during every action, not at the end of the backward (the
    root unit, a term of its own, is gathered then); pipelined, current (+ prefetched) unit → every
    action (on a rank of several stages per-stage terms instead: ``stage_current``, ``stage_kept``); every unit
    gathered between forward and backward (ZeRO-2, replicate, ZeRO-3 not resharding after forward)
    → every action and loss moment, not the end of the backward: without pipelining from each forward to the
    unit's post-backward; under pipelining the schedule sets ``set_reshard_after_backward(False)`` until its
    REDUCE_GRAD, whose post-backward reshards them (``perform_reduce_grad`` sets it True first). (Kept from the
    first backward on: ``END_FREED_KINDS`` takes them off the end of the backward likewise.) ``per_stage``: a
    rank of several pipeline stages, whose units stay gathered: each stage's are a term of their own, gathered at its
    first forward and resharded at its own REDUCE_GRAD (``stage_gathered``), which on a looped schedule comes long
    before the rank's last backward (measure --fake of Llama 3 405B LoopedBFS pp4 v2 ZeRO-3: rank 0's stage 4 units,
    2.97 GiB, no longer gathered while stage 0 runs its backwards)."""
    if per_stage and not (sharded and reshard_after_forward):
        return "stage_gathered"
    if sharded and reshard_after_forward and not pipelined:
        # the current block's unit: the root unit (``fsdp_root_params``) is the one gathered at the end
        return "during_actions"
    if sharded and reshard_after_forward:
        # a rank of one stage: the current (+ prefetched) unit; the others kept since a backward are their own term
        # (``fsdp_units_kept_after_backward``: ``after_a_backward``)
        return "after_first_backward" if after_backward and per_stage else "every_action"
    # gathered in each forward, kept to the unit's backward, resharded in its post-backward (FSDP2's
    # reshard_after_backward, True unless a pipeline schedule sets it False until its REDUCE_GRAD: torch's
    # _fsdp_param_group.post_backward): at every action and loss moment, gone at the end of the backward
    # (and unpipelined the all-gather output then lives in the forwards only: ``lifetime_overrides``)
    return "until_end_of_backward"


def lifetime_of(term: Term, fsdp_params: str = "step", overrides: dict[str, str] | None = None) -> str:
    """The lifetime of one term (``fsdp_params``: that of FSDP2's unsharded parameters; ``overrides``:
    kind -> lifetime where the wrapping plan changes a kind's rule, ``lifetime_overrides``)."""
    if term.category == "activations" and term.stage is not None and term.in_flight is not None \
            and term.kind != "pipeline_outputs":
        return "microbatch"
    if term.kind == "fsdp_unsharded_params":
        return fsdp_params
    if overrides and term.kind in overrides:
        return overrides[term.kind]
    return LIFETIMES.get(term.kind, "step")


def lifetime_overrides(pipelined_fsdp2: bool, sharded: bool, reshard_after_forward: bool | None,
                       local_stages: int = 1, pipelined: bool = True, plain_grads_late: bool = False,
                       split_backward: bool = False, converts: bool = False,
                       single_block_stages: bool = False, moe_late_dense: bool = False) -> dict[str, str]:
    """The kinds whose lifetime the wrapping plan changes: under pipelining with units never resharded
    (no resharding after forward, none after backward) FSDP2's all-gather output exists only in each
    stage's first forward. On a rank holding several stages torch reduces each stage's gradients right
    after that stage's last backward (``_add_reduce_grad`` in torch/distributed/pipelining/schedules.py:
    "schedule it just after the last 'backward'-like stage"): each stage's unsharded gradients
    accumulate from its own first backward until then and its sharded gradients exist from then on,
    stage by stage (``STAGE_LIFETIMES``: the terms are per stage, ``engine.memory.buffers`` and
    ``engine.memory.states``).

    ``plain_grads_late``: the parameters' own ``.grad`` (no FSDP2, and DDP's buckets, if any, apart
    from them) exist from the rank's first backward on: the training loop's
    ``zero_grad(set_to_none=True)`` dropped the last step's after its optimizer step, and autograd's
    AccumulateGrad makes each one as the first backward reaches its parameter
    (torch/csrc/autograd/functions/accumulate_grad.h: a new tensor where ``.grad`` is undefined), so
    no moment before the first backward holds them (measured: a fake Llama 3 405B step on dp1 tp8 z0
    peaks at its loss with 20.7 GiB fewer than the gradients' size). ``split_backward``: the schedule splits
    its backward into I and W, and the W makes them (``after_first_weight``). ``converts``: FSDP2 accumulates the
    unsharded gradients in another dtype than the parameters' (``WrappingPlan.grad_accumulation_dtype``): on a
    rank of several stages under a split backward that accumulation exists only from the first I after a W
    (``stage_converted``), the W's gradients in the parameter dtype before (``stage_fresh``).
    ``single_block_stages``: every local pipeline stage holds one block; a backward (re)gathers its block and root at
    its start and has no next block to prefetch, so no all-gather output is alive at its moment (measure --fake of
    Qwen3 235B pp8 ZeRO-3 reshard "always", one block a stage: the 4.6 GiB output freed by the copy-out before the
    block's backward runs; +9 … +12 % on every stage). ``moe_late_dense``: a first backward with plain gradients on a
    rank of one stage whose first block, the late-backward moment's, has no experts: the MoE backward's moment (its
    experts' input buffers, ``activations.moe_backward_terms``) is the B's own, not the late one's (measure --fake of
    Mixtral 8x7B, 2 blocks, the first dense, dp8 ZeRO-1: 8.8 GiB of them at the B's moment, none at layer 0's)."""
    out: dict[str, str] = {}
    if moe_late_dense:
        out["moe_backward"] = out["moe_backward_freed"] = "early_backward"
    if plain_grads_late and pipelined and local_stages > 1:  # each stage's from its first B (or W) on
        out["gradients"] = "stage_reduced"
        out["plain_grads_accumulating"] = "stage_accumulated"
    elif plain_grads_late:
        out["gradients"] = "after_first_weight" if split_backward else "after_first_backward"
    if pipelined_fsdp2 and sharded and reshard_after_forward is False:
        out["all_gather_output"] = "first_forwards"
    if pipelined and local_stages > 1:  # the first stage's B ends only (``stage`` 0 on the terms)
        out["embedding_output_gradient"] = out["embedding_output_kept"] = "stage_backward_end"
    if pipelined_fsdp2 and local_stages > 1:
        out["fsdp_unsharded_grads"] = "stage_converted" if split_backward and converts else "stage_accumulated"
        out["fsdp_embedding_full_grad"] = out["fsdp_unsharded_grads"]
        out["fsdp_sharded_grads"] = "stage_reduced"
        out["fsdp_stage_fresh_grads"] = "stage_fresh"
        # the token embeddings' fresh gradient: at the end of the first stage's B only (``stage`` set on the term)
        out["fsdp_embedding_fresh_grad"] = "stage_backward_end"
        out["fsdp_embedding_added_grad"] = "stage_later_backward_end"
        if split_backward and converts:  # a later stage's W makes the whole stage's (``stage_fresh``), its I none
            out["fsdp_fresh_grad"] = "full_backward"
    if pipelined_fsdp2 and sharded and reshard_after_forward and local_stages == 1:
        # the next unit's output, but at a backward right after a backward: every unit gathered, none to gather
        out["all_gather_output"] = "gathering"
    if pipelined and sharded and reshard_after_forward and single_block_stages:
        out["all_gather_output"] = "forwards"
    if not pipelined and sharded and reshard_after_forward:
        # the all-gather output of the unit prefetched (or being copied out): none at the end of the backward,
        # where only the root unit is gathered
        out["all_gather_output"] = "during_actions"
    if not pipelined and sharded and reshard_after_forward is False:
        # each unit all-gathered in its forward and kept to its post-backward: a backward gathers
        # nothing (FSDP2's pre_backward unshard finds it unsharded), so no all-gather output then
        out["all_gather_output"] = "forwards"
    return out


# --------------------------------------------------------------------------- the moments of a step


#: the phases of a moment (``Moments.phase``)
ACTION, LOSS, LATE, END, STEP, B_END, REDUCE = 0, 1, 2, 3, 4, 5, 6


class Moments(NamedTuple):
    """The moments of one rank's step (one per compute action), as arrays.

    ``kind``, ``stage``, ``microbatch``: the action; ``counts[i, j]``: stage-microbatches of local
    stage j alive at moment i; ``outputs[i]``: the last stage's forwards done by moment i;
    ``masks[i, c]``: transient lifetime ``TRANSIENT[c]`` alive at moment i; ``phase[i]``: ``ACTION``
    for an action's own moment, ``LOSS`` for the loss moment that opens a last-stage B or I (the next
    moment is that action's own), ``END`` for the end of the backward, ``STEP`` for the optimizer step after it,
    ``B_END`` for the end of a B (``backward_end``);
    ``head[i, j]``: stage-microbatches of local stage j whose loss side (``HEAD_KINDS``) is alive at
    moment i — as ``counts``, but an F's own moment (its blocks' forward, their units gathered) comes
    before the final norm and the head make them, and a full backward B's own moment (its blocks'
    backward) after their backward freed them; an I keeps them for its W. ``iw[i, j]``: stage-microbatches
    of local stage j between their I and their W at moment i (made by the I, alive at the W's own
    moment, freed after it): a split backward's retained gradients (``INPUT_TO_WEIGHT_KINDS``).
    ``acc[i, j]``: local stage j's FSDP2 unsharded gradients alive at moment i (after its first B or W,
    made during it, until its REDUCE_GRAD right after its m-th B or W: that action's moment still holds
    them); ``red[i, j]``: its sharded gradients (after that REDUCE_GRAD, and at the end of the backward):
    ``STAGE_LIFETIMES``. ``wr[i, j]``: moment i is a W of local stage j (its own moment: the
    ``stage_weight`` lifetime).
    """

    kind: np.ndarray
    stage: np.ndarray
    microbatch: np.ndarray
    counts: np.ndarray
    outputs: np.ndarray
    masks: np.ndarray
    phase: np.ndarray
    head: np.ndarray
    iw: np.ndarray
    acc: np.ndarray
    red: np.ndarray
    wr: np.ndarray
    cv: np.ndarray
    fr: np.ndarray
    ig: np.ndarray
    ga: np.ndarray
    be: np.ndarray
    lbe: np.ndarray
    lw: np.ndarray
    fs: np.ndarray
    bi: np.ndarray
    ho: np.ndarray
    gk: np.ndarray
    cu: np.ndarray
    sg: np.ndarray
    sf: np.ndarray

    @property
    def matrix(self) -> np.ndarray:
        return np.column_stack([self.counts, self.head, self.iw, self.acc, self.red, self.wr, self.cv, self.fr,
                                self.ig, self.ga, self.be, self.lbe, self.lw, self.fs, self.bi, self.ho, self.gk,
                                self.cu, self.sg, self.sf, self.outputs,
                                self.masks])


def sig_moments(sig: Signature) -> Moments:
    """The moments of a rank's signature: :func:`moments`, with the late-backward moment where the rank
    has something of the ``late_backward`` lifetime."""
    return moments(sig.schedule, sig.pp_rank, sig.pp, sig.virtual_stages, sig.microbatches,
                   bool(sig.transient_bytes[_LATE_BACKWARD]),
                   bool(sig.transient_bytes[_BACKWARD_END] or sig.transient_bytes[_LATER_BACKWARD_END]
                        or any(sig.be_bytes) or any(sig.lbe_bytes)),
                   bool(sig.transient_bytes[_REDUCE_GRAD]))


@lru_cache(maxsize=512)
def moments(schedule: str, pp_rank: int, pp: int, virtual_stages: int, microbatches: int,
            late: bool = False, b_end: bool = False, reduce: bool = False) -> Moments:
    """The moments of ``pp_rank``'s step (read-only arrays, cached): see :class:`Moments`. ``late``: an
    unpipelined single-microbatch step gets the late-backward moment before its end (``_with_late_moment``);
    ``b_end``: each full backward B gets the moment of its end after it (``_with_backward_ends``); ``reduce``: a
    pipelined rank of one stage gets the moment of its REDUCE_GRAD before its end (``_with_reduce_moment``)."""
    m = microbatches
    if pp == 1:
        plan, stages = single_rank_plan(schedule, m), [0]
    else:
        plan = pipeline_actions(schedule, pp, m, virtual_stages)
        stages = plan.stages_of_rank(pp_rank)
    a = plan.arrays
    lo, hi = int(a.offsets[pp_rank if pp > 1 else 0]), int(a.offsets[(pp_rank if pp > 1 else 0) + 1])
    kind, stage, mb = a.kind[lo:hi], a.stage[lo:hi], a.microbatch[lo:hi]
    n, v = hi - lo, len(stages)
    column = np.full(max(stages) + 1, -1, dtype=np.int64)
    column[stages] = np.arange(v)
    col = column[stage]
    is_f = kind == _F
    frees = (kind == _B) | (kind == _W)
    delta = np.zeros((n, v), dtype=np.int64)
    delta[np.arange(n), col] = np.where(is_f, 1, np.where(frees, -1, 0))
    # alive after each action; a B or W frees only after it has run, so its moment still holds it
    counts = np.cumsum(delta, axis=0)
    counts[np.arange(n), col] += frees
    # the loss side: freed by the time a full backward B reaches its blocks (its own moment no longer
    # holds it; the loss moment does). A split backward keeps it: its I runs autograd with the graph
    # retained for the W, so what the head saved lives until the W frees the microbatch (the loss's
    # log-probabilities go after the I: ``LOSS_AT_INPUT_KINDS``, taken off through ``iw``)
    head = counts.copy()
    head[np.arange(n), col] -= (kind == _B) | is_f  # an F's own moment is its blocks' forward: not made yet
    # a split backward's retained gradients: made by each I (not yet at its own moment), freed after its W
    d_iw = np.zeros((n, v), dtype=np.int64)
    d_iw[np.arange(n), col] = np.where(kind == _I, 1, np.where(kind == _W, -1, 0))
    iw = np.cumsum(d_iw, axis=0)
    iw[np.arange(n), col] += (kind == _W).astype(np.int64) - (kind == _I)
    keeps, sent_out, ig, ho, ig_step = _sends_kept(schedule, pp, plan.num_stages, stages, kind, stage, col, v)
    last_stage = plan.num_stages - 1
    outputs = np.cumsum(is_f & (stage == last_stage))
    is_bwd_input = (kind == _B) | (kind == _I)
    bwd_idx = np.flatnonzero(is_bwd_input)
    first_bwd = int(bwd_idx[0]) if len(bwd_idx) else n
    grad_idx = np.flatnonzero((kind == _B) | (kind == _W))  # the first action that makes weight gradients
    first_grad = int(grad_idx[0]) if len(grad_idx) else n
    acc, red, wr, cv, fr, ga, fs, gk, cu, sg, sf = _stage_columns(kind, stage, col, v, m)
    bi = np.zeros((n, v), dtype=np.int64)  # a B's or an I's own moment, of its stage
    bi[np.arange(n), col] = (kind == _B) | (kind == _I)
    lw = wr * acc  # a W after the stage's first: its weights hold a gradient (``acc`` from the end of its first B or W)
    be = np.zeros((n, v), dtype=np.int64)  # a stage's B ends: ``_with_backward_ends``
    first_f = np.zeros(n, dtype=bool)
    f_idx = np.flatnonzero(is_f)
    first_f[f_idx[np.unique(stage[f_idx], return_index=True)[1]]] = True
    masks = _action_masks(kind, stage, first_f, first_grad, first_bwd)
    # A last-stage B or I starts with the loss's backward: the fp32 logits and their gradient exist
    # before any unit of the stage is gathered for backward (FSDP2's pre-backward hook fires when the
    # logits' gradient reaches the root), before any gradient (each unit makes its gradient in its
    # post-backward) and before the recomputation of a block. So a loss moment precedes the action's
    # own moment, with the same microbatches and kept outputs, of the transients the loss alone (and
    # what lives from the first backward on, if an earlier backward ran).
    col_of_last, frees_last = (int(col[-1]), bool(frees[-1])) if n else (0, False)
    loss_at = np.flatnonzero(is_bwd_input & (stage == last_stage))
    is_loss = np.zeros(n, dtype=bool)
    if len(loss_at):
        lm = _loss_masks(kind, stage, loss_at, first_bwd, first_grad, pp > 1)
        src, at = _duplicated_rows(n, loss_at)  # each loss moment a copy of its action's row, before it
        kind, stage, mb, iw, ig, ho, acc, red, cv, fr, ga, gk, counts, outputs = (
            x[src] for x in (kind, stage, mb, iw, ig, ho, acc, red, cv, fr, ga, gk, counts, outputs))
        head = head[src]
        head[at] = counts[at]  # the loss's backward runs on the loss side
        wr, be, lw, fs, bi, cu, sg, sf = (_zeroed(x[src], at) for x in (wr, be, lw, fs, bi, cu, sg, sf))
        masks = masks[src]
        masks[at] = lm
        is_loss = np.zeros(len(src), dtype=bool)
        is_loss[at] = True
    phase = is_loss.astype(np.int64)
    if len(bwd_idx):
        # the end of the backward: every gradient complete, every stage-microbatch freed, the kept
        # outputs, and the transients of the last unit's post-backward (the root unit gathered, its
        # gradient being reduced); no loss, no recomputed block
        em = np.zeros((1, masks.shape[1]), dtype=np.int64)
        for life in ("every_action", "gathering", "backward", "end_of_backward", "post_backward", "after_first_weight",
                     "after_first_backward"):
            em[0, TRANSIENT.index(life)] = 1
        last = len(kind) - 1
        end_counts = counts[last:].copy()
        end_counts[0, col_of_last] -= int(frees_last)
        kind, stage, mb = (np.append(x, x[last]) for x in (kind, stage, mb))
        counts = np.append(counts, end_counts, axis=0)
        head = np.append(head, np.minimum(head[last:], end_counts), axis=0)  # the last W frees its own too
        end_iw = iw[last:].copy()
        end_iw[0, col_of_last] -= int(kind[last] == _W)
        iw = np.append(iw, end_iw, axis=0)
        end_ig, end_ho = ig[last:].copy(), ho[last:].copy()  # (what the last action keeps: made by now)
        end_ig[0, col_of_last] += int(keeps[-1])
        end_ho[0, col_of_last] += int(sent_out[-1])
        ig, ho = np.append(ig, end_ig, axis=0), np.append(ho, end_ho, axis=0)
        # every stage reduced (its sharded gradients alive) and resharded by then
        red = np.append(red, np.ones((1, v), dtype=np.int64), axis=0)
        acc, wr, cv, fr, ga, be, lw, fs, bi, gk, cu, sg, sf = (
            np.append(x, np.zeros((1, v), dtype=np.int64), axis=0) for x in (acc, wr, cv, fr, ga, be, lw, fs, bi, gk, cu,
                                                                            sg, sf))
        outputs = np.append(outputs, outputs[last])
        masks = np.append(masks, em, axis=0)
        phase = np.append(phase, END)
    out = Moments(kind.copy(), stage.copy(), mb.copy(), counts, outputs, masks, phase, head, iw, acc, red, wr, cv, fr,
                  ig, ga, be, be.copy(), lw, fs, bi, ho, gk, cu, sg, sf)
    if late and pp == 1 and m == 1 and len(bwd_idx) and kind[-2] == _B:
        out = _with_late_moment(out)
    elif late and v == 1 and len(bwd_idx):
        out = _with_first_late_moment(out)
    if b_end:
        out = _with_backward_ends(out, column, pp > 1)
    if reduce and pp > 1 and v == 1 and len(bwd_idx):
        out = _with_reduce_moment(out)
    if len(bwd_idx):
        out = _with_step_moment(out, ig_step)
    for x in out:
        x.setflags(write=False)
    return out


def _sends_kept(schedule: str, pp: int, num_stages: int, stages, kind: np.ndarray, stage: np.ndarray, col: np.ndarray,
                v: int) -> tuple:
    """``moments``' columns of what the actions keep to the end of the backward: per action, whether it keeps an
    input gradient (``keeps``) and a sent stage output (``sent_out``); per moment and local stage their counts
    (``ig``, ``ho``: not yet at the action's own moment); and the input gradients the optimizer step still holds.

    The input gradients (``after_input``): a split backward's I sets each on its receive buffer's .grad, to the
    step's end; and where the schedule keeps its sends' Works to the end of its actions (``sends_held``), each B's
    that goes to another rank (the V-schedules hand theirs over locally), until the schedule drops the Works
    before the optimizer step. The stage outputs sent to another rank (``after_output``), there: out of the
    stage-microbatch once its B or W frees it (an I keeps the output in ``backward_state`` for the W)."""
    n = len(kind)
    held = pp > 1 and sends_held(schedule) == "all"
    keeps = (kind == _I) & (stage > 0)
    sent_out = np.zeros(n, dtype=bool)
    if held:
        keeps = keeps | ((kind == _B) & (stage > 0) & ~np.isin(stage - 1, stages))
        sent_out = ((kind == _B) | (kind == _W)) & (stage < num_stages - 1) & ~np.isin(stage + 1, stages)
    out = []
    for made in (keeps, sent_out):
        d = np.zeros((n, v), dtype=np.int64)
        d[np.arange(n), col] = made
        x = np.cumsum(d, axis=0)
        x[np.arange(n), col] -= made
        out.append((x, d))
    (ig, d_ig), (ho, _) = out
    return keeps, sent_out, ig, ho, d_ig[kind == _I].sum(axis=0)


def _loss_masks(kind: np.ndarray, stage: np.ndarray, loss_at: np.ndarray, first_bwd: int, first_grad: int,
                pipelined: bool = False) -> np.ndarray:
    """The transient lifetimes alive at the loss moments before the actions ``loss_at`` (``TRANSIENT``'s columns): the
    loss, the units kept to the end of the backward, what lives from the first backward (or weight gradient) on if one
    ran before, the units a backward left gathered (none where a forward resharded them since). Under
    pipelining a backward leaves every unit it gathered so (set_reshard_after_backward(False)): after one, the current
    units are gathered too, as at a B's end (``_with_backward_ends``; measure --fake of Qwen3 30B pp4 GPipe ZeRO-3, the
    last stage's loss before its second B: every unit of the stage gathered)."""
    lm = np.zeros((len(loss_at), len(TRANSIENT)), dtype=np.int64)
    lm[:, TRANSIENT.index("loss")] = 1
    lm[:, TRANSIENT.index("until_end_of_backward")] = 1
    lm[:, TRANSIENT.index("after_first_backward")] = loss_at > first_bwd
    lm[:, TRANSIENT.index("after_first_weight")] = loss_at > first_grad
    after = np.isin(_previous_kind(kind, stage)[loss_at], (_B, _I, _W))
    lm[:, _AFTER_A_BACKWARD] = after
    lm[:, TRANSIENT.index("every_action")] = after & pipelined
    return lm


def _previous_kind(kind: np.ndarray, stage: np.ndarray) -> np.ndarray:
    """Per action, the kind of the action before it on the same stage (−1 for a stage's first)."""
    order = np.lexsort((np.arange(len(kind)), stage))  # each stage's actions in order
    same = stage[order][1:] == stage[order][:-1]
    prev = np.full(len(kind), -1, dtype=np.int64)
    prev[order[1:][same]] = kind[order[:-1][same]]
    return prev


def _kept_since_backward(kind: np.ndarray, stage: np.ndarray, col: np.ndarray, v: int,
                         reduce_at: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per action and local stage (``Moments``' ``gk``, ``cu``): on a rank of several stages under ZeRO-3 resharding
    after forward, the stage's FSDP2 units kept gathered since its last backward-like action (B, I or W: the
    schedule's ``set_reshard_after_backward(False)``, torch/distributed/pipelining/stage.py
    ``backward_maybe_with_nosync``) — at every moment after it up to the stage's next F, whose post-forwards reshard
    them block by block (so not at that F's own moment), and not after its REDUCE_GRAD (``perform_reduce_grad`` sets
    ``reshard_after_backward`` again and reshards them); at the stage's own B, I or W right after a backward every
    unit is still gathered. ``cu``: the stage's own F, and its B, I or W right after a forward, which gather its
    root unit and the current block's; ``sg``, ``sf``: its own B, I or W right after a forward, and its F not right
    after a backward, which all-gather (after a backward every unit is gathered already). measure --fake of Mixtral
    8x7B Interleaved1F1B pp2 v3 ZeRO-3 reshard "always" (fake seed 20261268 #03, rank 4, stages 1, 3, 5, one block
    each): stage 5's last B holds stage 1's units (its B two actions before) and its own, not stage 3's (resharded by
    its F since)."""
    n = len(kind)
    if v == 1:  # a rank of one stage lays none of them (``buffers._stage_by_stage_units``): the planner's hot path
        return tuple(np.zeros((n, 1), dtype=np.int64) for _ in range(4))
    rows = np.arange(n)
    backward = np.isin(kind, (_B, _I, _W))
    # per moment and stage, the stage's last action before it (−1: none yet), vectorized (the engine's hot path)
    own = np.full((n, v), -1, dtype=np.int64)
    own[rows, col] = rows
    before = np.vstack([np.full((1, v), -1, dtype=np.int64), np.maximum.accumulate(own, axis=0)[:-1]])
    kept = (before >= 0) & backward[np.maximum(before, 0)] & (rows[:, None] <= reduce_at[None, :])
    mine = np.zeros((n, v), dtype=bool)
    mine[rows, col] = True
    gk = (kept & ~(mine & (kind == _F)[:, None])).astype(np.int64)
    prev = before[rows, col]  # each action's stage's action before it
    after_backward = (prev >= 0) & backward[np.maximum(prev, 0)]
    cu = np.zeros((n, v), dtype=np.int64)
    cu[rows, col] = (kind == _F) | (backward & ~after_backward)
    sg = np.zeros((n, v), dtype=np.int64)
    sg[rows, col] = backward & ~after_backward
    sf = np.zeros((n, v), dtype=np.int64)
    sf[rows, col] = (kind == _F) & ~after_backward
    return gk, cu, sg, sf


def _stage_columns(kind: np.ndarray, stage: np.ndarray, col: np.ndarray, v: int, m: int) -> tuple[np.ndarray, ...]:
    """Per action and local stage (``Moments``' ``acc``, ``red``, ``wr``, ``cv``, ``fr``, ``ga``): its unsharded gradients
    alive (after its first B or W, through its REDUCE_GRAD right after its m-th backward-like action, B or W), its
    sharded gradients alive (after that), the action being one of its W; and where FSDP2 accumulates in another
    dtype than the parameters', that accumulation (``cv``: after the first post-backward that finds a gradient —
    the first B, or the first I after a W; before it the W's gradients stay in ``.grad`` in the parameter dtype,
    torch's ``FSDPParam.to_accumulated_grad_if_needed``) and the parameter-dtype gradients in ``.grad`` (``fr``:
    from each W, its own moment included, to the next I or B that adds them in, or to the REDUCE_GRAD; ``fs``: the W
    makes them afresh, none pending from an earlier W). The
    first stage's W is a full backward (stage.py's ``backward_weight_one_chunk``: its I ran nothing), which adds
    them in itself, as a B does (``first_stage``: per action, the action is the pipeline's stage 0's). ``ga``: its
    FSDP2 units gathered and kept so (no resharding after forward; the schedule's ``set_reshard_after_backward(False)``),
    from its first F through its REDUCE_GRAD, whose post-backward reshards them. Then ``gk``, ``cu``, ``sg``, ``sf``
    (``_kept_since_backward``)."""
    first_stage = stage == 0
    n = len(kind)
    rows = np.arange(n)
    done = np.zeros((n, v), dtype=np.int64)
    done[rows, col] = (kind == _B) | (kind == _W)
    finished = np.cumsum(done, axis=0) >= m
    reduce_at = np.where(finished.any(axis=0), finished.argmax(axis=0), n)
    # the first action that makes a weight gradient: a B, or a split backward's W (its I computes input gradients
    # only, so FSDP2's post-backward at the I finds no gradient to accumulate: torch's stage_backward_input)
    started = np.zeros((n, v), dtype=bool)
    started[rows, col] = (kind == _B) | (kind == _W)
    first_at = np.where(started.any(axis=0), started.argmax(axis=0), n)
    idx = rows[:, None]
    wr = np.zeros((n, v), dtype=np.int64)
    wr[rows, col] = kind == _W
    cv = np.zeros((n, v), dtype=np.int64)
    fr = np.zeros((n, v), dtype=np.int64)
    fs = np.zeros((n, v), dtype=np.int64)
    conv_at = [n] * v
    backward = (kind == _B) | (kind == _I) | (kind == _W)
    for j in range(v):  # each stage's own backward-like actions, in order
        idx_j = np.flatnonzero(backward & (col == j)).tolist()
        last = int(reduce_at[j])
        since = None  # the W whose gradients are in .grad, not yet added into the accumulation
        for i in idx_j:
            k = int(kind[i])
            if k == _W and bool(first_stage[i]):
                conv_at[j] = min(conv_at[j], i)
            elif k == _W:
                fs[i, j] = since is None and i <= last  # its groups make the .grad afresh
                since = i if since is None else since
            else:  # a B, or an I: its post-backward adds in what a W left (at its own moment they still exist)
                if k == _B or since is not None:
                    conv_at[j] = min(conv_at[j], i)
                if since is not None:
                    fr[since:min(i, last) + 1, j] = 1
                since = None
        if since is not None:
            fr[since:last + 1, j] = 1
    conv = np.array(conv_at)
    cv[:] = ((idx > conv) & (idx <= reduce_at)).astype(np.int64)
    forwards = np.zeros((n, v), dtype=bool)
    forwards[rows, col] = kind == _F
    first_f = np.where(forwards.any(axis=0), forwards.argmax(axis=0), n)
    ga = ((idx >= first_f) & (idx <= reduce_at)).astype(np.int64)
    return (((idx > first_at) & (idx <= reduce_at)).astype(np.int64), (idx > reduce_at).astype(np.int64), wr, cv, fr,
            ga, fs) + _kept_since_backward(kind, stage, col, v, reduce_at)


def _action_masks(kind: np.ndarray, stage: np.ndarray, first_f: np.ndarray, first_grad: int,
                  first_bwd: int) -> np.ndarray:
    """Per action, the transient lifetimes alive at its own moment (``TRANSIENT``'s columns, 0 or 1)."""
    n = len(kind)
    # the first stage's I runs no backward (torch's backward_one_chunk computes no input gradient for the first stage
    # and leaves the whole backward to its W, a full one: torch/distributed/pipelining/stage.py)
    inputs = (kind == _I) & (stage != 0)
    is_bwd_input = (kind == _B) | inputs
    every = np.ones(n, dtype=bool)
    after_bwd = np.isin(kind, (_B, _I, _W)) & np.isin(_previous_kind(kind, stage), (_B, _I, _W))
    full_b = (kind == _B) | ((kind == _W) & (stage == 0))  # the first stage's W is a full backward
    on = {"every_action": every, "backward": is_bwd_input | (kind == _W), "backward_input": is_bwd_input | full_b,
          "full_backward": full_b,
          "later_full_backward": _later_bs(kind, stage),
          "first_forwards": first_f, "until_end_of_backward": every, "during_actions": every, "forwards": kind == _F,
          "early_backward": full_b, "input_backward": inputs, "after_first_weight": np.arange(n) > first_grad,
          "after_a_backward": after_bwd, "gathering": ~after_bwd,
          "backward_after_forward": is_bwd_input & (_previous_kind(kind, stage) == _F),
          "after_first_backward": np.arange(n) > first_bwd, "first_backward": (np.arange(n) == first_bwd) & (kind == _B)}
    return np.column_stack([on.get(life, np.zeros(n, dtype=bool)) for life in TRANSIENT]).astype(np.int64)


def _later_bs(kind: np.ndarray, stage: np.ndarray) -> np.ndarray:
    """Per action, whether it is a B of a stage that ran a B before it."""
    out = np.zeros(len(kind), dtype=bool)
    b = np.flatnonzero(kind == _B)
    out[b] = True
    out[b[np.unique(stage[b], return_index=True)[1]]] = False
    return out


def _with_late_moment(mo: Moments) -> Moments:
    """``mo`` with the late-backward moment before its last (the end of the backward): an unpipelined
    step's one B at its second block (layer 1; replicate: its last), where FSDP2 has reduced every later block's gradient
    (``late_backward``: their sharded gradients, and the saved tensors of the two blocks still to run)
    and the microbatch's other saved tensors are freed; the B's transients as at its own moment."""
    n = len(mo.kind) - 1  # the END row: what is alive once the B has freed its microbatch
    row = _with_row_repeated(mo, n)
    masks = row["masks"][n]
    masks[:] = mo.masks[n - 1]  # the B's own transients, but what only its second block holds
    masks[_LATE_BACKWARD] = 1
    masks[_EARLY_BACKWARD] = masks[_FIRST_BACKWARD] = 0
    row["phase"][n] = LATE
    return Moments(**row)


def _duplicated_rows(n: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The gather index that doubles each of the (sorted, distinct) ``rows`` of an ``n``-row array, and where the first
    copies land (the second ones one after): ``x[src]`` is ``np.insert(x, rows, x[rows], axis=0)``, at a fraction of
    ``np.insert``'s cost per array (``moments`` is the planner's hot path)."""
    reps = np.ones(n, dtype=np.intp)
    reps[rows] = 2
    return np.repeat(np.arange(n), reps), rows + np.arange(len(rows))


def _zeroed(x: np.ndarray, at: np.ndarray) -> np.ndarray:
    """``x`` with rows ``at`` zeroed, in place."""
    x[at] = 0
    return x


def _with_row_repeated(mo: Moments, i: int) -> dict:
    """``mo``'s fields with row ``i`` twice (rows ``i`` and ``i + 1``), as new arrays: ``np.repeat``, which costs a
    fraction of ``np.insert``'s per call (a first prediction builds these for every distinct rank)."""
    reps = np.ones(len(mo.kind), dtype=np.intp)
    reps[i] = 2
    return {f: np.repeat(x, reps, axis=0) for f, x in zip(Moments._fields, mo)}


def _with_first_late_moment(mo: Moments) -> Moments:
    """``mo`` with the late-backward moment of a rank's first B, right after its own (a rank of one stage, pipelined or
    over several microbatches; plain gradients, ``buffers._plain_late_backward``): its walk at the stage's first
    block, every later block's gradient made and the microbatch's saved tensors of the blocks walked freed (a term
    of their own, ``plain_late_activations``: the microbatch stays alive, its stage output held to the B's end by
    the stage's ``backward_one_chunk``); the B's transients as at its own moment, but what only that holds."""
    rows = np.flatnonzero((mo.kind == _B) & (mo.phase == ACTION))
    if not len(rows):
        return mo
    b = int(rows[0])
    row = _with_row_repeated(mo, b)
    masks = row["masks"][b + 1]
    masks[_LATE_BACKWARD] = 1
    masks[_EARLY_BACKWARD] = masks[_FIRST_BACKWARD] = 0
    row["phase"][b + 1] = LATE
    return Moments(**row)


def _with_backward_ends(mo: Moments, column: np.ndarray, pipelined: bool = True) -> Moments:
    """``mo`` with a moment after each full backward B: the B's microbatch freed (its saved tensors and its loss
    side), none of the B's own transients, what lives from the first backward on (made during it), and
    ``backward_end`` (with ``later_backward_end`` but after a stage's first B). The first stage's W under a split
    backward is such a B (stage.py's ``backward_weight_one_chunk``: its I ran nothing, the W runs the whole backward,
    the token embedding's last: measure --fake of GPT-2 InterleavedZeroBubble pp4 ZeRO-2 peaks at the end of stage
    0's first W, its fp32 accumulation made beside the embeddings' fresh gradient). ``column``: local stage column
    of each global stage."""
    rows = np.flatnonzero(((mo.kind == _B) | ((mo.kind == _W) & (mo.stage == 0))) & (mo.phase == ACTION))
    if not len(rows):
        return mo
    first = np.unique(mo.stage[rows], return_index=True)[1]  # each stage's first B
    later = np.ones(len(rows), dtype=bool)
    later[first] = False
    col = column[mo.stage[rows]]
    counts = mo.counts[rows].copy()
    counts[np.arange(len(rows)), col] -= 1
    masks = np.zeros((len(rows), mo.masks.shape[1]), dtype=np.int64)
    masks[:, TRANSIENT.index("after_first_weight")] = 1  # a full B makes weight gradients
    masks[:, TRANSIENT.index("after_first_backward")] = 1
    masks[:, _BACKWARD_END] = 1
    masks[:, _LATER_BACKWARD_END] = later
    masks[:, _AFTER_A_BACKWARD] = 1  # the units the B gathered stay so (set_reshard_after_backward(False))
    masks[:, TRANSIENT.index("every_action")] = int(pipelined)  # (and with them the current ones)
    # under pipelining FSDP2's units kept gathered stay so to the stage's REDUCE_GRAD, past the B's end
    masks[:, TRANSIENT.index("until_end_of_backward")] = int(pipelined)
    acc = mo.acc[rows].copy()  # the stage's unsharded gradients: made during its first B, held until its REDUCE_GRAD
    acc[np.arange(len(rows)), col] = 1  # (after the B, which its end is not yet)
    be = np.zeros_like(mo.be[rows])  # the stage's own B ends (``stage_backward_end``), and its later ones
    be[np.arange(len(rows)), col] = 1
    lbe = be * later[:, None]
    iw = mo.iw[rows].copy()  # a W frees what its I kept
    iw[np.arange(len(rows)), col] -= mo.kind[rows] == _W
    cv = mo.cv[rows].copy()  # the accumulation in another dtype: made by the post-backwards before the end, as ``acc``
    cv[np.arange(len(rows)), col] = 1
    gk = mo.gk[rows].copy()  # the B's units, kept gathered past its end (to the next forward or the REDUCE_GRAD)
    gk[np.arange(len(rows)), col] = 1
    new = {"gk": gk, "cu": np.zeros_like(mo.cu[rows]), "sg": np.zeros_like(mo.sg[rows]), "sf": np.zeros_like(mo.sf[rows]),
           "counts": counts, "head": np.minimum(mo.head[rows], counts), "masks": masks, "acc": acc, "iw": iw, "cv": cv,
           "wr": np.zeros_like(mo.wr[rows]), "lw": np.zeros_like(mo.lw[rows]), "fs": np.zeros_like(mo.fs[rows]),
           "bi": np.zeros_like(mo.bi[rows]),
           "ig": mo.ig[rows + 1], "ho": mo.ho[rows + 1],  # what the B keeps of its sends: the next moment's
           "phase": np.full(len(rows), B_END),
           "be": be, "lbe": lbe}
    src, at = _duplicated_rows(len(mo.kind), rows)
    at = at + 1  # each B's end the second copy of its row, after it
    row = {f: x[src] for f, x in zip(Moments._fields, mo)}
    for f, x in new.items():
        row[f][at] = x
    return Moments(**row)


def _with_reduce_moment(mo: Moments) -> Moments:
    """``mo`` with the schedule's REDUCE_GRAD before its last moment (the end of the backward): a pipelined rank of one
    stage reduces its FSDP2 units after its last backward (torch's ``_add_reduce_grad``: ``perform_reduce_grad``,
    each unit's post-backward in turn), where every microbatch is freed, the accumulated unsharded gradients and the
    gathered units are all still there, and no sharded gradient yet (``reduce_grad``: the first units'
    reduce-scatters, ``engine.memory.buffers._reduce_grad``); none of the last action's own transients."""
    n = len(mo.kind) - 1  # the END row
    src, _ = _duplicated_rows(n + 1, np.array([n]))
    row = {f: x[src] for f, x in zip(Moments._fields, mo)}
    masks = row["masks"][n]
    masks[:] = 0
    for life in ("reduce_grad", "until_end_of_backward", "every_action", "after_a_backward", "after_first_weight",
                 "after_first_backward"):
        masks[TRANSIENT.index(life)] = 1
    row["red"][n] = 0
    row["phase"][n] = REDUCE
    return Moments(**row)


def input_gradient_keeper(schedule: str, pp: int, stages) -> callable:
    """Whether an action (kind, stage) of a rank holding ``stages`` makes an input gradient kept to the step's end
    (``moments``' ``ig``): an I of a later stage, and where the schedule keeps its sends (``sends_held``) a B whose
    gradient goes to another rank."""
    held = pp > 1 and sends_held(schedule) == "all"
    local = frozenset(stages)

    def keeps(kind: int, stage: int) -> bool:
        return stage > 0 and (kind == _I or (held and kind == _B and stage - 1 not in local))
    return keeps


def _with_step_moment(mo: Moments, ig_step: np.ndarray) -> Moments:
    """``mo`` with the optimizer-step moment after its last (the end of the backward): the same
    microbatches, kept outputs and stage gradients, of the transients the sharded gradients, what lives
    from the first backward on and what the step allocates; not the last unit's post-backward transients
    (the gradients stay until zero_grad, after the step). Of the kept input gradients, the I's (``ig_step``); no
    sent output."""
    sm = np.zeros((1, mo.masks.shape[1]), dtype=np.int64)
    for life in ("end_of_backward", "optimizer_step", "after_first_weight", "after_first_backward"):
        sm[0, TRANSIENT.index(life)] = 1
    row = {f: np.append(x, x[-1:], axis=0) for f, x in zip(Moments._fields, mo)}
    row["masks"] = np.append(mo.masks, sm, axis=0)
    row["wr"] = np.append(mo.wr, np.zeros_like(mo.wr[-1:]), axis=0)
    row["lw"] = np.append(mo.lw, np.zeros_like(mo.lw[-1:]), axis=0)
    row["fs"] = np.append(mo.fs, np.zeros_like(mo.fs[-1:]), axis=0)
    row["bi"] = np.append(mo.bi, np.zeros_like(mo.bi[-1:]), axis=0)
    row["fr"] = np.append(mo.fr, np.zeros_like(mo.fr[-1:]), axis=0)
    row["ig"] = np.append(mo.ig, ig_step[None, :], axis=0)
    row["ho"] = np.append(mo.ho, np.zeros_like(mo.ho[-1:]), axis=0)  # (the sent outputs: dropped with their Works)
    row["phase"] = np.append(mo.phase, STEP)
    return Moments(**row)


# --------------------------------------------------------------------------- one rank's timeline


class Signature(NamedTuple):
    """What a rank's timeline depends on, hashable: the schedule and rank, the local stages, and
    the bytes of each lifetime (per microbatch for the stages and the kept outputs)."""

    schedule: str
    pp_rank: int
    pp: int
    virtual_stages: int
    microbatches: int
    stages: tuple[int, ...]
    step_bytes: int
    unit_bytes: tuple[int, ...]  # per local stage, one microbatch
    output_bytes: int  # the last stage's kept output, one microbatch
    transient_bytes: tuple[int, ...]  # per TRANSIENT lifetime
    head_bytes: tuple[int, ...] = ()  # per local stage, one microbatch: its loss side (part of unit_bytes)
    end_freed: int = 0  # bytes of after_first_backward that the end-of-backward moment no longer holds
    iw_bytes: tuple[int, ...] = ()  # per local stage, one microbatch: what a split backward keeps from I to W
    acc_bytes: tuple[int, ...] = ()  # per local stage: its FSDP2 unsharded gradients (``STAGE_LIFETIMES``)
    red_bytes: tuple[int, ...] = ()  # per local stage: its FSDP2 sharded gradients
    step_freed: int = 0  # bytes of the step terms that the optimizer-step moment no longer holds
    wr_bytes: tuple[int, ...] = ()  # per local stage: what each of its W holds (``stage_weight``)
    # per local stage, one microbatch: the pipeline stage's output it keeps to the end of the microbatch's
    # backward (part of unit_bytes): freed after a B, or after an I (``STAGE_OUTPUT_KINDS``)
    so_bytes: tuple[int, ...] = ()
    cv_bytes: tuple[int, ...] = ()  # per local stage: FSDP2's accumulation in another dtype (``stage_converted``)
    fr_bytes: tuple[int, ...] = ()  # per local stage: a W's gradients in the parameter dtype (``stage_fresh``)
    # per local stage, one microbatch: the loss's log-probabilities (part of head_bytes) where the backward is
    # split: freed after the I, not kept to the W (``LOSS_AT_INPUT_KINDS``)
    lp_bytes: tuple[int, ...] = ()
    ig_bytes: tuple[int, ...] = ()  # per local stage, one microbatch: a split backward's input gradient (``after_input``)
    moment_only: int = 0  # bytes of ``late_backward`` no event lays (``MOMENT_ONLY_KINDS``): the events skip that moment
    ga_bytes: tuple[int, ...] = ()  # per local stage: its FSDP2 units kept gathered (``stage_gathered``)
    be_bytes: tuple[int, ...] = ()  # per local stage: at the end of each of its B (``stage_backward_end``)
    lbe_bytes: tuple[int, ...] = ()  # per local stage: at the end of each of its B but the first
    lw_bytes: tuple[int, ...] = ()  # per local stage: at each of its W but the first (``stage_later_weight``)
    fs_bytes: tuple[int, ...] = ()  # per local stage: at each of its W that starts a run of ``fr`` (``stage_fresh_start``)
    bi_bytes: tuple[int, ...] = ()  # per local stage: at each of its B and I (``stage_backward_action``)
    ho_bytes: tuple[int, ...] = ()  # per local stage, one microbatch: its output sent and held (``after_output``)
    gk_bytes: tuple[int, ...] = ()  # per local stage: its units kept gathered since its last backward (``stage_kept``)
    cu_bytes: tuple[int, ...] = ()  # per local stage: its root and current block units (``stage_current``)
    sg_bytes: tuple[int, ...] = ()  # per local stage: its next block's all-gather output (``stage_gathering``)
    sf_bytes: tuple[int, ...] = ()  # per local stage: its next unit's, in a forward (``stage_forward_gathering``)


@lru_cache(maxsize=256)
def _splits_backward(schedule: str, pp: int, microbatches: int, virtual_stages: int) -> bool:
    """The pipeline runs split backwards (I, W): only then does the last stage's output go before its
    stage-microbatch (``STAGE_OUTPUT_KINDS``); a full B frees both together."""
    return pp > 1 and pipeline_actions(schedule, pp, microbatches, virtual_stages).splits_backward


class Peak(NamedTuple):
    """The peak moment of a rank's step: its index, live tracked bytes, and what is alive then."""

    moment: int
    bytes: int
    counts: tuple[int, ...]  # stage-microbatches alive per local stage
    outputs: int  # kept outputs of the last stage
    alive: tuple[bool, ...]  # per TRANSIENT lifetime
    kind: str  # the action at the peak (F, B, I, W)
    stage: int
    microbatch: int
    head: tuple[int, ...] = ()  # stage-microbatches whose loss side is alive, per local stage
    phase: int = 0  # ACTION, LOSS, END or STEP
    iw: tuple[int, ...] = ()  # stage-microbatches between their I and W, per local stage
    acc: tuple[int, ...] = ()  # per local stage: its unsharded gradients alive (1) or not (0)
    red: tuple[int, ...] = ()  # per local stage: its sharded gradients alive
    wr: tuple[int, ...] = ()  # per local stage: the moment is one of its W (1) or not (0)
    cv: tuple[int, ...] = ()  # per local stage: its accumulation in another dtype alive
    fr: tuple[int, ...] = ()  # per local stage: a W's gradients in the parameter dtype alive
    ig: tuple[int, ...] = ()  # per local stage: its input gradients kept (the I's run by then)
    ga: tuple[int, ...] = ()  # per local stage: its units kept gathered
    be: tuple[int, ...] = ()  # per local stage: the moment is the end of one of its B
    lbe: tuple[int, ...] = ()  # per local stage: the moment is the end of one of its B but the first
    lw: tuple[int, ...] = ()  # per local stage: the moment is one of its W but the first
    fs: tuple[int, ...] = ()  # per local stage: the moment is one of its W that makes its .grad afresh
    bi: tuple[int, ...] = ()  # per local stage: the moment is one of its B or I
    ho: tuple[int, ...] = ()  # per local stage: its sent outputs held past their backward
    gk: tuple[int, ...] = ()  # per local stage: its units kept gathered since its last backward
    cu: tuple[int, ...] = ()  # per local stage: the moment is one of its actions that gathers its current unit
    sg: tuple[int, ...] = ()  # per local stage: the moment is one of its B, I or W right after a forward
    sf: tuple[int, ...] = ()  # per local stage: the moment is one of its F not right after a backward


#: the optimizer step's transient among a signature's ``transient_bytes``
_OPTIMIZER_STEP = TRANSIENT.index("optimizer_step")


@lru_cache(maxsize=4096)
def peak_of(sig: Signature) -> Peak:
    """The first moment with the most live tracked bytes (cached on the signature). The bytes at every moment
    but the all-step ones and the optimizer step's are computed once for the ranks that differ only in those
    (a dp share's optimizer states: ``engine.memory.per_rank``)."""
    mo = sig_moments(sig)
    tb = sig.transient_bytes
    opt = tb[_OPTIMIZER_STEP] if len(tb) > _OPTIMIZER_STEP else 0
    live = _live_bytes(sig._replace(step_bytes=0, transient_bytes=tb[:_OPTIMIZER_STEP] + (0,) + tb[_OPTIMIZER_STEP + 1:])
                       if opt or sig.step_bytes else sig)
    if opt:
        live = live + mo.masks[:, _OPTIMIZER_STEP].astype(np.int64) * opt
    return _peak_at(sig, mo, live, int(np.argmax(live)))


def _peak_at(sig: Signature, mo: Moments, live: np.ndarray, i: int) -> Peak:
    """Moment ``i`` of ``sig`` as a :class:`Peak` (``live``: the live bytes at every moment but the all-step ones)."""
    return Peak(i, int(live[i]) + sig.step_bytes, tuple(mo.counts[i].tolist()), int(mo.outputs[i]),
                tuple(bool(x) for x in mo.masks[i]), ACTION_KINDS[int(mo.kind[i])], int(mo.stage[i]),
                int(mo.microbatch[i]), tuple(mo.head[i].tolist()), int(mo.phase[i]), tuple(mo.iw[i].tolist()),
                tuple(mo.acc[i].tolist()), tuple(mo.red[i].tolist()), tuple(mo.wr[i].tolist()),
                tuple(mo.cv[i].tolist()), tuple(mo.fr[i].tolist()), tuple(mo.ig[i].tolist()), tuple(mo.ga[i].tolist()),
                tuple(mo.be[i].tolist()), tuple(mo.lbe[i].tolist()), tuple(mo.lw[i].tolist()),
                tuple(mo.fs[i].tolist()), tuple(mo.bi[i].tolist()), tuple(mo.ho[i].tolist()), tuple(mo.gk[i].tolist()),
                tuple(mo.cu[i].tolist()), tuple(mo.sg[i].tolist()),
                tuple(mo.sf[i].tolist()))


@lru_cache(maxsize=256)
def _live_bytes(sig: Signature) -> np.ndarray:
    """The live tracked bytes at every moment of ``sig`` but its all-step bytes (``peak_of``; not to be changed
    in place: cached)."""
    mo = sig_moments(sig)
    head = sig.head_bytes or (0,) * len(sig.unit_bytes)
    body = tuple(u - h for u, h in zip(sig.unit_bytes, head))
    iwb = sig.iw_bytes or (0,) * len(sig.unit_bytes)
    if sig.so_bytes:  # the stage output is freed after the I: a stage-microbatch between I and W no longer holds it
        iwb = tuple(x - so for x, so in zip(iwb, sig.so_bytes))
    if sig.lp_bytes:  # and so are the loss's log-probabilities
        iwb = tuple(x - lp for x, lp in zip(iwb, sig.lp_bytes))
    none = (0,) * len(sig.unit_bytes)
    w = (body + head + iwb + (sig.acc_bytes or none) + (sig.red_bytes or none) + (sig.wr_bytes or none)
         + (sig.cv_bytes or none) + (sig.fr_bytes or none) + (sig.ig_bytes or none) + (sig.ga_bytes or none)
         + (sig.be_bytes or none) + (sig.lbe_bytes or none) + (sig.lw_bytes or none) + (sig.fs_bytes or none)
         + (sig.bi_bytes or none) + (sig.ho_bytes or none) + (sig.gk_bytes or none) + (sig.cu_bytes or none)
         + (sig.sg_bytes or none) + (sig.sf_bytes or none)
         + (sig.output_bytes,) + sig.transient_bytes)
    # bytes past a TiB a term (sums of them could pass int64 at absurd sizes): Python integers, exact
    big = max(map(abs, w), default=0) > 2**40
    live = mo.matrix @ np.array(w, dtype=object if big else np.int64)
    if sig.end_freed:
        live = live - np.where((mo.phase == END) | (mo.phase == STEP), sig.end_freed, 0)
    if sig.step_freed:
        live = live - np.where(mo.phase == STEP, sig.step_freed, 0)
    return live


class _Laid:
    """What a rank's terms of ``categories`` put on each lifetime (``RankTimeline``'s signature, its event rows):
    per local stage the stage-microbatch bytes (``unit``; of them ``acts``: blocks, log-probabilities, the rest of
    the loss side), what an I keeps for its W, the per-stage lifetimes' bytes, the transients', the step's."""

    __slots__ = ("unit", "acts", "iw", "ig", "ho", "so", "stage_grads", "trans", "step", "out", "end_freed", "step_freed",
                 "varying", "rows", "freed", "moment_only")

    def __init__(self, terms: dict[str, list[Term]], categories, column: dict[int, int], pp: int, rules: dict,
                 fsdp_params: str):
        v = len(column)
        self.unit = unit = [0] * v
        self.acts = acts = [[0, 0, 0] for _ in range(v)]
        self.iw = iw = [0] * v
        self.ig = ig = [0] * v
        self.ho = ho = [0] * v
        self.so = so = [0] * v
        self.stage_grads = stage_grads = {life: [0] * v for life in STAGE_LIFETIMES}
        self.trans = trans = dict.fromkeys(TRANSIENT, 0)
        step = out = end_freed = step_freed = moment_only = 0
        self.varying = varying = {}  # category -> (index, lifetime) of the terms not alive all step
        self.rows = rows = []  # (lifetime, bytes, stream) of the blocks not per stage-microbatch, for the events
        self.freed = freed = {}  # per transient lifetime (or per-stage row key), what its negative terms free
        add_row = rows.append
        gather = ALL_GATHER_STREAM_KINDS
        grad_piece = getattr(terms, "grad_piece", 0)
        cp_pieces = getattr(terms, "cp_pieces", ())
        grad_whole = getattr(terms, "plain_grad_whole", 0)
        for c in categories:
            var = []
            acts_c = c == "activations"
            for i, (_, nbytes, _, _, tracked, stage, n, kind) in enumerate(terms[c]):
                if not tracked:
                    continue
                if kind in INPUT_TO_WEIGHT_KINDS and stage is not None:
                    if n:
                        iw[column[stage if pp > 1 else 0]] += nbytes // n
                    var.append((i, "input_to_weight"))
                    continue
                if kind in INPUT_GRADIENT_KINDS and stage is not None:
                    if n:
                        ig[column[stage if pp > 1 else 0]] += nbytes // n
                    var.append((i, "after_input"))
                    continue
                if kind in OUTPUT_SENT_KINDS and stage is not None:
                    if n:
                        ho[column[stage if pp > 1 else 0]] += nbytes // n
                    var.append((i, "after_output"))
                    continue
                if acts_c and n is not None and stage is not None and kind != "pipeline_outputs":
                    if n:
                        col = column[stage if pp > 1 else 0]
                        unit[col] += nbytes // n
                        if kind in BLOCK_KINDS:
                            acts[col][0] += nbytes // n
                        elif kind == "log_probabilities":
                            acts[col][1] += nbytes // n
                        elif kind in HEAD_KINDS:
                            acts[col][2] += nbytes // n
                        elif kind in FREED_AT_INPUT_KINDS:
                            so[col] += nbytes // n
                    var.append((i, "microbatch"))
                    continue
                life = fsdp_params if kind == "fsdp_unsharded_params" else rules.get(kind, "step")
                if life in STAGE_LIFETIMES and stage is not None:
                    col = column[stage if pp > 1 else 0]
                    stage_grads[life][col] += nbytes
                    var.append((i, life))
                    if nbytes > 0:
                        add_row(((_STAGE_TAG[life], col), nbytes, ALL_GATHER_STREAM if kind in gather
                                 else REDUCE_SCATTER_STREAM if kind in REDUCE_SCATTER_STREAM_KINDS else 0))
                    elif nbytes < 0 and kind not in MOMENT_ONLY_STAGE_KINDS:  # taken off that stage's blocks of the
                        # same lifetime (``_net_rows``)
                        freed[(_STAGE_TAG[life], col)] = freed.get((_STAGE_TAG[life], col), 0) - nbytes
                    continue
                if life in STAGE_LIFETIMES:  # a rank-wide term of a per-stage kind: from the first backward
                    life = "after_first_backward"
                if life == "step":
                    step += nbytes
                    if kind in STEP_FREED_KINDS:
                        step_freed += nbytes
                        var.append((i, life))
                else:
                    if life == "to_step_end":
                        nbytes = nbytes // n if n else 0
                        out += nbytes
                    else:
                        trans[life] += nbytes
                    var.append((i, life))
                freed_at_end = life == "after_first_backward" and kind in END_FREED_KINDS
                end_freed += nbytes if freed_at_end else 0
                if kind in MOMENT_ONLY_KINDS:  # the events lay these tensors otherwise (the walk's gradients)
                    moment_only += nbytes if life == "late_backward" else 0
                elif nbytes > 0 and kind in UNIT_MADE_KINDS:
                    add_row((_UNIT_MADE, nbytes, 0))
                elif nbytes > 0 and kind == "fsdp_root_end":
                    add_row((_ROOT_END, nbytes, 0))
                elif nbytes > 0:
                    # (autocast's casts: alive all step but at the optimizer step, freed before the events lay it)
                    row_life = (("accumulated_whole" if kind in WHOLE_KINDS else "accumulated") if freed_at_end
                                else "until_step" if life == "step" and kind in STEP_FREED_KINDS else life)
                    stream = (ALL_GATHER_STREAM if kind in gather
                              else REDUCE_SCATTER_STREAM if kind in REDUCE_SCATTER_STREAM_KINDS else 0)
                    # tensor by tensor where torch allocates several: FSDP2's sharded gradients a unit's reduce-scatter
                    # output at a time (``Terms.grad_piece``), the CP attention's backward workspace (``cp_pieces``)
                    if kind == "cp_attention" and cp_pieces:
                        parts = cp_pieces
                    elif grad_piece and c == "grads" and kind in SHARDED_GRAD_KINDS:
                        parts = [grad_piece] * (nbytes // grad_piece) + ([nbytes % grad_piece] if nbytes % grad_piece else [])
                    else:
                        parts = (nbytes,)
                    if grad_whole and kind == "gradients" and row_life == "after_first_backward" and nbytes > grad_whole:
                        add_row((row_life, nbytes - grad_whole, stream))  # the blocks' (and the head's), a piece a block
                        add_row((LATE_WHOLE, grad_whole, stream))  # the last node's: one tensor, after them
                        continue
                    for x in parts:
                        add_row((row_life, x, stream))
                    if kind in UNIT_FRESH_KINDS:  # and, for the events only, in each block of a B's walk
                        add_row((_UNIT_FRESH, nbytes, 0))
                elif nbytes < 0:
                    freed[life] = freed.get(life, 0) - nbytes
            if var:
                varying[c] = var
        self.step, self.out, self.end_freed, self.step_freed = step, out, end_freed, step_freed
        self.moment_only = moment_only


class RankTimeline:
    """One rank's terms with their lifetimes over its step: the peak and its snapshot, the events.

    ``terms``: every term the modules produced, by category (the catalogue); ``stages``: the
    rank's global stage indices in local order; ``fsdp_params``: the lifetime of FSDP2's unsharded
    parameters (``fsdp_params_lifetime``); ``overrides``: kind -> lifetime where the wrapping plan
    changes a kind's rule (``lifetime_overrides``).
    """

    __slots__ = ("terms", "signature", "varying", "_column", "_rows", "_grain", "_acts", "_laying", "_category_peaks")

    def __init__(self, terms: dict[str, list[Term]], *, schedule: str, pp_rank: int, pp: int, virtual_stages: int,
                 microbatches: int, stages: tuple[int, ...], fsdp_params: str = "step",
                 overrides: dict[str, str] | None = None, grain: Grain | None = None):
        self.terms = terms
        self._grain = grain
        local = tuple(sorted(stages)) if pp > 1 else (0,)
        column = self._column = {s: j for j, s in enumerate(local)}
        rules = {**LIFETIMES, **overrides} if overrides else LIFETIMES
        self._laying = (schedule, pp_rank, pp, virtual_stages, microbatches, stages, local, fsdp_params, rules)
        laid = _Laid(terms, MEMORY_CATEGORIES, column, pp, rules, fsdp_params)
        self.varying = laid.varying
        self._rows = _net_rows(laid.rows, laid.freed)
        # (and the stage's kept output, the logits on a pipeline's last stage: ``_Laying._forward``)
        self._acts = tuple(tuple(x) + (laid.so[k],) for k, x in enumerate(laid.acts))
        self.signature = self._signature(laid)
        self._category_peaks: dict[str, int] | None = None  # computed when first asked (a tooltip asks per move)

    def _signature(self, laid: _Laid) -> Signature:
        schedule, pp_rank, pp, virtual_stages, microbatches, stages, local, _, _ = self._laying
        head = tuple(a[1] + a[2] for a in laid.acts)  # the loss side (part of unit)
        lp = tuple(a[1] for a in laid.acts)  # of it the log-probabilities
        splits = _splits_backward(schedule, pp, microbatches, virtual_stages)
        acc, red, wr, cv, fr, ga, be, lbe, lw, fs, bi, gk, cu, sg, sf = (tuple(laid.stage_grads[k])
                                                                         for k in STAGE_LIFETIMES)
        return Signature(schedule, pp_rank if pp > 1 else 0, pp, virtual_stages if pp > 1 else 1, microbatches,
                         local if pp > 1 else tuple(stages), laid.step, tuple(laid.unit), laid.out,
                         tuple(laid.trans[k] for k in TRANSIENT), head if any(head) else (), laid.end_freed,
                         tuple(laid.iw) if any(laid.iw) else (), acc if any(acc) else (), red if any(red) else (),
                         laid.step_freed, wr if any(wr) else (),
                         tuple(laid.so) if any(laid.so) and splits else (), cv if any(cv) else (), fr if any(fr) else (),
                         lp if any(lp) and splits else (), tuple(laid.ig) if any(laid.ig) else (), laid.moment_only,
                         ga if any(ga) else (), be if any(be) else (), lbe if any(lbe) else (),
                         lw if any(lw) else (), fs if any(fs) else (), bi if any(bi) else (),
                         tuple(laid.ho) if any(laid.ho) else (), gk if any(gk) else (),
                         cu if any(cu) else (), sg if any(sg) else (), sf if any(sf) else ())

    def category_peaks(self) -> dict[str, int]:
        """Each category's most tracked bytes at any moment of the step, laid alone: what the rank holds of it
        at that category's own worst moment, which may be another moment than the rank's peak (the snapshot
        there can show a category at 0 that the step fills elsewhere: ZeRO-3's activations at an optimizer-
        step peak). Untracked overhead (no tensor: the runtime context, collective buffers) as the snapshot."""
        if self._category_peaks is None:
            _, _, pp, _, _, _, _, fsdp_params, rules = self._laying
            out = {}
            for c in MEMORY_CATEGORIES:
                laid = _Laid(self.terms, (c,), self._column, pp, rules, fsdp_params)
                tracked = peak_of(self._signature(laid)).bytes
                untracked = sum(t.bytes for t in self.terms[c] if not t.tracked)
                out[c] = max(0, tracked) + untracked
            self._category_peaks = out
        return dict(self._category_peaks)

    @property
    def peak(self) -> Peak:
        return peak_of(self.signature)

    def lifetime(self, category: str, index: int) -> str:
        """The lifetime of ``terms[category][index]`` ("untracked" for the overhead terms that are not tensors)."""
        t = self.terms[category][index]
        if not t.tracked:
            return "untracked"
        return dict(self.varying.get(category, ())).get(index, "step")

    def _without_optimizer_step(self) -> Signature:
        t = self.signature.transient_bytes
        return self.signature._replace(transient_bytes=t[:_OPTIMIZER_STEP] + (0,) + t[_OPTIMIZER_STEP + 1:])

    @property
    def peak_before_step(self) -> Peak:
        """The peak of the moments up to the end of the backward (the optimizer step left out)."""
        return peak_of(self._without_optimizer_step())

    def peak_in_phase(self, phase: int) -> Peak | None:
        """The first moment of ``phase`` (``LOSS``, ...) with the most live tracked bytes, the optimizer step's
        transient left out; None where the step has no such moment."""
        sig = self._without_optimizer_step()
        mo = sig_moments(sig)
        at = np.flatnonzero(mo.phase == phase)
        if not at.size:
            return None
        live = _live_bytes(sig)
        return _peak_at(sig, mo, live, int(at[np.argmax(live[at])]))

    def snapshot(self, pk: Peak | None = None) -> dict[str, list[Term]]:
        """The terms alive at the peak (or at moment ``pk``), by category (per-microbatch terms at the
        count alive then; the terms alive all step and the untracked overhead terms always)."""
        pk = pk or self.peak
        alive = dict(zip(TRANSIENT, pk.alive))
        pp = self.signature.pp
        at_end = pk.phase in (END, STEP)
        out: dict[str, list[Term]] = {}
        for c in MEMORY_CATEGORIES:
            terms = self.terms[c]
            var = self.varying.get(c)
            if not var:
                out[c] = terms
                continue
            drop: dict[int, Term | None] = {}
            for i, life in var:
                t = terms[i]
                if life == "input_to_weight" or life == "after_input" or life == "after_output":
                    k = ((pk.iw if life == "input_to_weight" else pk.ig if life == "after_input" else pk.ho)
                         or (0,) * len(self._column))[
                        self._column[t.stage if pp > 1 else 0]]
                    n = t.in_flight or 0
                    if k != n:
                        drop[i] = _rescaled(t, k, n) if k and n else None
                elif life == "microbatch" or life == "to_step_end":
                    col = self._column[t.stage if pp > 1 else 0] if life == "microbatch" else 0
                    k = ((pk.head[col] - (pk.iw[col] if pk.iw and self.signature.lp_bytes else 0)
                          if t.kind in LOSS_AT_INPUT_KINDS and pk.head
                          else pk.head[col] if t.kind in HEAD_KINDS and pk.head
                          else pk.counts[col] - (pk.iw[col] if pk.iw else 0) if t.kind in FREED_AT_INPUT_KINDS
                          else pk.counts[col])
                         if life == "microbatch" else pk.outputs)
                    n = t.in_flight or 0
                    if k != n:  # a stage's blocks stay listed with none alive (its other terms go)
                        drop[i] = _rescaled(t, k, n) if n and (k or t.kind == "layers") else None
                elif life in STAGE_LIFETIMES:
                    on = getattr(pk, _STAGE_TAG[life])
                    if not (on and on[self._column[t.stage if pp > 1 else 0]]):
                        drop[i] = None
                elif life == "step":
                    if pk.phase == STEP and t.kind in STEP_FREED_KINDS:
                        drop[i] = None
                elif not alive[life] or (at_end and life == "after_first_backward" and t.kind in END_FREED_KINDS):
                    drop[i] = None
            row = [drop.get(i, t) for i, t in enumerate(terms)] if drop else terms
            if drop:
                row = [t for t in row if t is not None]
            if not row:
                row = [Term(f"nothing of this category alive at the peak ({self.peak_moment(pk)})", 0, "0", c,
                            kind="none")]
            out[c] = row
        return out

    def peak_moment(self, pk: Peak | None = None) -> str:
        """The peak moment (or moment ``pk``) in words: "stage 3 B of microbatch 2 (action 17 of 40)", or
        "stage 7 B of microbatch 0, at its start: the loss (action 9 of 64)" at a loss moment."""
        pk, sig = pk or self.peak, self.signature
        mo = sig_moments(sig)
        extra = mo.phase != ACTION
        n = int(len(mo.kind) - extra.sum())
        action = int(pk.moment - extra[:pk.moment].sum()) + 1  # the loss and end moments are not actions
        if mo.phase[pk.moment] == STEP:
            return f"the optimizer step, after stage {pk.stage} {pk.kind} of microbatch {pk.microbatch} " \
                   f"(action {action - 1} of {n})"
        if mo.phase[pk.moment] == END:
            return f"the end of the backward, after stage {pk.stage} {pk.kind} of microbatch {pk.microbatch} " \
                   f"(action {action - 1} of {n})"
        if mo.phase[pk.moment] == REDUCE:
            return f"the schedule's REDUCE_GRAD after stage {pk.stage} {pk.kind} of microbatch {pk.microbatch}: its " \
                   f"first units' reduce-scatters (action {action - 1} of {n})"
        if mo.phase[pk.moment] == B_END:
            return f"the end of stage {pk.stage} B of microbatch {pk.microbatch}, its microbatch freed " \
                   f"(action {action - 1} of {n})"
        if mo.phase[pk.moment] == LATE:
            made = "made" if self.signature.moment_only else "reduced"  # plain gradients, or FSDP2's reduced
            return f"late in stage {pk.stage} {pk.kind} of microbatch {pk.microbatch}: near its last block, every " \
                   f"later block's gradient {made} (action {action - 1} of {n})"
        at = ", at its start: the loss" if mo.phase[pk.moment] == LOSS else ""
        return f"stage {pk.stage} {pk.kind} of microbatch {pk.microbatch}{at} (action {action} of {n})"

    def events(self) -> tuple:
        """The step's allocation events for ``engine.memory.allocator.replay``."""
        return allocation_events(self._event_signature())

    def _event_signature(self) -> tuple:
        """Hashable: the timeline's signature plus the (lifetime, bytes, stream) of every tracked block
        not per stage-microbatch (one microbatch's for the kept outputs), and with a :class:`Grain` the
        grain and the blocks' and log-probabilities' bytes per local stage: identical ranks share one replay.

        With the optimizer step's temporaries (``optimizer_step``) where the grain lays them tensor by tensor
        (``Grain.step``: AdamW on a GPU rank, one per parameter, after every activation is freed, served from
        what the backward left cached or from new segments); else without them, the events ending with the
        backward: a ZeroRedundancyOptimizer's share (every dp-rank's differs, and each would replay on its own;
        a dp-th of the states) and the CPU's ranks (no replay). The reserve is never below the allocated peak
        (``overhead.reserved_bytes``), which holds them."""
        sig, rows = self.signature, self._rows
        k = TRANSIENT.index("optimizer_step")
        if sig.transient_bytes[k] and not (self._grain is not None and self._grain.step):
            t = sig.transient_bytes
            sig = sig._replace(transient_bytes=t[:k] + (0,) + t[k + 1:])
            rows = tuple(r for r in rows if r[0] != "optimizer_step")
        if self._grain is None:
            return sig, rows
        return sig, rows, self._grain, self._acts


def _net_rows(rows: list, freed: dict[str, int]) -> tuple:
    """The event rows with what a lifetime's negative terms free (a saved tensor freed while its
    transients are alive: the down input of the first block's MLP backward, the MoE backward's)
    taken off that lifetime's own blocks, largest first: the events then allocate what the moment
    holds net, and their replay peaks at the timeline's peak."""
    if not freed:
        return tuple(rows)
    out = list(rows)
    of_life: dict[str, list[int]] = {}
    for j, r in enumerate(out):
        if r[0] in freed:
            of_life.setdefault(r[0], []).append(j)
    for life, n in freed.items():
        for j in sorted(of_life.get(life, ()), key=lambda j: -out[j][1]):
            take = min(n, out[j][1])
            out[j] = (life, out[j][1] - take, out[j][2])
            n -= take
            if not n:
                break
    return tuple(r for r in out if r[1] > 0)


def _rescaled(t: Term, k: int, n: int) -> Term:
    """A per-microbatch term at k of its n microbatches (its bytes are n × the bytes of one)."""
    one = t.bytes // n
    was = f"{n} microbatch{'es' if n != 1 else ''} in flight"
    now = f"{k} microbatch{'es' if k != 1 else ''} alive at the peak (of {n} in flight at most)"
    label = t.label.replace(was, now) if was in t.label else f"{t.label} — {k} of {n} microbatches alive at the peak"
    return t._replace(label=label, bytes=k * one, formula=f"{k} × {one:,} B (of {t.formula})", in_flight=k)


class Grain(NamedTuple):
    """What the allocation events lay block by block (``allocation_events``), from the activation table
    and the head: the sizes one block's forward saves (in order; the per-rank model gives them as one
    piece) and the transient tensors it makes (in order; the per-rank model gives its two largest), the
    blocks of each local stage, and the head's output (the logits) in the compute dtype before the loss
    casts it to fp32 (0: the logits are fp32 already, no cast). Under tensor parallelism without
    loss_parallel the head's vocabulary-sharded output reaches the loss through DTensor's
    Shard(-1) → Replicate: ``funcol.all_gather_single(gather_dim=2)`` gathers along dim 0 and, the
    sequence lying between dim 0 and the vocabulary, copies the result into place
    (``torch._utils._maybe_view_chunk_cat``: a view only when every dim before the gather dim is 1), so
    the local shard (``head_shard``), the gathered buffer (``head_gather``) and the copy, the logits,
    are alive at once before the buffer is freed (0, 0: no such redistribution)."""

    kept: tuple[int, ...]  # what one block saves, one microbatch, in forward order (proportions)
    work: tuple[int, ...]  # tensors one block's forward makes, one microbatch, in order
    blocks: tuple[int, ...]  # blocks per local stage
    logits_bytes: int  # the last stage's logits in the compute dtype, one microbatch (0: no fp32 cast)
    loss_piece: int = 0  # one fp32 tensor of the loss's vocabulary shard, one microbatch (0: not known)
    head_shard: int = 0  # the head's local output under TP without loss_parallel, one microbatch
    head_gather: int = 0  # its all-gather's dim-0 output, the whole vocabulary, one microbatch
    step: tuple = ()  # what the optimizer step allocates tensor by tensor (``Terms.optimizer_step``); () none
    # FSDP2's root post-backward (``Terms.root_end``): its reduce-scatter input's bytes, the gathered root's, whether
    # the copy-in is the end's largest side; (): none
    root_end: tuple = ()
    # per local stage, the tensors a split backward's I keeps for its W, in order (``Terms.split_backward_pieces``);
    # (): one piece
    iw_pieces: tuple = ()
    reduce_gross: int = 0  # the REDUCE_GRAD moment's whole reduce-scatter input (``Terms.reduce_gross``); 0: the net
    # per local stage, the tensors of what its stage-microbatch frees at an I's end (``FREED_AT_INPUT_KINDS``) beyond
    # the kept logits, in order (``Terms.freed_at_input_pieces``); (): one piece
    so_pieces: tuple = ()
    # a recomputed block's (``backward_input``) pieces: (size,) pieces of that size where its tensors are not the
    # dense block's (a block with experts); (): in proportion to ``work``
    recomputed: tuple = ()
    # FSDP2's root all-gather output, on the all-gather stream, kept to the first block's copy-out beside the root's
    # parameters copied out of it (``Terms.root_gather``); 0: none laid
    root_gather: int = 0
    # per local stage, the pieces its weight pass is laid in where they are not a block's (``Terms.weight_pass_piece``;
    # 0 or (): a block's)
    wp_piece: tuple = ()
    # the largest tensor of an I's own transients (``Terms.input_backward_piece``); 0: laid whole
    ib_piece: int = 0
    # the largest tensor of eager float8's casts (``Terms.float8_piece``): a forward's or full backward's rows laid in
    # pieces no larger; 0: laid whole
    f8_piece: int = 0


def _pieces(total: int, weights: tuple[int, ...]) -> list[int]:
    """``total`` bytes split in proportion to ``weights`` (the last piece takes the rounding): exact sum."""
    w = sum(weights)
    if total <= 0:
        return [0] * len(weights)
    if w <= 0 or len(weights) < 2:
        return [total] + [0] * (len(weights) - 1)
    out = [total * x // w for x in weights[:-1]]
    out.append(total - sum(out))
    return out


def _forward_walk(kept: tuple[int, ...], work: tuple[int, ...]) -> list[tuple[bool, int]]:
    """One block's forward as (saved, index): the tensors it makes in order, each either saved (the
    ``index``-th kept tensor: matched to the next made tensor of its size) or a transient (``index``
    into ``work``); kept tensors no made tensor matches come last."""
    walk, k = [], 0
    for i, x in enumerate(work):
        if k < len(kept) and kept[k] == x:
            walk.append((True, k))
            k += 1
        else:
            walk.append((False, i))
    walk.extend((True, j) for j in range(k, len(kept)))
    return walk


#: the most pieces a W's weight-pass recomputes are laid in (``_Laying.moment``): a recompute holds a block's saved
#: tensors, one per group and block, so a big stage's pass is thousands of tensors; pieces of a block's largest
#: tensor's size, or larger, keep the replay's cost bounded whatever the pass's bytes
WEIGHT_PASS_PIECES = 64


class Events(tuple):
    """Allocation events, and the most bytes they hold live at once (``most_live``): what any replay of them
    allocates at least (a block is at least its request)."""

    most_live: int = 0


def laid_most_live(event_signature: tuple) -> int:
    """The most bytes ``replay_events(event_signature)`` holds live at once (its cycles' periods counted):
    a lower bound of the replay's most allocated, known without the allocator."""
    sig, rows = event_signature[:2]
    if len(event_signature) > 2 and event_signature[2] is not None:
        if any(life == "step" for life, _, _ in rows):  # laid first and never freed (``replay_events``)
            steps = sum(n for life, n, _ in rows if life == "step" and n > 0)
            return steps + laid_most_live(without_step_rows(event_signature))
        return replay_events(event_signature).most_live
    return most_live(allocation_events(event_signature))


def most_live(events) -> int:
    """The most bytes plain ``("alloc", key, n[, stream])`` / ``("free", key)`` events hold live at once."""
    live = most = 0
    size: dict = {}
    for ev in events:
        if ev[0] == "alloc":
            size[ev[1]] = ev[2]
            live += ev[2]
            most = max(most, live)
        else:
            live -= size.pop(ev[1])
    return most


@lru_cache(maxsize=1024)
def allocation_events(event_signature: tuple) -> tuple:
    """The allocation events of one step (see the module docstring), from a rank's event signature.

    Step terms are allocated first (they persist); then, per action: an F allocates the transients
    of its moment, its stage-microbatch's activations and, on the last stage, the kept output, then
    frees the transients; a B, I or W allocates its transients (the lifetime from the first backward
    on at the first one, never freed before the step's end), then frees them, and a B or W its
    stage-microbatch. The step ends freeing what is left but the step terms.

    With a :class:`Grain` (the signature's third field) the activations and the backward go block by
    block, as the training loop allocates them: each block's forward makes its tensors in order,
    the saved ones kept, each transient freed once the two tensors after it are made; the last stage's
    forward makes the logits, their fp32 copy and the log-probabilities it saves, then frees the two
    first; the loss moment allocates the fp32 logits' gradient and the log-softmax gradient, frees the
    first and the saved log-probabilities, makes the logits' gradient in the compute dtype and frees the
    second; a B walks its blocks last to first: the recomputed block, the unit's backward transients
    (its fresh gradient, the reduce-scatter input), then frees them and the block's saved tensors, and
    in the rank's first backward allocates its share of what lives from the first backward on once
    the freed tensors cover it. The forward's transients and the logits' casts are not terms (a
    moment does not hold them): they are laid only where the live bytes stay within the rank's peak,
    so the events' most live bytes are the peak's. Where the grain carries the optimizer step's tensors
    (``Grain.step``) the end of the backward keeps the last unit's sharded gradients, and the step frees
    autocast's cached casts and allocates its tensors one by one (``_Laying._optimizer_step``).
    """
    sig, rows = event_signature[:2]
    grain: Grain | None = event_signature[2] if len(event_signature) > 2 else None
    if grain is not None:
        return _fine_events(sig, rows, event_signature[3], grain)
    return _coarse_events(sig, rows)


@lru_cache(maxsize=1024)
def replay_events(event_signature: tuple) -> tuple:
    """``allocation_events`` as the allocator replays them: with a :class:`Grain`, the rank's steady
    state (the periods of microbatches that repeat one another up to a microbatch shift) is one
    ``("cycle", chunk, count, shift, keys)`` event (see ``_fine_events``;
    ``engine.memory.allocator.replay`` skips the periods once the allocator loops, which is exact).
    Otherwise the events themselves."""
    sig, rows = event_signature[:2]
    if len(event_signature) > 2 and event_signature[2] is not None:
        if not any(life == "step" for life, _, _ in rows):
            return _fine_events(sig, rows, event_signature[3], event_signature[2], compress=True)
        # the step tensors come first and are never freed, and the peak is the step bytes plus a moment
        # whose choice does not depend on them (``peak_of``), so the room every event-only transient is
        # given does not either: the rest is laid once for ranks that differ only in step tensors (the
        # dp-ranks' ZeroRedundancyOptimizer shares) and the step tensors put before it
        steps = tuple(("alloc", ("step", j), n, stream) if stream else ("alloc", ("step", j), n)
                      for j, (life, n, stream) in enumerate(rows) if life == "step")
        return steps + replay_events(without_step_rows(event_signature))
    return allocation_events(event_signature)


@lru_cache(maxsize=256)
def _moment_classes(schedule: str, pp: int, virtual_stages: int,
                    microbatches: int) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """Per pp rank, the least pp rank (and its stages) whose step is its own with its local stages renamed in order:
    the same moments (actions, microbatches, phases, transient masks, what is alive of each local
    stage) and its last stage (if it holds it) at the same local place.

    The events (``_coarse_events``, ``_fine_events``) read a rank only through its moments, its local
    stage order and which local stage is the last; its global stage numbers appear only inside keys
    (a renaming the allocator does not see). So two such ranks with the same bytes lay the same
    events up to their keys' names, and replay alike: under GPipe or LoopedBFS every middle stage
    runs the same actions (all forwards, then all backwards), and one replay serves all of them."""
    last_stage = pp * virtual_stages - 1
    least: dict[tuple, tuple[int, tuple[int, ...]]] = {}
    out = []
    for r in range(pp):
        mo = moments(schedule, r, pp, virtual_stages, microbatches)
        stages = np.unique(mo.stage)
        local = np.searchsorted(stages, mo.stage)
        key = (tuple(stages == last_stage), local.tobytes(),
               *((x.shape, x.tobytes()) for f, x in zip(Moments._fields, mo) if f != "stage"))
        out.append(least.setdefault(key, (r, tuple(stages.tolist()))))
    return tuple(out)


def canonical_event_signature(event_signature: tuple) -> tuple:
    """``event_signature`` as the least pp rank whose events are this rank's up to their keys' names
    (``_moment_classes``) would have it: the key its replays are cached on, so such ranks replay once."""
    sig = event_signature[0]
    if sig.pp <= 1:
        return event_signature
    r, stages = _moment_classes(sig.schedule, sig.pp, sig.virtual_stages, sig.microbatches)[sig.pp_rank]
    if r == sig.pp_rank:
        return event_signature
    return (sig._replace(pp_rank=r, stages=stages),) + tuple(event_signature[1:])


def without_step_rows(event_signature: tuple) -> tuple:
    """The event signature of what a rank allocates after its step tensors (which come first, are never
    freed, and change nothing else the events lay): its rows without the step rows, no step bytes."""
    sig, rows = event_signature[:2]
    casts = sum(n for life, n, _ in rows if life == "until_step")  # laid with the rest, and freed before the step
    return (sig._replace(step_bytes=casts), tuple(r for r in rows if r[0] != "step")) + tuple(event_signature[2:])


def _coarse_events(sig: Signature, rows: tuple) -> tuple:
    """``allocation_events`` without a :class:`Grain`: one block per term."""
    mo = sig_moments(sig)
    ev: list[tuple] = []
    for j, (life, nbytes, stream) in enumerate(rows):
        if life == "step" or life == "until_step":
            ev.append(("alloc", ("step", j), nbytes) + ((stream,) if stream else ()))
    per_life: dict[str, list[tuple[int, int, str]]] = {}
    for j, (life, nbytes, stream) in enumerate(rows):
        per_life.setdefault(life, []).append((j, nbytes, stream))
    outputs = per_life.get("to_step_end", [])
    accumulated = per_life.get("accumulated", []) + per_life.get("accumulated_whole", [])
    late = per_life.get("after_first_backward", []) + per_life.get(LATE_WHOLE, []) + accumulated
    late_done = weight_late_done = False
    stage_on: dict[tuple[str, int], bool] = {}  # (acc | red, local stage) -> laid
    local = {s: j for j, s in enumerate(sorted(sig.stages) if sig.pp > 1 else (0,))}
    kinds, stages, mbs, masks = mo.kind.tolist(), mo.stage.tolist(), mo.microbatch.tolist(), mo.masks.tolist()
    per_stage = {what: getattr(mo, what).tolist() for what in _STAGE_COLUMNS if what not in _STAGE_W_COLUMNS}
    phases = mo.phase.tolist()
    last_stage = sig.pp * sig.virtual_stages - 1 if sig.pp > 1 else 0
    heads = sig.head_bytes or (0,) * len(sig.unit_bytes)
    iwb = sig.iw_bytes or (0,) * len(sig.unit_bytes)
    igb = sig.ig_bytes or (0,) * len(sig.unit_bytes)
    keeps_ig = input_gradient_keeper(sig.schedule, sig.pp, sig.stages)
    sob = sig.so_bytes or (0,) * len(sig.unit_bytes)
    hob = sig.ho_bytes or (0,) * len(sig.unit_bytes)
    lpb = sig.lp_bytes or (0,) * len(sig.unit_bytes)
    laid_lives = [(c, per_life[life]) for c, life in enumerate(PER_MOMENT) if per_life.get(life)]  # (the rest lay none)
    for i, (kind, stage, mb, mask, phase) in enumerate(zip(kinds, stages, mbs, masks, phases)):
        if phase == STEP:
            break  # the optimizer step is not laid without a grain (``RankTimeline._event_signature``)
        col = local[stage if sig.pp > 1 else 0]
        hd, lp = heads[col] - lpb[col], lpb[col]  # the loss side to the W, the log-probabilities to the I
        if phase == END and late_done:
            for j, _, _ in accumulated:  # reduced and dropped by the end of the backward
                ev.append(("free", ("late", j)))
        if kind == _B and phase == ACTION and hd > 0:
            ev.append(("free", ("head", stage, mb)))  # the loss side, before the blocks' backward
        if kind == _B and phase == ACTION and lp > 0:
            ev.append(("free", ("lp", stage, mb)))
        transient = []
        for c, laid in laid_lives:
            if mask[c]:
                transient.extend(laid)
        if mask[_FULL_BACKWARD]:
            transient.extend(per_life.get(_UNIT_MADE, ()))
        if mask[_POST_BACKWARD]:
            transient.extend(per_life.get(_ROOT_END, ()))
        if kind == _W and phase == ACTION:  # what this stage's weight pass holds while it runs
            transient.extend(per_life.get(("wr", col), ()))
            if mo.lw[i, col]:
                transient.extend(per_life.get(("lw", col), ()))
        for what in _STAGE_END_COLUMNS:  # a stage's B end
            for c, x in enumerate(per_stage[what][i]):
                if x:
                    transient.extend(per_life.get((what, c), ()))
        if mask[-1] and not late_done:
            for j, nbytes, stream in late:
                ev.append(("alloc", ("late", j), nbytes) + ((stream,) if stream else ()))
            late_done = True
        if mask[_WEIGHT_LATE] and not weight_late_done:  # what the first W (or B) makes, kept to the end
            for j, nbytes, stream in per_life.get("after_first_weight", ()):
                ev.append(("alloc", ("wlate", j), nbytes) + ((stream,) if stream else ()))
            weight_late_done = True
        for what, column in per_stage.items():
            if what in _STAGE_END_COLUMNS:
                continue
            for c, x in enumerate(column[i]):
                if bool(x) != stage_on.get((what, c), False):
                    stage_on[(what, c)] = bool(x)
                    for j, nbytes, stream in per_life.get((what, c), ()):
                        ev.append(("alloc", (what, c, j), nbytes) + ((stream,) if stream else ()) if x
                                  else ("free", (what, c, j)))
        for j, nbytes, stream in transient:
            ev.append(("alloc", ("t", j, i), nbytes) + ((stream,) if stream else ()))
        so, ho = sob[col], hob[col]  # (the stage output its send holds: ``ho``, out of the microbatch's)
        unit = sig.unit_bytes[col] - hd - so - ho
        if kind == _F and phase == ACTION:
            ev.extend(("alloc", (tag, stage, mb), x) for tag, x in (("mb", unit), ("so", so), ("ho", ho)) if x > 0)
            if stage == last_stage:
                for j, nbytes, _ in outputs:
                    ev.append(("alloc", ("out", j, mb), nbytes))
        for j, _, _ in transient:
            ev.append(("free", ("t", j, i)))
        if kind == _I and phase == ACTION and iwb[col] > 0:  # what the I keeps for its W
            ev.append(("alloc", ("iw", stage, mb), iwb[col]))
        if phase == ACTION and igb[col] > 0 and keeps_ig(kind, stage):  # its input gradient, kept to the step's end
            ev.append(("alloc", ("ig", stage, mb), igb[col]))
        if kind == _W and phase == ACTION and iwb[col] > 0:
            ev.append(("free", ("iw", stage, mb)))
        if kind == _F and phase == ACTION and hd > 0:  # the loss side, after the blocks' forward
            ev.append(("alloc", ("head", stage, mb), hd))
        if kind == _F and phase == ACTION and lp > 0:
            ev.append(("alloc", ("lp", stage, mb), lp))
        if kind == _I and phase == ACTION and lp > 0:  # the log-probabilities, at the I's end
            ev.append(("free", ("lp", stage, mb)))
        if (kind == _B or kind == _W) and unit > 0 and phase == ACTION:
            ev.append(("free", ("mb", stage, mb)))
        if (kind == _B or kind == _I) and so > 0 and phase == ACTION:
            ev.append(("free", ("so", stage, mb)))
        if kind == _W and hd > 0 and phase == ACTION:
            ev.append(("free", ("head", stage, mb)))
    gone = {j for j, _, _ in accumulated} if END in phases else set()
    for j, _, _ in late if late_done else ():
        if j not in gone:
            ev.append(("free", ("late", j)))
    for j, _, _ in per_life.get("after_first_weight", ()) if weight_late_done else ():
        ev.append(("free", ("wlate", j)))
    # the input gradients and the sent outputs kept to the end
    ev.extend([("free", e[1]) for e in ev if e[0] == "alloc" and e[1][0] in ("ig", "ho")])
    for (what, c), on in stage_on.items():
        for j, _, _ in per_life.get((what, c), ()) if on else ():
            ev.append(("free", (what, c, j)))
    if outputs:
        for mb in sorted({mb for kind, stage, mb in zip(kinds, stages, mbs) if kind == _F and stage == last_stage}):
            for j, _, _ in outputs:
                ev.append(("free", ("out", j, mb)))
    return tuple(ev)


class MicrobatchKeys:
    """How ``_fine_events`` names what a microbatch allocates, for the allocator's ``("cycle", ...)``:
    the keys tagged "mb" (a stage-microbatch's saved tensors), "iw" (what an I keeps for its W), "so" (a
    last stage's output, ``_coarse_events``), "out" (the last stage's kept outputs), "ig" (an input gradient kept
    to the step's end) and "ho" (a stage output its send holds) carry the microbatch at index 2; every other key is either
    freed within its moment (named by the moment: a period's own) or the step's (never shifted)."""

    TAGS = frozenset({"mb", "iw", "out", "so", "ig", "ho"})

    @staticmethod
    def shift(key, d: int):
        if d and key.__class__ is tuple and key[0] in MicrobatchKeys.TAGS:
            return key[:2] + (key[2] + d,) + key[3:]
        return key

    @staticmethod
    def shape(key):
        if key.__class__ is tuple and key and key[0] in MicrobatchKeys.TAGS:
            return key[:2] + key[3:]
        return key

    @staticmethod
    def shift_events(events: tuple, d: int) -> list:
        """``events`` with every key shifted by ``d`` (``shift`` in one pass, for the replay's periods)."""
        tags = MicrobatchKeys.TAGS
        out = []
        for e in events:
            k = e[1]
            if k.__class__ is tuple and k[0] in tags:
                out.append((e[0], k[:2] + (k[2] + d,) + k[3:]) + e[2:])
            else:
                out.append(e)
        return out

    @staticmethod
    def distance(a, b) -> int | None:
        """The shift that makes key ``a`` key ``b`` (None: none does)."""
        if MicrobatchKeys.shape(a) != MicrobatchKeys.shape(b):
            return None
        return b[2] - a[2] if a.__class__ is tuple and a[0] in MicrobatchKeys.TAGS else 0


def _steady_windows(mo: Moments, first_backward: int, pp: int, kept: bool = False,
                    own: bool = False) -> list[tuple[int, int, int, int]]:
    """Where a rank's step may be in a steady state: windows (start, period, shift, count) such that
    each of the ``count`` periods of ``period`` moments from ``start`` has the first period's moments
    with every microbatch ``shift`` later — the same kinds, stages, phases and transient masks — all
    after the rank's first backward; by start (the longest first). The periods tried are the
    commonest distances between a stage's forwards one, two, pp and 2·pp apart (a microbatch a period,
    or a round of an interleaved schedule: pp microbatches per stage). Moments that repeat are not
    enough (a cooldown's backwards repeat as what they free shrinks): ``_fine_events`` checks the
    window's first period against its state. ``kept``, ``own``: the rank lays units kept since a backward
    (``Moments.gk``), its stages' current units and all-gather outputs (``cu``, ``sg``, ``sf``); else those columns,
    which follow the schedule alone, lay nothing and are not looked at."""
    kind, stage, mb, phase, masks = mo.kind, mo.stage, mo.microbatch, mo.phase, mo.masks
    n = len(kind)
    forwards = np.flatnonzero((kind == _F) & (phase == ACTION))
    forwards = forwards[forwards > first_backward]
    if len(forwards) < 3:
        return []
    candidates: dict[tuple[int, int], int] = {}
    for st in np.unique(stage[forwards]).tolist():
        f = forwards[stage[forwards] == st]
        for lag in sorted({1, 2, pp, 2 * pp}):
            if lag >= len(f):
                continue
            key = (f[lag:] - f[:-lag]) * (1 << 32) + (mb[f[lag:]] - mb[f[:-lag]])
            values, counts = np.unique(key, return_counts=True)
            top = int(values[np.argmax(counts)])
            candidates[(top >> 32, top & 0xFFFFFFFF)] = max(candidates.get((top >> 32, top & 0xFFFFFFFF), 0),
                                                            int(counts.max()))
    bits = masks @ (1 << np.arange(masks.shape[1], dtype=np.int64))
    # (and the moment-only stage columns of its own stage: its current units and all-gather outputs, which follow the
    # stage's previous action)
    sig = ((kind.astype(np.int64) * 8 + phase) << 32) + (stage.astype(np.int64) << 16) + bits
    if own:
        cols = np.column_stack([getattr(mo, what).any(axis=1) for what in ("cu", "sg", "sf")]).astype(np.int64)
        sig = sig + ((cols @ np.array([1, 2, 4], dtype=np.int64)) << 44)
    # (a stage's B-end columns follow the moments' kind, phase, stage and masks, which the periods repeat)
    grads = np.column_stack([getattr(mo, what) for what in _STAGE_COLUMNS
                             if what not in _STAGE_W_COLUMNS + _STAGE_END_COLUMNS and (kept or what != "gk")])
    changes = np.flatnonzero((grads[1:] != grads[:-1]).any(axis=1)) + 1
    windows, tried = [], set()
    for (period, shift), _ in sorted(candidates.items(), key=lambda c: -c[1]):
        if shift <= 0 or (period, shift) in tried or n - period <= first_backward + 2:
            continue
        tried.add((period, shift))
        i = np.arange(first_backward + 2, n - period)  # from the moment after the one laying what lives from then on
        ok = (sig[i] == sig[i + period]) & (mb[i + period] - mb[i] == shift)
        # the runs of moments that repeat one period later
        edges = np.flatnonzero(np.diff(np.concatenate(([0], ok.view(np.int8), [0]))))
        for lo, hi in zip(edges[::2].tolist(), edges[1::2].tolist()):
            count = (hi - lo) // period + 1
            # no period may hold a moment where a stage's gradients are laid or reduced (``Moments.acc``,
            # ``red``), not even as its first (the window's state is taken before its first moment, and
            # a later period's first moment would lay what the first period's did not): the window is
            # cut at each, in whole periods, the period holding it dropped (the longest part kept)
            parts = [(int(i[lo]), count)]
            for c in changes.tolist():
                start, k = parts[-1]
                if start <= c < start + k * period:
                    before = (c - start) // period  # periods wholly before c
                    parts[-1] = (start, before)
                    parts.append((start + (before + 1) * period, k - before - 1))
            start, count = max(parts, key=lambda x: x[1])
            if count >= 3:
                windows.append((start, period, shift, count))
    # the generator tries them by start and drops those it passed: a short window starting earlier must
    # not pass over a longer one (a cut window starts later than its run), so the widest spans are kept
    # first and a window overlapping a kept one is dropped
    kept: list[tuple[int, int, int, int]] = []
    for w in sorted(windows, key=lambda w: (-w[1] * w[3], w[0])):
        lo, hi = w[0], w[0] + w[1] * w[3]
        if all(hi <= k[0] or lo >= k[0] + k[1] * k[3] for k in kept):
            kept.append(w)
    return sorted(kept)


def _fine_events(sig: Signature, rows: tuple, acts: tuple, grain: Grain, compress: bool = False) -> tuple:
    """``allocation_events`` tensor by tensor (its docstring says how); ``acts``: per local stage, the
    saved bytes of its blocks, its log-probabilities, the rest of its loss side and its kept output (the
    logits), one microbatch each.

    ``compress``: the rank's steady state (``_steady_window``: periods of moments that repeat the
    first with every microbatch shifted) is laid once. Where the generator's state at the end of the
    first period is its state at the start with every key of a microbatch shifted (``MicrobatchKeys``;
    the last stage's kept outputs only added, and every event-only transient laid in it still within
    the peak with all the periods' outputs), every later period lays the same events with its keys
    shifted; the window becomes one ``("cycle", chunk, count, shift, MicrobatchKeys)`` of the first
    period's events, which ``engine.memory.allocator.replay`` runs until the allocator loops."""
    mo = sig_moments(sig)
    kinds, stages, mbs, masks = mo.kind.tolist(), mo.stage.tolist(), mo.microbatch.tolist(), mo.masks.tolist()
    per_stage = {what: getattr(mo, what).tolist() for what in _STAGE_COLUMNS if what not in _STAGE_W_COLUMNS}
    phases = mo.phase.tolist()
    first_backward = _first_backward(kinds, phases)
    lay = _Laying(sig, rows, acts, grain, peak_of(sig).bytes, first_backward)
    n_moments = len(kinds)
    windows = _steady_windows(mo, first_backward, sig.pp, bool(sig.gk_bytes),
                              bool(sig.cu_bytes or sig.sg_bytes or sig.sf_bytes)) if compress else []
    steady = trial = None  # the window being tried; (its first event, the generator's state at its start)
    most_before = 0  # the most live bytes before the window being tried (lay.most: since its start)
    nxt = 0
    while nxt < n_moments:
        i = nxt
        if steady is None and windows and windows[0][0] <= i:
            while windows and windows[0][0] < i:  # windows passed while another was tried
                windows.pop(0)
            if windows:
                steady = windows.pop(0)
                trial = (len(lay.ev), lay.state())
                lay.slack = lay.peak
                most_before, lay.most = lay.most, lay.live
        if steady is not None and i == steady[0] + steady[1]:
            after = _one_cycle(lay.ev, steady, trial, lay.state(), lay.slack)
            if after is not None:  # the window's periods are one cycle now: go on from its end
                # period k holds what the first did, plus k periods' kept outputs
                lay.most = max(most_before, lay.most + (steady[3] - 1) * (lay.live - trial[1][0]))
                steady = None
                lay.restore(after)
                nxt = after[5]
                continue
            steady = None
            lay.most = max(most_before, lay.most)
        nxt = i + 1
        if not lay.moment(i, kinds[i], stages[i], mbs[i], masks[i], phases[i], per_stage):
            break  # the optimizer step (``_Laying._optimizer_step``) ends the events
    if steady is not None:  # a window still on trial when the step ended
        lay.most = max(most_before, lay.most)
    lay.finish()
    out = Events(lay.ev)
    out.most_live = lay.most
    return out


class _Laying:
    """``_fine_events``' generator: the events laid so far, the live keys and bytes, the room the
    event-only transients left under the rank's peak since the steady trial began (``slack``), whether
    what lives from the first backward on is laid, each stage-microbatch's saved tensors (block by
    block) and loss side; with the rank's constants (its rows by lifetime, its local stages)."""

    __slots__ = ("ev", "laid_lives", "size", "live", "most", "peak", "slack", "late_done", "weight_late_done", "held", "heads", "pieces",
                 "stage_on", "plans", "sig",
                 "acts", "grain", "iwb", "igb", "per_life", "outputs", "accumulated", "late", "whole", "local", "last_stage", "walk",
                 "first_backward", "later_w", "root_gathered", "keeps_ig", "sent", "hob")

    def __init__(self, sig: Signature, rows: tuple, acts: tuple, grain: Grain, peak: int, first_backward: int):
        self.ev: list[tuple] = []
        self.size: dict = {}
        self.live = self.most = 0
        self.peak = self.slack = peak
        self.late_done = self.weight_late_done = self.root_gathered = False
        self.pieces: dict[tuple[int, int], int] = {}  # (row, moment) -> the pieces a moment's row is laid in
        self.held: dict[tuple[int, int], list] = {}  # (stage, microbatch) -> keys of its saved tensors, by block
        self.heads: dict[tuple[int, int], list] = {}  # (stage, microbatch) -> keys of its loss side (freed at B, W)
        self.stage_on: dict[tuple[str, int], bool] = {}  # (acc | red, local stage) -> laid
        self.plans: dict[tuple, tuple] = {}  # (local stage, first block, last block) -> a block's forward
        self.sig, self.acts, self.grain, self.first_backward = sig, acts, grain, first_backward
        self.iwb = sig.iw_bytes or (0,) * len(sig.unit_bytes)
        self.igb = sig.ig_bytes or (0,) * len(sig.unit_bytes)
        self.hob = sig.ho_bytes or (0,) * len(sig.unit_bytes)
        self.keeps_ig = input_gradient_keeper(sig.schedule, sig.pp, sig.stages)
        # the stage-microbatches whose B keeps its input gradient: their sends' Works go before the optimizer step
        mo = sig_moments(sig)
        self.sent = frozenset((s, m) for k, s, m in zip(mo.kind.tolist(), mo.stage.tolist(), mo.microbatch.tolist())
                              if k == _B and self.keeps_ig(k, s))
        per_life: dict = {}
        for j, (life, nbytes, stream) in enumerate(rows):
            if life == "step":
                self.alloc(("step", j), nbytes, stream)
            per_life.setdefault(life, []).append((j, nbytes, stream))
        for j, nbytes, stream in per_life.get("until_step", ()):  # after every step tensor (``replay_events``)
            self.alloc(("cast", j), nbytes, stream)
        self.per_life = per_life
        # the per-moment lifetimes that have rows, with their column (a moment lays only these)
        self.laid_lives = [(c, life, per_life[life]) for c, life in enumerate(PER_MOMENT) if per_life.get(life)]
        self.outputs = per_life.get("to_step_end", [])
        whole = per_life.get("accumulated_whole", [])
        self.accumulated = {j for j, _, _ in per_life.get("accumulated", []) + whole}
        whole = per_life.get(LATE_WHOLE, []) + whole
        self.late = per_life.get("after_first_backward", []) + per_life.get("accumulated", []) + whole
        self.whole = {j for j, _, _ in whole}
        self.local = {s: j for j, s in enumerate(sorted(sig.stages) if sig.pp > 1 else (0,))}
        self.last_stage = sig.pp * sig.virtual_stages - 1 if sig.pp > 1 else 0
        self.walk = _forward_walk(grain.kept, grain.work)
        self.later_w = sig_moments(sig).lw.tolist() if sig.lw_bytes else None  # per moment: a W after the stage's first

    def alloc(self, key, n: int, stream: int = 0) -> None:
        self.ev.append(("alloc", key, n, stream) if stream else ("alloc", key, n))
        self.size[key] = n
        self.live += n
        if self.live > self.most:
            self.most = self.live

    def free(self, key) -> None:
        self.ev.append(("free", key))
        self.live -= self.size.pop(key)

    def free_t(self, j2: int, i: int) -> None:
        """A moment's row freed, and the pieces it was laid in (``_lay_whole``)."""
        self.free(("t", j2, i))
        for q in range(1, self.pieces.pop((j2, i), 1)):
            self.free(("t", j2, i, q))

    def fits(self, n: int, ahead: int) -> bool:
        """Whether an event-only tensor of ``n`` bytes (with ``ahead`` bytes allocated while it lives)
        keeps the live bytes within the peak; records the room it leaves."""
        room = self.peak - (self.live + n + ahead)
        if n > 0 and room >= 0:
            if room < self.slack:
                self.slack = room
            return True
        return False

    def transient(self, key, n: int, ahead: int = 0) -> bool:
        """An event-only tensor (no term holds it): laid only where the live bytes stay within the peak,
        with the ``ahead`` bytes that are allocated while it lives."""
        if self.fits(n, ahead):
            self.alloc(key, n)
            return True
        return False

    def state(self) -> tuple:
        return _generator_state(self.live, self.size, self.late_done, self.held, self.heads)

    def restore(self, after: tuple) -> None:
        """The state after a steady window laid as one cycle (``_one_cycle``)."""
        self.live, self.late_done = after[0], after[1]
        for mine, theirs in ((self.size, after[2]), (self.held, after[3]), (self.heads, after[4])):
            mine.clear()
            mine.update(theirs)

    def finish(self) -> None:
        """The step's end: what lives from the first backward on, the stages' gradients, the kept outputs."""
        for key in [k for k in self.size if k[0] in ("late", "wlate", "out", "ig", "ho") + _STAGE_COLUMNS]:
            self.free(key)

    def _blocks(self, j: int) -> tuple[int, int]:
        """Local stage ``j``'s blocks and their saved bytes (none: no block to lay them on, they go with the rest)."""
        layer_b = self.acts[j][0]
        blocks = self.grain.blocks[j] if layer_b > 0 else 0
        return blocks, layer_b if blocks else 0

    def moment(self, i: int, kind: int, stage: int, mb: int, mask: list, phase: int, per_stage: dict) -> bool:
        """Lay moment ``i``'s events; False at the optimizer step, the last. ``per_stage``: each per-stage
        column (``_STAGE_COLUMNS`` but ``wr``) by its tag, as a list per moment."""
        if phase == STEP:
            for key in [k for k in self.size if (k[0] == "ig" and k[1:3] in self.sent) or k[0] == "ho"]:
                self.free(key)  # the schedule waited its sends and dropped their Works before the step
            self._optimizer_step()
            return False
        sig, size, alloc, free = self.sig, self.size, self.alloc, self.free
        if phase == LATE and sig.moment_only and sig.transient_bytes[_LATE_BACKWARD] == sig.moment_only:
            return True  # a late moment of plain gradients only: the B's walk laid them as autograd makes them
        if phase == END and self.accumulated:  # reduced and dropped by the end of the backward
            for key in [k for k in size if k[0] == "late" and k[1] in self.accumulated]:
                free(key)
        j = self.local[stage if sig.pp > 1 else 0]
        walk_b = kind == _B and phase == ACTION and (stage, mb) in self.held
        whole, per_block = [], []
        for c, life, laid in self.laid_lives:
            if mask[c]:
                (per_block if walk_b and life in ("backward", "backward_input") else whole).extend(
                    (life, r) for r in laid)
        if mask[_FULL_BACKWARD]:
            (per_block if walk_b else whole).extend((_UNIT_MADE, r) for r in self.per_life.get(_UNIT_MADE, ()))
        for what in _STAGE_END_COLUMNS:  # a stage's B end
            for c, x in enumerate(per_stage[what][i]):
                if x:
                    whole.extend((what, r) for r in self.per_life.get((what, c), ()))
        weight_pass = self._weight_pass(i, j) if kind == _W and phase == ACTION else []
        if mask[-1] and not self.late_done:
            for j2, nbytes, stream in self.late:
                alloc(("late", j2), nbytes, stream)
            self.late_done = True
        if mask[_WEIGHT_LATE] and not self.weight_late_done:  # what the first W (or B) makes, kept
            for j2, nbytes, stream in self.per_life.get("after_first_weight", ()):
                alloc(("wlate", j2), nbytes, stream)
            self.weight_late_done = True
        after_pass = self._stage_rows(i, per_stage, bool(weight_pass))
        if phase == LOSS:
            self._loss(i, whole)
            return True
        if kind == _B and phase == ACTION:
            for key in self.heads.pop((stage, mb), ()):  # the loss side, before the blocks' backward
                free(key)
        # the end of the backward's sharded gradients stay for an optimizer step the events lay (``_optimizer_step``)
        kept = phase == END and bool(self.grain.step)
        # the rank's first forward gathers the root first: its all-gather output lives to the first block's copy-out,
        # beside the root's parameters and the block's output (``Grain.root_gather``), an event-only tensor
        root_gather = (kind == _F and phase == ACTION and self.grain.root_gather and not self.root_gathered
                       and self.fits(self.grain.root_gather, 0))
        if root_gather:
            alloc(("rag", i), self.grain.root_gather, ALL_GATHER_STREAM)
            self.root_gathered = True
        self._lay_whole(i, whole, kept)
        if root_gather:
            free(("rag", i))
        if kind == _F and phase == ACTION and sig.unit_bytes[j] > 0:
            whole = self._forward(i, stage, mb, j, whole)
        leftover = self._backward_walk(i, stage, mb, j, per_block) if walk_b else []
        root_end = mask[_POST_BACKWARD] and (_ROOT_END in self.per_life or bool(self.grain.root_end))
        if root_end and not self.grain.root_end[2]:  # the end's side before the copy-in: the moment's tensors
            for j2, nbytes, stream in self.per_life.get(_ROOT_END, ()):
                alloc(("rci", j2, i), nbytes, stream)
        gathered = 0  # the every-action tensors freed before the root's copy-in (the gathered root among them)
        for _life, (j2, nbytes, _) in whole:
            if root_end and _life != "every_action":
                self._root_end(i, gathered)
                root_end = False
            if not (kept and _life == "end_of_backward"):
                self.free_t(j2, i)
            gathered += nbytes if _life == "every_action" else 0
        if root_end:
            self._root_end(i, gathered)
        if mask[_POST_BACKWARD]:
            for key in [k for k in size if k[0] == "rci"]:
                free(key)
        for key, x, stream in leftover:  # what lives from the first backward on beyond the freed tensors: at its end
            if x:
                alloc(key, x, stream)
        for key in reversed(weight_pass):
            free(key)
        for key, nbytes, stream in after_pass:
            alloc(key, nbytes, stream)
        if kind == _I and phase == ACTION and sig.lp_bytes and ("mb", stage, mb, "logprob") in size:  # and the loss's
            free(("mb", stage, mb, "logprob"))
            self.heads[(stage, mb)] = [k for k in self.heads[(stage, mb)] if k != ("mb", stage, mb, "logprob")]
        if kind == _I and phase == ACTION and self.iwb[j] > 0:  # what the I keeps for its W: each weight op's
            # output gradient, a tensor of its own (one piece, the events carved a large cached block per I and the
            # next moment's transients grew a segment each: measure --fake of GPT-2 s32K pp4 cp2 ZBV fp32, 192 and
            # 768 MiB tensors where the events laid 1,920 MiB)
            weights = self.grain.iw_pieces[j] if self.grain.iw_pieces and self.grain.iw_pieces[j] else (1,)
            for q, x in enumerate(_pieces(self.iwb[j], weights)):
                if x:
                    alloc(("iw", stage, mb, q), x)
        if phase == ACTION and self.igb[j] > 0 and self.keeps_ig(kind, stage):  # its input gradient, kept to the
            alloc(("ig", stage, mb), self.igb[j])  # step's end (a sent one to the end of the backward: ``moment``)
        if kind == _I and phase == ACTION and ("mb", stage, mb, "so", 0) in size:  # the stage output, at the I's end
            # (after the gradients it keeps, made before stage_backward_input detaches the output)
            so_keys = [k for g in self.held[(stage, mb)] for k in g if k[3:4] == ("so",)]
            for key in so_keys:
                free(key)
            self.held[(stage, mb)] = [[k for k in g if k not in so_keys] for g in self.held[(stage, mb)]]
        if kind == _W and phase == ACTION:
            pieces = self.grain.iw_pieces[j] if self.grain.iw_pieces and self.grain.iw_pieces[j] else (1,)
            for q in range(len(pieces)):
                if ("iw", stage, mb, q) in size:
                    free(("iw", stage, mb, q))
        if (kind == _B or kind == _W) and phase == ACTION and (stage, mb) in self.held:
            for key in sum(self.held.pop((stage, mb)), []) + self.heads.pop((stage, mb), []):
                free(key)
        return True

    def _weight_pass(self, i: int, j: int) -> list:
        """What local stage ``j``'s weight pass holds while it runs (laid; their keys returned, to free after it): its
        recomputes, in pieces the size of a block's largest tensors (the grain's ``work``: what recompute = "none"
        saves), at most WEIGHT_PASS_PIECES of them; and, its weights holding a gradient already, the fresh ones."""
        keys = []
        largest = self.grain.recomputed[0] if self.grain.recomputed else max(self.grain.work, default=0)
        piece = self.grain.wp_piece[j] if self.grain.wp_piece else 0
        for j2, nbytes, stream in self.per_life.get(("wr", j), ()):
            if piece and nbytes > 0:  # gradients of that size, the last what is left of the pass's net
                parts = [piece] * (nbytes // piece) + ([nbytes % piece] if nbytes % piece else [])
            else:
                parts = _pieces(nbytes, (1,) * max(1, min(WEIGHT_PASS_PIECES, nbytes // max(largest, 1))))
            for q, x in enumerate(parts):
                if x:
                    self.alloc(("wp", j2, i, q), x, stream)
                    keys.append(("wp", j2, i, q))
        if self.later_w and self.later_w[i][j]:
            for j2, nbytes, stream in self.per_life.get(("lw", j), ()):
                self.alloc(("wp", j2, i, "lw"), nbytes, stream)
                keys.append(("wp", j2, i, "lw"))
        return keys

    def _root_end(self, i: int, gathered: int) -> None:
        """FSDP2's root post-backward at the end of the backward (``_ROOT_END``), as torch's ``foreach_reduce`` runs it:
        the root resharded (the moment's every-action tensors freed first, ``gathered``: the gathered root among them)
        and the last block's reduce-scatter input dropped, then the root's own allocated whole. Where the copy-in is
        the end's largest side the term is that input net of the gathered root (the root's sharded gradients, not yet
        made, left out), laid as one piece: the term's bytes and the gathered root's, or the input's own where they
        stay within the peak. Else the term stands for the side before it (the last block's input beside the
        gathered root) and is laid at the moment, freed here, and the input is an event-only tensor laid where it
        stays within the peak. A fake Llama 3 8B dp32 ZeRO-3 step, fp32 reduce: a 4,008 MiB request 16 KiB past the
        loss's cached fp32 tensors (the final norm is in the input), a new segment; the term's net 1,879 MiB had fitted
        in one (reserved −21.9 → −9.2 %; thirteen cached seeds: 18 ranks moved, 12 closer, within 5 % 636 → 641)."""
        whole, laid, copy_in_side = self.grain.root_end
        if not copy_in_side:
            for key in [k for k in self.size if k[0] == "rci"]:
                self.free(key)
            self.transient(("rci", -1, i), whole)
            return
        extra = min(laid, gathered)
        for j2, nbytes, stream in self.per_life[_ROOT_END]:
            n = nbytes + extra
            self.alloc(("rci", j2, i), whole if n < whole and self.fits(whole - n, n) else n, stream)
            extra = whole = 0

    def _optimizer_step(self) -> None:
        """The optimizer step's tensors (the grain's ``step``), one by one. AdamW's multi-tensor step
        (torch/optim/adam.py ``_multi_tensor_adam``): ``torch._foreach_sqrt`` makes the square root of every second
        moment, one tensor each, in order, all alive to the step's end; its for-loop step (``_single_tensor_adam``):
        per parameter ``denom = (exp_avg_sq.sqrt() / c).add_(eps)`` makes the root and the quotient, frees the
        root, and the assignment frees the previous parameter's denominator. The multi-tensor step's roots are
        freed after every allocation of the step: the events leave them live (what the step's end frees changes
        no peak), at half the events. (The last unit's sharded gradients, which the end of the backward made and
        the step still holds, the end-of-backward moment kept: ``moment``'s ``kept``.)"""
        if not self.grain.step:
            return
        for j, _, _ in self.per_life.get("until_step", ()):  # autocast's cache, cleared as its context exits
            self.free(("cast", j))
        loop, groups = self.grain.step
        q, prev = 0, None
        for sizes, count in groups:
            for _ in range(count):
                for n in sizes:
                    self.alloc(("sqrt", q), n)
                    if loop:
                        self.alloc(("denom", q), n)
                        self.free(("sqrt", q))
                        if prev is not None:
                            self.free(prev)
                        prev = ("denom", q)
                    q += 1
        if prev is not None:
            self.free(prev)

    def _loss(self, i: int, whole: list) -> None:
        """The loss moment: its transients, the loss's tensors (its fp32 vocabulary shards where the grain
        knows their size, else two halves) all alive at once, then all but the last freed, the logits'
        gradient where it fits, and the last."""
        alloc, free = self.alloc, self.free
        losses = []
        piece = self.grain.loss_piece
        for life, (j2, nbytes, stream) in whole:
            if life == "loss":
                n = nbytes // piece if piece and nbytes % piece == 0 else 0
                parts = [piece] * n if n >= 2 else [nbytes // 2, nbytes - nbytes // 2]
                for k, x in enumerate(parts):
                    alloc(("loss", j2, i, k), x, stream)
                losses.append((j2, len(parts)))
            else:
                alloc(("t", j2, i), nbytes, stream)
        for j2, n in losses:
            for k in range(n - 1):
                free(("loss", j2, i, k))
        lg = self.transient(("logits_grad", i), self.grain.logits_bytes)
        for j2, n in losses:
            free(("loss", j2, i, n - 1))
        if lg:
            free(("logits_grad", i))
        for life, (j2, _, _) in whole:
            if life != "loss":
                free(("t", j2, i))

    def _forward(self, i: int, stage: int, mb: int, j: int, whole: list) -> list:
        """A forward of local stage ``j``: its blocks' saved tensors and transients, block by block, the rest,
        the loss side and (on the last stage) the kept outputs. Returns the moment's transients still to free."""
        alloc, free, fits, grain = self.alloc, self.free, self.fits, self.grain
        _, logprob_b, head_b, kept_logits = self.acts[j]
        blocks, layer_b = self._blocks(j)
        keys = self.held[stage, mb] = []
        so = self.sig.so_bytes[j] if self.sig.so_bytes else 0
        ho = self.hob[j]  # the stage output its send holds (out of the rest)
        rest = self.sig.unit_bytes[j] - layer_b - logprob_b - head_b - so - ho
        # a negative rest (the stage input, which is the p2p receive buffer) comes off the first block
        fold = min(rest, 0) if blocks else 0
        for b in range(blocks):
            block_keys, window = [], []
            at = (j, b == 0, b == blocks - 1)
            plan = self.plans.get(at)
            if plan is None:
                share = layer_b // blocks + (layer_b % blocks if at[2] else 0) + (fold if at[1] else 0)
                plan = self.plans[at] = _block_plan(max(share, 0), self.walk, grain)
            for pos, (saved, n, ahead, idx) in enumerate(plan):
                if saved:
                    if n:
                        key = ("mb", stage, mb, b, idx)
                        alloc(key, n)
                        block_keys.append(key)
                elif fits(n, ahead):  # an event-only transient, within the peak
                    key = ("fwd", i, b, pos)
                    alloc(key, n)
                    window.append((pos, key))
                while window and window[0][0] <= pos - 2:
                    free(window.pop(0)[1])
            for _, key in window:
                free(key)
            keys.append(block_keys)
        if rest > 0:
            alloc(("mb", stage, mb, "rest"), rest)
            keys.append([("mb", stage, mb, "rest")])
        if head_b or logprob_b:  # the loss side comes after the blocks' forward and its transients
            for _life, (j2, _, _) in whole:
                self.free_t(j2, i)
            whole = []
        if head_b > 0:  # the final norm's and the head's saved tensors
            alloc(("mb", stage, mb, "head"), head_b)
            self.heads.setdefault((stage, mb), []).append(("mb", stage, mb, "head"))
        if so > 0:  # the stage's output (the logits), kept by the stage for the microbatch's backward; or what else
            # an I frees (its tensors: ``Grain.so_pieces``)
            weights = grain.so_pieces[j] if grain.so_pieces and grain.so_pieces[j] else (1,)
            so_keys = [("mb", stage, mb, "so", q) for q, x in enumerate(_pieces(so, weights)) if x]
            for key, x in zip(so_keys, [x for x in _pieces(so, weights) if x]):
                alloc(key, x)
            keys.append(so_keys)  # a B frees it with the rest; an I at its end
        if ho > 0:  # the stage output, held by its send's Work to the end of the backward
            alloc(("ho", stage, mb), ho)
        if logprob_b > 0:
            # the logits as the loss reads them: its fp32 cast's source, or (fp32) the gathered logits themselves
            logits_b = grain.logits_bytes or grain.head_gather
            shard = grain.head_shard and self.transient(("head_shard", i), grain.head_shard,
                                                        grain.head_gather + logits_b)
            gather = shard and self.transient(("head_gather", i), grain.head_gather, logits_b)
            # its fp32 copy and the log-probabilities come once the gathered buffer and the shard are freed. Where
            # the pipeline's last stage keeps its output, that output is the logits the loss reads (one tensor:
            # laid with the stage's microbatch, the rest or ``so``), no second one (measure --fake of GPT-2 s128K
            # pp8 cp2, last stage: one 6,284 MiB logits tensor before the loss's fp32 ones; the events laid two)
            kept = bool(kept_logits) and not grain.head_shard
            lgt = kept or self.transient(("logits", i), logits_b,
                                         max(2 * logprob_b - (grain.head_gather if gather else 0)
                                             - (grain.head_shard if shard else 0), 0))
            if gather:
                free(("head_gather", i))
            if shard:
                free(("head_shard", i))
            f32 = lgt and grain.logits_bytes and self.transient(("logits_fp32", i), logprob_b, logprob_b)
            alloc(("mb", stage, mb, "logprob"), logprob_b)
            self.heads.setdefault((stage, mb), []).append(("mb", stage, mb, "logprob"))
            if f32:
                free(("logits_fp32", i))
            if lgt and not kept:
                free(("logits", i))
        if stage == self.last_stage:
            for j2, nbytes, _ in self.outputs:
                alloc(("out", j2, mb), nbytes)
        return whole

    def _lay_whole(self, i: int, whole: list, kept: bool) -> None:
        """The moment's tensors laid whole (``kept``: the end of the backward's sharded gradients stay for the
        optimizer step). The REDUCE_GRAD moment's row is its net: torch allocates the unit's whole reduce-scatter
        input beside what the net takes off, laid so where the live bytes stay within the peak."""
        gross = self.grain.reduce_gross
        for life, (j2, nbytes, stream) in whole:
            if life == "reduce_grad" and gross > nbytes and self.fits(gross, 0):
                nbytes = gross
            if life == "backward_input" and self.grain.work and nbytes > max(self.grain.work):
                # a recomputed block is its tensors, as the B's walk lays it (``_backward_walk``), not one allocation
                # (measure --fake of seed 20261245 #38, Llama 2 7B s64K b2 ZeRO-3 full recompute: none larger than
                # 2,752 MiB; laid whole at the late-backward moment, an 18,225 MiB request)
                parts = [x for x in self._recomputed_pieces(nbytes) if x]
                self.pieces[(j2, i)] = len(parts)
                for q, x in enumerate(parts):
                    self.alloc(("t", j2, i) if q == 0 else ("t", j2, i, q), x, stream)
                continue
            # an I's float8 phase, and eager float8's casts in a forward's or a B's moment, are casts and gradients,
            # each at most a cast's fp32 copy, not one allocation (torchao's hp_tensor_to_float8_dynamic: .to(float32),
            # * scale, the clamp, the float8 result, each a tensor; measure --fake of seed 20261276 #23, Llama 3 405B
            # tp8 SP float8: no cast above 2 GiB where the B's float8 term is 6.4 GiB, and laid whole its request took
            # a fresh segment, twice: reserved +8 … +22.5 % on its eight ranks)
            piece = self.grain.ib_piece if life == "input_backward" else (
                self.grain.f8_piece if life in ("forwards", "full_backward") else 0)
            if piece and nbytes > piece:
                n = -(-nbytes // piece)
                self.pieces[(j2, i)] = n
                for q, x in enumerate(_pieces(nbytes, (1,) * n)):
                    self.alloc(("t", j2, i) if q == 0 else ("t", j2, i, q), x, stream)
                continue
            self.alloc(("eob", j2) if kept and life == "end_of_backward" else ("t", j2, i), nbytes, stream)

    def _stage_rows(self, i: int, per_stage: dict, weight_pass: bool) -> list:
        """Moment ``i``'s per-stage rows that start or end (a stage's gradients, its gathered units). A W's fresh
        gradients (``fr``) are made as its groups run, after its recomputes (``weight_pass``): returned, to be laid once
        those are freed."""
        after_pass = []
        for what, column in per_stage.items():
            if what in _STAGE_END_COLUMNS:
                continue
            for c, x in enumerate(column[i]):
                if bool(x) != self.stage_on.get((what, c), False):
                    self.stage_on[(what, c)] = bool(x)
                    for j2, nbytes, stream in self.per_life.get((what, c), ()):
                        if x and what == "fr" and weight_pass:
                            after_pass.append(((what, c, j2), nbytes, stream))
                        elif x:
                            self.alloc((what, c, j2), nbytes, stream)
                        else:
                            self.free((what, c, j2))
        return after_pass

    def _recomputed_pieces(self, nbytes: int) -> list[int]:
        """A recomputed block's bytes as the events lay them: pieces of ``Grain.recomputed``'s size (a block with
        experts: measure --fake of Mixtral 8x7B s64K 1F1B pp8 tp2 ep8 full recompute, seed 20261247 #10, 1,792 MiB
        expert tensors where the dense block's two largest had made 5,396 MiB pieces), else in proportion to the
        block's two largest tensors."""
        if self.grain.recomputed and self.grain.recomputed[0] > 0:
            return _pieces(nbytes, (1,) * max(1, -(-nbytes // self.grain.recomputed[0])))
        return _pieces(nbytes, self.grain.work)

    def _backward_walk(self, i: int, stage: int, mb: int, j: int, per_block: list) -> list:
        """A B over its blocks, last to first: each block's backward transients, then its saved tensors freed;
        in the rank's first backward, what lives from then on laid as the freed tensors make room. Returns what
        of it they did not make room for, laid at the B's end (its transients freed: ``_Laying.moment``)."""
        alloc, free, size = self.alloc, self.free, self.size
        blocks, _ = self._blocks(j)
        keys = self.held.pop((stage, mb))
        tail = keys[blocks:]  # the rest, freed with the first (last) block
        first = i == self.first_backward and not self.late_done
        # (a piece a block, as autograd makes the units' gradients; a whole tensor, after the blocks: ``WHOLE_KINDS``)
        pending = ([(("late", j2, q), piece, stream) for j2, nbytes, stream in self.late if j2 not in self.whole
                    for q, piece in enumerate(_pieces(nbytes, (1,) * max(blocks, 1)))]
                   + [(("late", j2, 0), nbytes, stream) for j2, nbytes, stream in self.late if j2 in self.whole]
                   ) if first else []
        freed = made = 0
        for b in reversed(range(blocks)):
            tmp = []
            for life, (j2, nbytes, stream) in per_block:
                parts = self._recomputed_pieces(nbytes) if life == "backward_input" else [nbytes]
                for q, x in enumerate(parts):
                    if x:
                        alloc(("bw", j2, i, b, q), x, stream)
                        tmp.append(("bw", j2, i, b, q))
            for key in reversed(tmp):
                free(key)
            for j2, nbytes, _ in self.per_life.get(_UNIT_FRESH, ()):  # the block's post-backward: its fresh gradient
                if self.transient(("uf", j2, i, b), nbytes):
                    free(("uf", j2, i, b))
            for key in keys[b] + (sum(tail, []) if b == blocks - 1 else []):
                freed += size[key]
                free(key)
            while pending and made + pending[0][1] <= freed:
                key, x, stream = pending.pop(0)
                if x:
                    alloc(key, x, stream)
                made += x
        self.late_done = self.late_done or first
        return pending


#: the event keys only added until the step's end: the last stage's kept outputs, the input gradients kept, the
#: stage outputs the sends hold
_KEPT_TAGS = ("out", "ig", "ho")


def _generator_state(live: int, size: dict, late_done: bool, held: dict, heads: dict) -> tuple:
    """``_fine_events``' state: live bytes, the live keys (the last stage's kept outputs apart), the
    kept outputs, whether what lives from the first backward on is laid, the stage-microbatches'
    saved tensors and loss sides (copied)."""
    return (live, {k: n for k, n in size.items() if k[0] not in _KEPT_TAGS},
            {k: n for k, n in size.items() if k[0] in _KEPT_TAGS},
            late_done, {k: [list(x) for x in v] for k, v in held.items()}, {k: list(v) for k, v in heads.items()})


def _shifted_state(st: tuple, d: int) -> tuple:
    """A generator state with every microbatch ``d`` later (the kept outputs as they are)."""
    sh = MicrobatchKeys.shift
    return (st[0], {sh(k, d): n for k, n in st[1].items()}, st[2], st[3],
            {(s, m + d): [[sh(k, d) for k in x] for x in v] for (s, m), v in st[4].items()},
            {(s, m + d): [sh(k, d) for k in v] for (s, m), v in st[5].items()})


def _one_cycle(ev: list, steady: tuple, trial: tuple, now: tuple, slack: int) -> tuple | None:
    """At the end of a steady window's first period (``steady``: start, period, shift, count; ``trial``:
    the period's first event and the state at its start; ``now``: the state at its end): where the
    state is the start's with every microbatch shifted (its kept outputs only added, and every
    event-only transient laid in it still within the peak with all the periods' outputs), every
    later period lays the same events with its keys shifted. Then the period's events become one
    ``("cycle", ...)`` event in ``ev``, and this returns the state after the window's last period:
    (live, late_done, size, held, heads, the moment after the window); else None."""
    start, period, shift, count = steady
    before = _shifted_state(trial[1], shift)
    kept = {k: n for k, n in now[2].items() if k not in before[2]}  # the period's kept outputs
    growth = sum(kept.values())
    if not (now[0] == before[0] + growth and now[1:2] + now[3:] == before[1:2] + before[3:]
            and before[2].items() <= now[2].items() and slack >= (count - 1) * growth):
        return None
    chunk = tuple(ev[trial[0]:])
    del ev[trial[0]:]
    ev.append(("cycle", chunk, count, shift, MicrobatchKeys))
    after = _shifted_state(trial[1], count * shift)
    size = {**after[1], **after[2]}
    for r in range(count):
        size.update((MicrobatchKeys.shift(k, r * shift), n) for k, n in kept.items())
    return after[0] + count * growth, after[3], size, after[4], after[5], start + count * period


def _block_plan(share: int, walk: list, grain: Grain) -> tuple:
    """One block's forward as (saved, bytes, ahead, index) steps: its ``share`` of saved bytes in
    pieces, the transients with the saved bytes allocated while each lives (the two steps after it)."""
    pieces = _pieces(share, grain.kept)
    k = len(grain.kept)
    if k > 1 and max(grain.kept) - min(grain.kept) <= k and 0 < share < sum(grain.kept):
        # equal pieces of a block's largest tensor (a block with experts): a smaller share is fewer of them, not
        # smaller ones (a share less what an I frees, ``FREED_AT_INPUT_KINDS``: smaller pieces served no later request)
        full = share // grain.kept[0]
        pieces = ([grain.kept[0]] * full + [share - full * grain.kept[0]] + [0] * k)[:k]
    out = []
    for pos, (saved, idx) in enumerate(walk):
        if saved:
            out.append((True, pieces[idx], 0, idx))
        else:
            out.append((False, grain.work[idx], sum(pieces[k] for sv, k in walk[pos + 1:pos + 3] if sv), idx))
    return tuple(out)


def _first_backward(kinds: list, phases: list) -> int:
    """The moment of the rank's first B or I (its own moment, not the loss moment before it)."""
    for i, (k, ph) in enumerate(zip(kinds, phases)):
        if (k == _B or k == _I) and ph == ACTION:
            return i
    return len(kinds)
