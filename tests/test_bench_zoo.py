"""bench/bench_zoo.py's compiled mode: the child gets the flag, the CSV is its own, the report gives the share of
families that trace compiled."""
import sys

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / 'bench'))
import bench_zoo  # noqa: E402


def _row(family: str, mode: str, status: str) -> dict:
    return dict(family=family, model=f'{family}_t', mode=mode, status=status, error='' if status == 'ok' else 'X',
                message='', seconds='1.0')


def test_the_compiled_report_gives_the_share_of_families_that_trace_in_every_mode():
    rows = [_row('a', 'validate', 'ok'), _row('a', 'train', 'ok'), _row('b', 'validate', 'ok'),
            _row('b', 'train', 'error'), _row('c', 'validate', 'ok')]
    lines = bench_zoo.report(rows, 'inductor')
    assert lines[0] == 'families: 3 (torch.compile inductor)'
    assert 'families that trace compiled in every mode: 2/3 (66.7%)' in lines
    assert 'train: 1/2 ok (50.0%)' in lines


def test_the_child_traces_compiled_as_tune_batch_plans_it(monkeypatch):
    """`--torchcompile` reaches the child's command line and, there, the estimate's arguments."""
    seen = {}

    def run(command, **kwargs):
        seen['command'] = command
        raise bench_zoo.subprocess.TimeoutExpired(command, 1)
    monkeypatch.setattr(bench_zoo.subprocess, 'run', run)
    assert bench_zoo.run_child('resnet18', 'train', (2, 4), 1, 'inductor')['status'] == 'timeout'
    assert seen['command'][-2:] == ['--torchcompile', 'inductor']

    import timm_ext.memory_model.estimate as estimate
    monkeypatch.setattr(estimate, 'estimate_memory', lambda args, *a, **k: seen.update(args=args))
    assert bench_zoo.trace_one('resnet18', 'validate', (2, 4), 'inductor')['status'] == 'ok'
    assert seen['args'].torchcompile == 'inductor' and seen['args'].model == 'resnet18'
    assert bench_zoo.trace_one('resnet18', 'validate', (2, 4))['status'] == 'ok'
    assert not seen['args'].torchcompile
