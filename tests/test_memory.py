"""timm_ext.memory: budget parsing, real RLIMIT_DATA caps (in subprocesses), peak measurement, cap lifting."""
import logging
import subprocess
import sys
import textwrap
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from timm_ext import memory as memory_module
from timm_ext.memory import (BudgetError, MemoryBudget, PeakMeter, _VmDataSampler, format_bytes, parse_budget,
                              physical_memory)

from conftest import REPO_ROOT

linux_only = pytest.mark.skipif(sys.platform != 'linux', reason='CPU caps need Linux RLIMIT_DATA and /proc')


@pytest.mark.parametrize('text, expected', [
    ('12GiB', MemoryBudget(num_bytes=12 << 30)),
    ('12gib', MemoryBudget(num_bytes=12 << 30)),
    ('500MB', MemoryBudget(num_bytes=500 * 10 ** 6)),
    ('1.5G', MemoryBudget(num_bytes=int(1.5 * (1 << 30)))),
    ('64 MiB', MemoryBudget(num_bytes=64 << 20)),
    ('0.8', MemoryBudget(fraction=0.8)),
    ('1', MemoryBudget(fraction=1.0)),
    ('80%', MemoryBudget(fraction=0.8)),
])
def test_parse_budget(text, expected):
    assert parse_budget(text) == expected


@pytest.mark.parametrize('text, fragment', [
    ('12', 'has no unit'),
    ('1.5', 'has no unit'),
    ('0', 'must be positive'),
    ('-3GiB', 'not a size'),
    ('12 parsecs', 'unknown unit'),
    ('lots', 'not a size'),
    ('150%', 'more than 100%'),
])
def test_parse_budget_rejects(text, fragment):
    with pytest.raises(BudgetError, match=fragment) as info:
        parse_budget(text)
    assert '\n' not in str(info.value)


def test_format_bytes():
    assert format_bytes(None) == '-'
    assert format_bytes(512) == '512 B'
    assert format_bytes(3 << 20) == '3.00 MiB'
    assert format_bytes(int(1.5 * (1 << 30))) == '1.50 GiB'


@linux_only
def test_budget_larger_than_device_is_an_error():
    too_big = MemoryBudget(num_bytes=physical_memory('cpu') * 4)
    with pytest.raises(BudgetError, match='larger than'):
        too_big.resolve('cpu')
    assert MemoryBudget(fraction=0.5).resolve('cpu') > 0


def run_python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter (a cap must never land on the test process)."""
    return subprocess.run([sys.executable, '-c', textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO_ROOT, env={'PYTHONPATH': str(REPO_ROOT), 'OMP_NUM_THREADS': '1'})


@linux_only
def test_cpu_cap_gives_a_real_catchable_oom_and_is_lifted():
    result = run_python('''
        import resource, torch
        from timm_ext.memory import memory_cap
        from timm_ext.oom import is_oom
        before = resource.getrlimit(resource.RLIMIT_DATA)
        with memory_cap('cpu', 64 << 20) as cap:
            inside = resource.getrlimit(resource.RLIMIT_DATA)
            small = torch.ones(4 << 20, dtype=torch.uint8)      # 4 MiB: fits
            try:
                torch.ones(256 << 20, dtype=torch.uint8)         # 256 MiB: over the cap
                print('NO-OOM')
            except RuntimeError as e:
                print('OOM', is_oom(e))
        after = resource.getrlimit(resource.RLIMIT_DATA)
        print('capped', inside[0] != before[0], 'restored', after == before)
        print('big-after', torch.ones(256 << 20, dtype=torch.uint8).numel() == 256 << 20)
    ''')
    assert result.returncode == 0, result.stderr
    assert 'OOM True' in result.stdout
    assert 'capped True restored True' in result.stdout
    assert 'big-after True' in result.stdout


@linux_only
def test_cap_is_lifted_on_keyboard_interrupt():
    result = run_python('''
        import resource
        from timm_ext.memory import memory_cap
        before = resource.getrlimit(resource.RLIMIT_DATA)
        try:
            with memory_cap('cpu', 32 << 20):
                raise KeyboardInterrupt
        except KeyboardInterrupt:
            pass
        print('restored', resource.getrlimit(resource.RLIMIT_DATA) == before)
    ''')
    assert result.returncode == 0, result.stderr
    assert 'restored True' in result.stdout


@linux_only
def test_the_cap_reports_the_bytes_in_force_under_a_lower_hard_limit():
    result = run_python('''
        import resource
        from timm_ext.memory import memory_cap, proc_status
        hard = proc_status('VmData')['VmData'] + (64 << 20)
        resource.setrlimit(resource.RLIMIT_DATA, (hard, hard))  # a job limit below what the budget asks
        with memory_cap('cpu', 1 << 30) as cap:
            print('in force', round(cap.budget / (1 << 20)))
    ''')
    assert result.returncode == 0, result.stderr
    in_force = int(result.stdout.split('in force ')[1].split()[0])
    assert 60 <= in_force <= 64, result.stdout  # MiB: what the hard limit leaves, not the 1 GiB asked


@linux_only
def test_peak_meter_measures_what_the_cap_counts():
    result = run_python('''
        import torch
        from timm_ext.memory import PeakMeter, memory_cap
        with memory_cap('cpu', 512 << 20) as cap:
            meter = PeakMeter('cpu', cap.baseline)
            meter.reset()
            x = torch.ones(96 << 20, dtype=torch.uint8)  # 96 MiB held for a while, then freed
            for _ in range(20):
                x.add_(1)
            del x
            peak = meter.peak()
            meter.reset()
            y = torch.ones(8 << 20, dtype=torch.uint8)
            y.add_(1)
            small = meter.peak()
        print(peak >> 20, small >> 20)
    ''')
    assert result.returncode == 0, result.stderr
    peak_mib, small_mib = map(int, result.stdout.split())
    assert 96 <= peak_mib < 96 + 16
    assert 8 <= small_mib < peak_mib


def test_a_sample_read_before_a_restart_never_lands_after_it():
    # the sampler reads VmData, then records it: on a loaded machine a restart (the next trial's window) can fall
    # between the two, and the previous window's peak must not be recorded into the new one
    sampler = _VmDataSampler(0.0001)
    inside, release = threading.Event(), threading.Event()
    sampled = []

    def read() -> int:
        if threading.current_thread() is sampler._thread and not sampled:
            sampled.append(1)
            inside.set()
            release.wait(5)  # held inside the read until the main thread has tried to stop and restart
            return 100
        return 1

    sampler.read = read
    sampler.restart()
    assert inside.wait(5)
    stopper = threading.Thread(target=lambda: sampled.append(sampler.stop()))
    stopper.start()
    release.set()
    stopper.join(5)
    assert sampled[-1] == 100  # the first window keeps its own sample
    sampler.restart()
    time.sleep(0.01)
    assert sampler.stop() == 1  # the new window saw only its own samples


# ---- CUDA budgets and peaks: no GPU here, so the few torch.cuda queries involved are replaced ----------------------

GIB = 1 << 30
CUDA1 = torch.device('cuda', 1)


@pytest.fixture
def busy_gpu(monkeypatch):
    """An 80 GiB GPU of which 30 GiB are free; this process's allocator holds 10 GiB of the rest."""
    monkeypatch.setattr(torch.cuda, 'get_device_properties', lambda d: SimpleNamespace(total_memory=80 * GIB))
    monkeypatch.setattr(torch.cuda, 'get_device_name', lambda d: 'Test GPU')
    monkeypatch.setattr(torch.cuda, 'mem_get_info', lambda d: (30 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, 'memory_reserved', lambda d: 10 * GIB)
    monkeypatch.setattr(memory_module, '_OVER_AVAILABLE_WARNED', set())  # a fresh process's warnings


def test_cuda_fraction_is_of_what_the_device_can_still_give(busy_gpu):
    assert MemoryBudget(fraction=0.5).resolve(CUDA1) == 20 * GIB  # half of 30 free + 10 held, not half of 80


def test_cuda_size_above_what_is_free_warns_and_above_the_device_fails(busy_gpu, caplog):
    with caplog.at_level(logging.WARNING, logger='timm_ext.memory'):
        assert MemoryBudget(num_bytes=50 * GIB).resolve(CUDA1) == 50 * GIB
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and '50.00 GiB' in warnings[0] and '40.00 GiB' in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger='timm_ext.memory'):  # tune_batch resolves it for every probe
        assert MemoryBudget(num_bytes=50 * GIB).resolve(CUDA1) == 50 * GIB
    assert not caplog.records, 'the same budget on the same device is warned about once'
    with caplog.at_level(logging.WARNING, logger='timm_ext.memory'):
        MemoryBudget(num_bytes=40 * GIB).resolve(CUDA1)
    assert not caplog.records
    with pytest.raises(BudgetError, match='larger than'):
        MemoryBudget(num_bytes=81 * GIB).resolve(CUDA1)


def test_cuda_peak_is_reserved_memory_the_cap_limits(monkeypatch):
    monkeypatch.setattr(torch.cuda, 'synchronize', lambda d=None: None)
    monkeypatch.setattr(torch.cuda, 'max_memory_allocated', lambda d=None: 3 * GIB)
    monkeypatch.setattr(torch.cuda, 'max_memory_reserved', lambda d=None: 4 * GIB)
    assert PeakMeter(CUDA1).peak() == 4 * GIB


@pytest.mark.skipif(torch.cuda.is_available(), reason='here the CUDA calls work; bench/gpu_check.sh breaks a real '
                                                      'context (a device-side assert) to show the same')
def test_cleanup_after_a_failure_does_not_raise_again_where_the_device_raises():
    # a CPU build raises from every CUDA call, as a context broken by an illegal access does: the real raise we can
    # have without a GPU
    with pytest.raises(Exception):
        memory_module.free_memory('cuda')
    assert memory_module.free_memory_after_failure('cuda') is False
    assert memory_module.device_broken('cuda')
    assert memory_module.free_memory_after_failure('cpu') is True
    assert not memory_module.device_broken('cpu')


HEAP_AFTER_A_FREED_BLOCK = textwrap.dedent('''
    import resource, sys
    import torch
    from timm_ext.distributed import init_device
    from timm_ext.memory import proc_status
    from timm_ext.train.args import parse_args
    if sys.argv[1] == 'capped':  # a run started under a data-segment cap (one that binds nothing here)
        resource.setrlimit(resource.RLIMIT_DATA, (1 << 50, resource.getrlimit(resource.RLIMIT_DATA)[1]))
    if sys.argv[1] in ('train.py', 'capped', 'flag'):  # set up the CPU device as train.py does
        init_device(parse_args(['--device', 'cpu', *(['--steady-cpu-heap'] if sys.argv[1] == 'flag' else [])])[0])
    big = torch.ones(8 << 20, dtype=torch.uint8)
    del big  # glibc's dynamic threshold now puts blocks up to 8 MiB on the heap
    before = proc_status('VmData')['VmData']
    block = torch.ones(4 << 20, dtype=torch.uint8)
    del block
    print(proc_status('VmData')['VmData'] - before)
''')


@pytest.mark.skipif(sys.platform != 'linux', reason='glibc and /proc')
def test_a_capped_cpu_run_hands_freed_blocks_back_so_its_peak_is_the_same_in_every_process():
    def kept(how):
        env = {'PYTHONPATH': str(REPO_ROOT), 'OMP_NUM_THREADS': '1', 'PATH': '/usr/bin:/bin'}
        done = subprocess.run([sys.executable, '-c', HEAP_AFTER_A_FREED_BLOCK, how], capture_output=True, text=True,
                              env=env, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        return int(done.stdout.split()[-1])

    # uncapped, train.py keeps glibc's heap as it comes (a fixed threshold, every large block a fresh mapping, costs
    # speed: resnet18's CPU step took 1.4-1.6x as long): most of the freed 4 MiB stays in the data segment a cap counts
    # (margin: the block may reuse some free heap that was already there)
    assert kept('train.py') >= 3 << 20
    assert kept('capped') < 1 << 20  # under a cap the steady heap: mapped, and unmapped when freed
    assert kept('flag') < 1 << 20  # and with --steady-cpu-heap, which a train command tuned under a CPU budget has


FREE_HEAP_THEN_A_BLOCK = textwrap.dedent('''
    import sys
    import torch
    from timm_ext.memory import data_and_stack, free_heap_held, steady_cpu_heap
    torch.ones(1 << 20)  # a freed 4 MiB mapping: glibc's dynamic threshold rises above it
    blocks = [torch.ones(1 << 20) for _ in range(16)]  # so these 64 MiB come from the heap
    del blocks[:-1]  # freed below the last, they stay heap a later block can take without the data segment growing
    steady_cpu_heap()
    with free_heap_held() if sys.argv[1] == 'held' else open('/dev/null') as held:
        before = data_and_stack()
        block = torch.ones(1 << 20)  # 4 MiB
        print(data_and_stack() - before, held if sys.argv[1] == 'held' else 0)
''')


@pytest.mark.skipif(sys.platform != 'linux', reason='glibc and /proc')
def test_a_trial_in_a_process_with_free_heap_counts_its_blocks_as_a_fresh_process_would():
    def grown(how):
        done = subprocess.run([sys.executable, '-c', FREE_HEAP_THEN_A_BLOCK, how], capture_output=True, text=True,
                              env={'PYTHONPATH': str(REPO_ROOT), 'OMP_NUM_THREADS': '1', 'PATH': '/usr/bin:/bin'},
                              timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        return [int(word) for word in done.stdout.split()[-2:]]

    assert grown('free')[0] < 1 << 20  # the 4 MiB came from free heap: a trial there would read near zero
    block, held = grown('held')
    assert block >= 4 << 20 and held >= 32 << 20  # the free heap held, the block is new memory, as in a fresh process


def test_a_run_tuned_under_a_cpu_budget_trains_on_the_heap_its_trials_measured():
    glibc = memory_module._glibc() is not None
    assert memory_module.trains_on_steady_heap('cpu', True) is glibc
    assert not memory_module.trains_on_steady_heap('cpu', False)  # no budget asked: stock's heap and speed
    assert not memory_module.trains_on_steady_heap('cuda', True)


@pytest.mark.skipif(sys.platform != 'linux', reason='glibc and /proc')
def test_the_probe_fixes_the_heap_in_its_trial_children_only():
    # the trials' peaks choose the batch, so they are steady; the tune process itself, which trains afterwards in the
    # same process, keeps glibc's dynamic threshold (there is no way back from a fixed one)
    code = textwrap.dedent('''
        import torch
        from timm_ext import memory
        from timm_ext.distributed import init_device
        from timm_ext.child_process import call_forked
        from timm_ext.probe.trial import build_train_trial
        from timm_ext.train.args import parse_args
        args, device = init_device(parse_args(['--model', 'test_resnet', '--device', 'cpu', '--img-size', '32'])[0])
        setup = build_train_trial(args, device)
        def child():
            setup.reset()
            return memory._STEADY[0]
        print(call_forked(child)[0], memory._STEADY[0], memory.default_headroom('cpu'))
    ''')
    env = {'PYTHONPATH': str(REPO_ROOT), 'OMP_NUM_THREADS': '1', 'PATH': '/usr/bin:/bin'}
    done = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ['True', 'False', '0.05']
