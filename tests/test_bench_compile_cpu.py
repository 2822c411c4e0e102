"""bench/bench_compile_cpu.py's pieces: what counts as the cap's failure, where its search starts, what a trial held,
and its train.py worker on a tiny model."""
import json
import os
import subprocess
import sys

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / 'bench'))
import bench_compile_cpu  # noqa: E402

# a trial's record as the worker writes it (resnet18 at 96 px, --torchcompile, batch 16, measured here)
COMPILED_RECORD = dict(baseline_mib=937.9, peak_mib=361.6, windows=[
    dict(window='before compile 0', peak_mib=4.3, after_mib=3.9),
    dict(window='compile 0 (dynamo)', peak_mib=163.5, after_mib=162.7),
    dict(window='before compile 1', peak_mib=266.3, after_mib=257.5),
    dict(window='compile 1 (lazy_backward)', peak_mib=272.2, after_mib=272.0),
    dict(window='update 0', peak_mib=302.0, after_mib=243.2),
    dict(window='update 1', peak_mib=361.6, after_mib=243.2, threads=13),
])


def test_the_caps_failures_are_told_from_other_failures():
    """RLIMIT_DATA counts every private writable mapping (Linux mm/mmap.c `is_data_mapping`), a new thread's stack
    included, so under the cap a compile can fail to start a thread (CPython's `_thread.start_new_thread`: "can't
    start new thread"; seen here in inductor's compile of resnet18) as well as to allocate (ATen's
    DefaultCPUAllocator, Python's MemoryError). A compile error of another kind must not pass for the cap's."""
    for text in ("InductorError: RuntimeError: can't start new thread",
                 "RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to allocate 9437184 bytes.",
                 'MemoryError', 'OSError: [Errno 12] Cannot allocate memory', 'std::bad_alloc',
                 'cc1plus: out of memory allocating 65536 bytes'):
        assert bench_compile_cpu.OUT_OF_MEMORY.search(text), text
    assert not bench_compile_cpu.OUT_OF_MEMORY.search('CppCompileError: C++ compile error: undefined reference')


def test_the_search_starts_where_the_uncapped_trials_growth_reaches_the_budget():
    # 243.2 MiB stays after the updates; (361.6 - 243.2) / 16 = 7.4 MiB a sample: (512 - 243.2) / 7.4 = 36.3
    assert bench_compile_cpu.start_guess(COMPILED_RECORD, 16, 512) == 36
    assert bench_compile_cpu.start_guess(COMPILED_RECORD, 16, 200) == 1  # the compiles' state alone is over it


def test_what_a_compiled_process_holds_before_its_first_step():
    held = bench_compile_cpu.held_before_step(COMPILED_RECORD)
    assert held == dict(epoch_start_mib=937.9, after_first_compile_mib=162.7, compile_peak_mib=272.2,
                        after_updates_mib=243.2, step_peak_mib=361.6, threads=13)
    eager = dict(COMPILED_RECORD, windows=COMPILED_RECORD['windows'][4:])
    assert bench_compile_cpu.held_before_step(eager)['after_first_compile_mib'] == 0.0


# tune_batch.py --estimate's report, its two tables (resnet18 at 96 px, --torchcompile, 512 MiB, no headroom)
REPORT = '''Predicted peak per micro-batch:
  batch      weights    optimizer  activations  temporaries      runtime        peak  of budget
     22    42.68 MiB    42.64 MiB    51.18 MiB    58.92 MiB    32.00 MiB  184.74 MiB        36%
    112    42.68 MiB    42.64 MiB   306.57 MiB    85.99 MiB    32.00 MiB    1.02 GiB        91%

What fits where:
    budget  fits up to  micro-batch  accum  global        LR  predicted peak  eval batch
    512MiB         112           64      2     128      0.05      359.20 MiB         460
'''


def test_the_estimates_answer_and_its_peaks_are_read_from_its_report():
    assert bench_compile_cpu.fits_up_to(REPORT, 512) == 112
    assert bench_compile_cpu.fits_up_to(REPORT, 256) is None
    assert bench_compile_cpu.predicted_peaks(REPORT) == {22: 184.74, 112: 1044.48}


def test_a_line_through_peaks_splits_what_stays_from_what_grows():
    assert bench_compile_cpu.line_through({10: 110.0, 20: 120.0, 30: 130.0}) == dict(fixed_mib=100.0,
                                                                                    per_sample_mib=1.0)
    assert bench_compile_cpu.line_through({10: 110.0}) is None


def test_an_epoch_is_cut_to_its_first_batches():
    cut = bench_compile_cpu._FirstBatches(list(range(10)), 3)
    assert len(cut) == 3 and list(cut) == [0, 1, 2]
    assert len(bench_compile_cpu._FirstBatches([0], 3)) == 1


def test_the_train_worker_records_each_update_and_ends_before_evaluation(tmp_path):
    from timm_ext.synthetic_data import make_image_folder
    make_image_folder(tmp_path / 'data', size=32, per_class=4)
    result = tmp_path / 'result.json'
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / 'bench' / 'bench_compile_cpu.py'), '--train-worker', '2', '--',
         '--data-dir', str(tmp_path / 'data'), *bench_compile_cpu.COMMON, '--model', 'test_resnet', '--img-size',
         '32', '-b', '4', '--output', str(tmp_path / 'out'), '--experiment', 'run'],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, 'OMP_NUM_THREADS': '1', bench_compile_cpu.RESULT_ENV: str(result)})
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(result.read_text())
    assert record['updates_done'] == 2 and [w['window'] for w in record['windows']] == ['update 0', 'update 1']
    assert 'Test:' not in done.stdout + done.stderr  # no evaluation ran
