"""A compiled plan as a user runs it: no warning of torch's own, and every family's graphs trace.

Two faults of the compiled trace (issue 45): every compiled plan printed torch's "TF32 acceleration on top of oneDNN"
UserWarning (the layout heuristic was asked under `torch.backends.mkldnn.flags`, which sets oneDNN's TF32 flag too),
and MetaFormers, ConvNeXt-V2 and XCiT failed with "Guard failed on the same frame it was created" (TorchDynamo found
no function in CudaAutocastCasts' sets when it reached the function through a tensor the graph computed).
"""
import torch

from conftest import run_script
from timm_ext.memory_model.autocast_casts import CudaAutocastCasts

PLAN = ('--amp', '--device', 'cuda', '--gpu', 'rtx4090', '--torchcompile', '--estimate', '--img-size', '32')


def _torch_warnings(text: str) -> list:
    return [line for line in text.splitlines() if 'Warning' in line]


def test_a_compiled_plan_prints_no_warning_of_torchs():
    done = run_script('validate.py', '--model', 'test_convnext', *PLAN)
    assert done.returncode == 0, done.stderr[-2000:]
    assert 'Compiled step:' in done.stdout
    assert _torch_warnings(done.stdout + done.stderr) == []


def _grn_like(x: torch.Tensor) -> torch.Tensor:
    """ConvNeXt-V2's GlobalResponseNorm in short: `Tensor.norm` of a tensor the graph computed (reached without a
    source, where TorchDynamo hashed the function by its own tracker)."""
    y = x * 2
    return y.norm(p=2, dim=(1,), keepdim=True)


def test_a_cast_function_reached_through_a_computed_tensor_traces_and_casts_as_eager():
    x = torch.randn(4, 8)
    with CudaAutocastCasts(), torch.autocast('cpu', dtype=torch.bfloat16):
        eager = _grn_like(x.bfloat16())
        torch._dynamo.reset()
        try:
            compiled = torch.compile(_grn_like, backend='eager', fullgraph=True)(x.bfloat16())
        finally:
            torch._dynamo.reset()
    assert eager.dtype == compiled.dtype == torch.float32  # norm's output in float32, as CUDA autocast gives it


def test_convnextv2_traces_compiled():
    """The smallest model of a family that failed ("Guard failed on the same frame it was created")."""
    done = run_script('validate.py', '--model', 'convnextv2_atto', *PLAN)
    assert done.returncode == 0, done.stderr[-2000:]
    assert 'torch.compile inductor, traced on fake tensors' in done.stdout


def test_what_torch_warns_while_the_step_is_traced_stays_out_of_the_plan(monkeypatch):
    """aimv2's compiled plan printed torch's rms_norm warning ("Mismatch dtype between input and weight ... Cannot
    dispatch to fused implementation", raised from torch/_dynamo/utils.py while TorchDynamo runs the op): the run
    will print it, the plan does not. A warning of the project's own still comes through."""
    import warnings

    from timm_ext.errors import TimmExtError
    from timm_ext.memory_model import estimate

    def step_that_warns(*args):
        warnings.warn_explicit('Mismatch dtype between input and weight', UserWarning, 'utils.py', 1,
                               module='torch._dynamo.utils')
        warnings.warn_explicit('a note of ours', UserWarning, 'estimate.py', 1, module='timm_ext.memory_model')
        raise TimmExtError('stopped after warning')
    monkeypatch.setattr(estimate, '_trace', step_that_warns)
    monkeypatch.setattr(estimate, 'run_device', lambda *args: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        reply = estimate._traced_reply(None, 'cuda', False, (2, 4), 'validate')
    assert reply == dict(error='stopped after warning')
    assert [str(w.message) for w in caught] == ['a note of ours']
