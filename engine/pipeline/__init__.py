"""The pipeline room: ``schedules`` (torch.distributed.pipelining's action lists, the one source of
schedule truth), ``timeline`` (their simulation into a makespan and bubbles) and ``layout`` (which
layers each stage holds)."""
