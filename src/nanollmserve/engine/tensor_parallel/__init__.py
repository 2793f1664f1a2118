"""Tensor parallelism, run by the engine: rank 0 (`executor.py`) starts or joins the other
ranks (`worker.py`) and broadcasts each step's model inputs to them (`step_channel.py`).

It sits under `engine/` because it drives the engine's own pieces (model loading, the model
runner, the attention context); the process group and the collectives the layers call stay in
the leaf `distributed/parallel_state.py`, which imports nothing of the project.
"""
