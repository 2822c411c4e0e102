"""tune_batch.py's library: the global batch by time to the recipe's result, its plan, the YAML, the hand-over."""
from .batch_choice import choose_global_batch
from .critical_batch import measure_noise_scale
from .plan import plan_global_batch, plan_run

__all__ = ['choose_global_batch', 'measure_noise_scale', 'plan_global_batch', 'plan_run']
