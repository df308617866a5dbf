"""The time room: ``durations`` (FLOPs per stage and microbatch, what recompute runs again), ``comm``
(collective volumes and times on the cluster's links) and ``step`` (the step time, tokens/s and MFU)."""
