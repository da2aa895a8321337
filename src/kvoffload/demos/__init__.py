"""Runnable demonstrations behind ``kvoffload demo``."""
