"""Synthetic and recorded workloads (pure Python): what the demo, the benchmarks and
the simulator replay."""
