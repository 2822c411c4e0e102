"""The memory probe: the aimed search over batch sizes, training trials on train.py's own stack, the probe cache."""
from .cache import ProbeCache
from .search import search_batch_size
from .selection import select_batch_size
from .train_probe import probe_train_batch

__all__ = ['ProbeCache', 'probe_train_batch', 'search_batch_size', 'select_batch_size']
