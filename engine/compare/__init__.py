"""The compare room: ``measured`` (a prediction against a run's measurement, per rank and category)
and ``calibrate`` (the engine's rates fitted to a run or a link benchmark)."""
