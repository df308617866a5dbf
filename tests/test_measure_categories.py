"""backend.measure.categories_from: what a CPU run reports per category at the tracker's peak."""

from backend.measure import categories_from

EXACT = {"params": 1000, "grads": 1000, "optimizer": 2000}


def test_states_are_the_exact_sizes_under_plain_memtracker():
    raw = {"Parameter": 1000, "Gradient": 0, "Activation": 500, "Temp": 10, "Optstate": 2000, "Total": 3510}
    cats = categories_from(raw, EXACT)
    assert (cats["params"], cats["grads"], cats["optimizer"]) == (1000, 1000, 2000)
    assert cats["activations"] == 500


def test_fsdp2_sharded_gradients_are_what_fsdpmemtracker_saw_at_its_peak():
    # a pipelined FSDP2 rank peaks inside the step, before REDUCE_GRAD makes the sharded gradients
    raw = {"Sharded Param": 1000, "Unsharded Param": 2000, "Sharded Grad": 0, "Unsharded Grad": 2000,
           "Activation": 500, "OptState": 2000, "Total": 7500}
    assert categories_from(raw, EXACT)["grads"] == 0
    # a peak after some units' post-backward: those gradients, never more than the exact size
    assert categories_from({**raw, "Sharded Grad": 400}, EXACT)["grads"] == 400
    assert categories_from({**raw, "Sharded Grad": 1200}, EXACT)["grads"] == 1000
