"""Engine adapters: kvoffload's halves plugged into serving engines."""
