"""The torchrun topology a process was started under, so the train command it prints can be launched the same way.

tune_batch.py started by a multi-node torchrun (`--nnodes 2 --nproc-per-node 1 --rdzv-endpoint host:port ...` on
each node) probes on every rank; the training it plans must be launched on the same nodes the same way, not with
the single-node `distributed_train.sh N`. The worker's parent is torchrun's agent, whose command line holds the
options (read from /proc and parsed with torchrun's own parser, which also applies its PET_* environment
variables). Where that cannot be read, the variables torchrun gives its workers (GROUP_WORLD_SIZE,
LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT) describe a static rendezvous on the same master.
"""
import argparse
import os
from dataclasses import dataclass
from typing import List, Mapping, Optional, Sequence

__all__ = ['Topology', 'topology_from_torchrun_argv', 'topology_from_env', 'current_topology', 'planned_topology']

_TORCHRUN_MODULE = 'torch.distributed.run'


@dataclass(frozen=True)
class Topology:
    """How torchrun was asked to lay out a run.

    Attributes:
        nnodes: torchrun's --nnodes ('2', or an elastic range '1:4').
        nproc_per_node: Processes per node.
        node_rank: This node's --node-rank (only a static rendezvous uses it).
        rdzv_backend: 'static' (master address and port) or 'c10d' / 'etcd' ... (an endpoint).
        rdzv_endpoint: host:port of the rendezvous ('' for static).
        rdzv_id: The run id of the rendezvous ('none': torchrun's default).
        rdzv_conf: Extra rendezvous settings ('' when none).
        master_addr: Static rendezvous: the master's address.
        master_port: Static rendezvous: the master's port (None: torchrun's default).
        standalone: Started with --standalone (one node, a local rendezvous).
        max_restarts: torchrun's --max-restarts.
    """
    nnodes: str
    nproc_per_node: str
    node_rank: int = 0
    rdzv_backend: str = 'static'
    rdzv_endpoint: str = ''
    rdzv_id: str = 'none'
    rdzv_conf: str = ''
    master_addr: str = '127.0.0.1'
    master_port: Optional[int] = None
    standalone: bool = False
    max_restarts: int = 0

    @property
    def multi_node(self) -> bool:
        return not self.standalone and self.nnodes not in ('1', '1:1')

    def torchrun_options(self) -> List[str]:
        """torchrun's options for this layout (only those that say where and how many processes run)."""
        if self.standalone:
            return ['--standalone', f'--nproc-per-node={self.nproc_per_node}']
        options = [f'--nnodes={self.nnodes}', f'--nproc-per-node={self.nproc_per_node}']
        if self.rdzv_backend == 'static':
            options += [f'--node-rank={self.node_rank}', f'--master-addr={self.master_addr}']
            if self.master_port is not None:
                options.append(f'--master-port={self.master_port}')
        else:  # a dynamic rendezvous assigns node ranks itself (torchrun ignores --node-rank there)
            options.append(f'--rdzv-backend={self.rdzv_backend}')
        for flag, value, default in (('--rdzv-endpoint', self.rdzv_endpoint, ''), ('--rdzv-id', self.rdzv_id, 'none'),
                                     ('--rdzv-conf', self.rdzv_conf, ''), ('--max-restarts', self.max_restarts, 0)):
            if value != default:
                options.append(f'{flag}={value}')
        return options


def _torchrun_options_start(argv: Sequence[str]) -> Optional[int]:
    """Index of torchrun's first option in a process's argv (`python -m torch.distributed.run ...` or `torchrun`)."""
    for i, token in enumerate(argv[:-1]):
        if token == '-m' and argv[i + 1] == _TORCHRUN_MODULE:
            return i + 2
    for i, token in enumerate(argv[:2]):
        if os.path.basename(token) == 'torchrun':
            return i + 1
    return None


def topology_from_torchrun_argv(argv: Sequence[str]) -> Optional[Topology]:
    """The topology in a torchrun command line (its agent's argv), or None if it is not torchrun's."""
    start = _torchrun_options_start(argv)
    if start is None:
        return None
    from torch.distributed.run import get_args_parser
    try:
        parsed: argparse.Namespace = get_args_parser().parse_args(list(argv[start:]))
    except SystemExit:  # not a command line torchrun accepts
        return None
    port = parsed.master_port
    return Topology(str(parsed.nnodes), str(parsed.nproc_per_node), int(parsed.node_rank), parsed.rdzv_backend,
                    parsed.rdzv_endpoint, str(parsed.rdzv_id), parsed.rdzv_conf, parsed.master_addr,
                    int(port) if port not in (None, '') else None, bool(parsed.standalone), int(parsed.max_restarts))


def topology_from_env(env: Mapping[str, str]) -> Optional[Topology]:
    """The topology from the variables torchrun sets for its workers (a static rendezvous on their master)."""
    if 'LOCAL_WORLD_SIZE' not in env or 'GROUP_WORLD_SIZE' not in env:
        return None
    port = env.get('MASTER_PORT')
    return Topology(env['GROUP_WORLD_SIZE'], env['LOCAL_WORLD_SIZE'], int(env.get('GROUP_RANK', 0)),
                    master_addr=env.get('MASTER_ADDR', '127.0.0.1'), master_port=int(port) if port else None)


def _parent_argv() -> Optional[List[str]]:
    try:
        with open(f'/proc/{os.getppid()}/cmdline', 'rb') as f:
            raw = f.read()
    except OSError:
        return None
    return [token.decode(errors='replace') for token in raw.split(b'\0') if token]


def current_topology() -> Optional[Topology]:
    """The torchrun topology this worker runs under (None when not started by torchrun)."""
    if 'TORCHELASTIC_RUN_ID' not in os.environ and 'LOCAL_WORLD_SIZE' not in os.environ:
        return None
    argv = _parent_argv()
    topology = topology_from_torchrun_argv(argv) if argv else None
    return topology if topology is not None else topology_from_env(os.environ)


def planned_topology(nnodes: int, nproc_per_node: int) -> Optional[Topology]:
    """The torchrun layout of a run planned for `nnodes` nodes (None for one node): a c10d rendezvous at MASTER_HOST,
    the first node's address, for the user to fill in."""
    if nnodes <= 1:
        return None
    return Topology(str(nnodes), str(nproc_per_node), rdzv_backend='c10d', rdzv_endpoint='MASTER_HOST:29500',
                    rdzv_id='timm-train')
