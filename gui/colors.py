"""The window's colours, shared by the Qt widgets and the Qt-free HTML report (gui/report.py)."""

#: memory categories (engine.names.MEMORY_CATEGORIES)
CATEGORY_COLORS = {
    "params": "#4C78A8",
    "grads": "#72B7B2",
    "optimizer": "#54A24B",
    "activations": "#F58518",
    "comm_buffers": "#B279A2",
    "temporaries": "#FF9DA6",
    "overhead": "#9D755D",
}
OVER_COLOR = "#D62728"
RESERVED_FILL = "#DCDCDC"  # the cap from allocated up to reserved: a light grey, hatched darker
RESERVED_LINE = "#4D4D4D"
#: pipeline actions: forward, backward, input-gradient and weight-gradient halves of a split backward
KIND_COLORS = {"F": "#4C78A8", "B": "#F58518", "I": "#E45756", "W": "#54A24B"}
IDLE_COLOR = "#E6E6E6"
