"""What a plan says of `--torchcompile-mode reduce-overhead` / `max-autotune`, and the installed torch's CUDA graph
trees that it describes (`torch/_inductor/cudagraph_trees.py`): one pool per device, static input copies in it, and
what the pool keeps between steps."""
import inspect

import pytest

from timm_ext.memory_model.compiled_step import unmodelled


@pytest.mark.parametrize('mode', ['reduce-overhead', 'max-autotune'])
def test_the_plan_says_what_cuda_graph_trees_would_hold(mode):
    graphs = unmodelled('inductor', mode)[0]
    assert graphs.startswith(f"{mode}'s CUDA graphs (planned without them")
    for fact in ('torch/_inductor/cudagraph_trees.py', 'one memory pool per device', 'static copy of each input',
                 'keeps its segments and the last outputs between steps'):
        assert fact in graphs
    assert 'private pool per graph' not in graphs and 'pools' not in graphs
    assert not any('CUDA graph' in note for note in unmodelled('inductor', 'max-autotune-no-cudagraphs'))


def test_the_installed_cuda_graph_trees_allocate_as_the_plan_says():
    """The facts the text names, read in the installed source: one tree manager per device, whose one pool every
    warm-up and recording node takes; recording copies each non-static input into a static buffer of that pool."""
    trees = pytest.importorskip('torch._inductor.cudagraph_trees')
    assert 'if device_index not in container_dict' in inspect.getsource(trees.get_container)
    manager = inspect.getsource(trees.CUDAGraphTreeManager)
    assert manager.count('torch.cuda.graph_pool_handle()') == 1
    assert manager.count('self.cuda_graphs_thread_pool,') >= 2  # the warm-up node's and the recorded node's pool
    recording = inspect.getsource(trees.CUDAGraphNode._allocate_and_copy_recording_inputs)
    assert 'static_input(inp)' in recording and 'mem_pool=self.cuda_graphs_pool' in recording
    assert 'cached_tensor_outputs' in inspect.getsource(trees.CUDAGraphNode)  # the outputs the pool keeps
