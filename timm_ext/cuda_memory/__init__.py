"""CUDA memory predicted without the device: a traced step's event log (`events`), what CUDA's kernels add
(`kernels`), PyTorch's caching allocator replayed (`allocator`, `replay`), and the predicted memory snapshot
(`snapshot`)."""
