"""Engine-agnostic core of kvoffload: keys, the chunk directory, eviction policies,
the scheduler half. Pure Python: imports neither torch nor vllm (a test enforces it)."""
