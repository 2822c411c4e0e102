"""The memory model: what a step of the run the user launches needs, predicted without the device.

One module a stage, each importing only the stages before it (nothing from `probe`, `tune` or `validate`):

* `versions`: the torch, CUDA and cuDNN a plan models, which every versioned rule below reads;
* `estimate`, `skipped_init`, `fake_weights`, `live_bytes`, `events`, `step_facts`: train.py's step (or an eval
  forward) traced on fake tensors, its live bytes by category, its ordered event log, its FLOPs;
* `autocast_casts`, `kernels`, `kernels_attention`, `kernel_limits`: what CUDA's kernels do that the CPU trace did not
  (autocast's float32 casts, workspaces, the attention backend, launch limits);
* `allocator_releases`, `allocator_config`, `cache_release`, `allocator`: PyTorch's caching allocator and the options
  a user sets (each release's rules for reading them, then the reader);
* `replay`, `predict`: the step replayed on it, the CUDA answer at any batch;
* `snapshot`: the replay written as `torch.cuda.memory._snapshot()` writes a real one;
* `contexts`, `cards`, `devices`, `nccl`: the CUDA context, the named cards, what each device type adds, NCCL's
  buffers;
* `estimate_result`: what an estimate answers; `headroom`: the plans' measured margin around it; `trace_pool`: several
  traces side by side.
"""
