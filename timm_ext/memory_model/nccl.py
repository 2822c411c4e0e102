"""NCCL's buffers on each rank of a DDP run: device memory NCCL allocates itself (`cudaMalloc`/`cuMem`), outside
PyTorch's caching allocator, so a plan takes them off the card beside the CUDA context (`nccl_buffer_bytes`). The
figure is a documented assumption, printed with every plan on several ranks (`NCCL_ASSUMPTION`).
"""
__all__ = ['nccl_buffer_bytes', 'NCCL_ASSUMPTION']

MiB = 1 << 20
# NCCL's buffers per connection: the Simple protocol's FIFO (`DEFAULT_BUFFSIZE`, 4 MiB, the documented default of
# NCCL_BUFFSIZE), LL128's (`DEFAULT_LL128_BUFFSIZE` = 120 x 640 x 8 x 8 B) and LL's (`DEFAULT_LL_BUFFSIZE` =
# 8 x 512 x 8 x 16 B), NCCL src/init.cc; allocated in 2 MiB granules: NVIDIA/nccl#1685 logs 10485760-byte buffers
NCCL_CONNECTION_BYTES = -(-((1 << 22) + 120 * 640 * 8 * 8 + 8 * 512 * 8 * 16) // (2 * MiB)) * (2 * MiB)
# Assumption: the channels NCCL opens, its most (`MAXCHANNELS`, src/include/device.h), which NVIDIA/nccl#1685 shows
# on 8 NVLink H100s; PCIe cards open fewer (memory is linear in channels: NVIDIA/nccl#986)
NCCL_CHANNELS = 32
# Assumption: connections holding buffers on a rank, per channel: the ring's receiving side on one node (a ring keeps
# 2 connections whatever the scale, NVIDIA/nccl#986); across nodes also the tree's link up and down (no further growth
# beyond 2 nodes, ibid.)
NCCL_RING_CONNECTIONS = 1
NCCL_TREE_CONNECTIONS = 2
NCCL_ASSUMPTION = (f'NCCL buffers per rank outside the allocator: {NCCL_CONNECTION_BYTES // MiB} MiB a connection '
                   f'(NCCL_BUFFSIZE 4 MiB, LL, LL128) x {NCCL_CHANNELS} channels x {NCCL_RING_CONNECTIONS} connection '
                   f'on one node, {NCCL_RING_CONNECTIONS + NCCL_TREE_CONNECTIONS} across nodes')


def nccl_buffer_bytes(world_size: int, nodes: int = 1) -> int:
    """NCCL's device buffers on each rank, outside PyTorch's allocator (0 on one process); see `NCCL_ASSUMPTION`."""
    if world_size <= 1:
        return 0
    connections = NCCL_RING_CONNECTIONS + (NCCL_TREE_CONNECTIONS if nodes > 1 else 0)
    return NCCL_CHANNELS * connections * NCCL_CONNECTION_BYTES
