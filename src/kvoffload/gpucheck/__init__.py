"""A self-check of the worker half on a machine with an NVIDIA GPU (``scripts/gpu-check``).

Runs where only PyTorch (with CUDA) and numpy are installed: every module here imports
nothing but the standard library, torch, numpy and kvoffload modules that need no more
(``tests/unit/test_gpu_check.py`` runs the dry run with every other dependency blocked).

- :mod:`.kv_layouts`: fake engine KV caches in every layout the transfer worker accepts,
  and the reference check of a block's bytes;
- :mod:`.slabs`: the host slabs copies go to: a private (pinned) one, and a node-shared
  one mapped from a slab file made as the share makes it, in a private temporary root;
- :mod:`.correctness`: store then load round trips through the transfer worker,
  compared bit for bit;
- :mod:`.throughput`: the worker's copies against plain ``copy_(non_blocking=True)``;
- :mod:`.overlap`: a matrix product's slowdown while the worker copies;
- :mod:`.report`: the time budget, the human lines (stderr) and the one JSON line
  (stdout);
- :mod:`.run`: the command line (``python -m kvoffload.gpucheck``).
"""
