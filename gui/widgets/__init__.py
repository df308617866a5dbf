"""The window's views: thin widgets over gui.state.State."""
