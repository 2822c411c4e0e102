"""The probe and the global-batch decision as a picture, next to the tuned YAML (only when matplotlib is installed).

Left: samples/s and peak memory of every trial by micro-batch, the chosen one marked. Right, when bigger global
batches were judged: the predicted time to the recipe's result of each candidate, the recipe's and the chosen one
marked. The text report holds the same figures; this is for looking at.
"""
import os
from typing import Optional, Sequence

__all__ = ['write_probe_plot']


def write_probe_plot(path: str, trials: Sequence, chosen_micro: int, choice=None) -> Optional[str]:
    """Draw the trials (and the candidates of `choice`, a `GlobalBatchChoice`) to `path`; returns `path`, or None
    when matplotlib is not installed."""
    try:
        import matplotlib
        import matplotlib.ticker
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fits = sorted((t for t in trials if t.fits and t.samples_per_s), key=lambda t: t.batch_size)
    panels = 2 if choice is not None and len(choice.candidates) > 1 else 1
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4), squeeze=False)
    speed_ax = axes[0][0]
    speed_ax.plot([t.batch_size for t in fits], [t.samples_per_s for t in fits], 'o-', label='samples/s')
    speed_ax.axvline(chosen_micro, color='green', linestyle='--', label=f'micro-batch {chosen_micro}')
    failed = [t.batch_size for t in trials if not t.fits]
    if failed:
        speed_ax.axvline(min(failed), color='red', linestyle=':', label=f'first failure {min(failed)}')
    speed_ax.set_xscale('log', base=2)
    speed_ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    speed_ax.set_xlabel('micro-batch')
    speed_ax.set_ylabel('samples/s')
    peaks = [(t.batch_size, t.peak_bytes / 2 ** 20) for t in fits if t.peak_bytes]
    if peaks:
        memory_ax = speed_ax.twinx()
        memory_ax.plot(*zip(*peaks), 's:', color='gray', label='peak MiB')
        memory_ax.set_ylabel('peak memory (MiB)')
    speed_ax.legend(loc='upper left', fontsize='small')
    speed_ax.set_title('probe trials')
    if panels == 2:
        ax = axes[0][1]
        positions = range(len(choice.candidates))
        ax.bar(positions, [c.predicted_s for c in choice.candidates],
               color=['green' if c == choice.chosen else 'lightgray' for c in choice.candidates])
        ax.set_xticks(list(positions), [str(c.global_batch) for c in choice.candidates])
        ax.set_xlabel('global batch')
        ax.set_ylabel('predicted time to the recipe\'s result (s)')
        ax.set_title('global batches judged (green: chosen)')
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)  # drawn before the YAML beside it is written
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
