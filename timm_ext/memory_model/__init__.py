"""The memory model: what a step of the run the user launches needs, predicted without the device.

One module a stage, each importing only the stages before it (nothing from `probe`, `tune` or `validate`):

* `live_bytes`, `events`: the step traced on fake tensors, its live bytes by category and its ordered event log;
* `autocast_casts`, `kernels`, `kernel_limits`: what CUDA's kernels do that the CPU trace did not (autocast's float32
  casts, workspaces, launch limits);
* `allocator`, `replay`: PyTorch's caching allocator, and the step replayed on it;
* `snapshot`: the replay written as `torch.cuda.memory._snapshot()` writes a real one;
* `devices`: what each device type adds, and its assumptions;
* `fake_weights`, `step_flops`: the built model moved onto fake tensors, and the traced step's FLOPs;
* `estimate`: train.py's or validate.py's step traced and answered (`estimate_memory`), `predict`: its CUDA replay.
"""
