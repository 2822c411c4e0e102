import resource
import subprocess
import sys
import textwrap

import pytest
import torch

from timm_ext.oom import is_oom, should_retry


def _raised(fn) -> BaseException:
    try:
        fn()
    except BaseException as exc:  # noqa: B902 - the point is to capture the real exception
        return exc
    raise AssertionError('expected an exception')


def test_real_cpu_oom_under_rlimit_data_is_retried():
    # A real allocator failure: cap the data segment of a child process, then ask for far more than the cap.
    code = textwrap.dedent('''
        import resource, torch
        from timm_ext.oom import is_oom, should_retry
        with open('/proc/self/status') as f:
            vm_data = next(int(l.split()[1]) * 1024 for l in f if l.startswith('VmData:'))
        resource.setrlimit(resource.RLIMIT_DATA, (vm_data + (256 << 20), resource.RLIM_INFINITY))
        try:
            torch.empty(1 << 31, dtype=torch.float32)
        except RuntimeError as exc:
            print(type(exc).__name__, is_oom(exc), should_retry(exc), '|', str(exc).splitlines()[0][:160])
        x = torch.ones(1000)  # the process lives on after the failed allocation
        print('alive', float(x.sum()))
    ''')
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.strip().splitlines()
    assert first.split('|')[0].split() == ['RuntimeError', 'True', 'True']
    assert "can't allocate memory" in first
    assert second == 'alive 1000.0'


def test_oom_error_type_is_oom_whatever_the_message():
    assert is_oom(torch.OutOfMemoryError('allocation failed'))
    assert is_oom(MemoryError())
    assert should_retry(torch.OutOfMemoryError('allocation failed'))


def test_wrapped_oom_is_found():
    def compile_step():
        try:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes")
        except RuntimeError as inner:
            raise ValueError('backend compiler failed') from inner

    exc = _raised(compile_step)
    assert is_oom(exc) and should_retry(exc)


@pytest.mark.parametrize('message', [
    'CUDA out of memory. Tried to allocate 2.00 GiB',
    'CUDA error: out of memory',
    'cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input.',
    'MPS backend out of memory (MPS allocated: 1.2 GB)',
    'XPU out of memory. Tried to allocate 20.00 MiB',
    'GET was unable to find an engine to execute this computation',  # cuDNN under memory pressure, pytorch#108645
    # seen for real (mobilenetv3_large_100, 128 px, batch 64, 1 GiB cap, oneDNN off, steady heap): a ~40 s trial
    'posix_memalign failed:Cannot allocate memory (12)',
])
def test_backend_messages_are_oom(message):
    # These backends cannot be reached on a CPU machine: their exact messages stand in for them.
    exc = RuntimeError(message)
    assert is_oom(exc) and should_retry(exc)


def test_real_shape_mismatch_not_retried():
    exc = _raised(lambda: torch.nn.Linear(8, 4)(torch.randn(2, 5)))
    assert not is_oom(exc) and not should_retry(exc)


def test_real_dtype_mismatch_not_retried():
    exc = _raised(lambda: torch.ones(3, dtype=torch.long) @ torch.ones(3))
    assert not should_retry(exc)


def test_real_channels_last_rank_error_not_retried():
    exc = _raised(lambda: torch.randn(2, 3).to(memory_format=torch.channels_last))
    assert 'required rank' in str(exc)
    assert not should_retry(exc)


@pytest.mark.parametrize('message', [
    'CUDA error: an illegal memory access was encountered',
    'CUDA error: device-side assert triggered',
    'CUDA error: out of memory\nCUDA error: an illegal memory access was encountered',
])
def test_fatal_cuda_errors_never_retried(message):
    # No CUDA device here: the exact CUDA messages stand in for the real errors.
    assert not should_retry(RuntimeError(message))


@pytest.mark.parametrize('message', [
    'could not create a primitive descriptor for a convolution forward propagation primitive',
    'could not create a primitive',
    # The scratchpad allocation at execution: seen in the probe of tests/tune/test_img_sizes.py under its cap, but it
    # cannot be forced here on purpose. Every allocation of a cached primitive's execution that can fail comes after
    # the output tensor's, which PyTorch's own allocator makes and reports first ("DefaultCPUAllocator"); which one
    # a tight cap hits depends on oneDNN's choice of implementation for the CPU. The real text stands in.
    'could not execute a primitive',
    # C++'s operator new under the cap: seen in tests/tune/test_tune_batch.py's probe of test_vit under 2 MiB, once
    # in a fresh clone's run; like the scratchpad's, which allocation a tight cap hits first cannot be forced
    'std::bad_alloc',
])
def test_onednn_primitive_failure_is_oom_only_under_a_cpu_cap(message):
    # oneDNN's wording when an allocation fails under RLIMIT_DATA; without a cap the same words can mean anything.
    exc = RuntimeError(message)
    assert not is_oom(exc) and not should_retry(exc)
    assert is_oom(exc, cpu_capped=True) and should_retry(exc, cpu_capped=True)
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    assert soft == resource.RLIM_INFINITY, 'test needs an uncapped process'
    resource.setrlimit(resource.RLIMIT_DATA, (1 << 50, hard))  # a cap that binds nothing: the process is capped
    try:
        assert is_oom(exc) and should_retry(exc), 'the process\'s own limit decides when no caller says'
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def test_a_real_onednn_failure_under_a_cap_is_oom_for_the_probe_and_the_retries():
    # A fresh convolution shape under a cap at the current data segment: oneDNN cannot allocate its new primitive
    # and says "could not create a primitive", with no word of memory. The probe's trial, train.py's --oom-recover
    # and validate.py's --retry all judge it with timm_ext.oom; the same failure without the cap is not an OOM.
    code = textwrap.dedent('''
        import resource, torch
        torch.backends.mkldnn.enabled = True
        from timm_ext.memory import proc_status
        from timm_ext.oom import is_oom, should_retry
        from timm_ext.probe.measure import measured_trial
        from timm_ext.probe.table import OOM
        from timm_ext.train.oom_recovery import is_recoverable_oom
        conv, x = torch.nn.Conv2d(64, 64, 3, padding=1), torch.randn(1, 64, 28, 28)
        soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
        resource.setrlimit(resource.RLIMIT_DATA, (proc_status('VmData')['VmData'], hard))
        try:
            with torch.no_grad():
                conv(x)
        except RuntimeError as e:
            error = e
        # still capped, with room for the trial's peak-meter thread: the verdicts are judged under a cap in force
        resource.setrlimit(resource.RLIMIT_DATA, (proc_status('VmData')['VmData'] + (64 << 20), hard))
        trial = measured_trial(lambda b: (_ for _ in ()).throw(error), torch.device('cpu'), capped=True)(1)
        print(str(error).splitlines()[0], '|', is_oom(error), should_retry(error), is_recoverable_oom(error),
              trial.status == OOM)
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
        print('uncapped', is_oom(error), should_retry(error))
    ''')
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.strip().splitlines()
    message, verdicts = first.split(' | ')
    assert message == 'could not create a primitive', out.stdout
    assert verdicts.split() == ['True'] * 4
    assert second.split() == ['uncapped', 'False', 'False']


def test_cpu_data_capped_reads_the_real_limit():
    code = textwrap.dedent('''
        import resource
        from timm_ext.oom import cpu_data_capped
        before = cpu_data_capped()
        resource.setrlimit(resource.RLIMIT_DATA, (1 << 40, resource.RLIM_INFINITY))
        print(before, cpu_data_capped())
    ''')
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ['False', 'True']
