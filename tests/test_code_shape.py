"""The layout rules of the library, checked on the code itself: layers import downwards only, nothing grows past the
size a reader can hold (a function of ~80 lines, a class of ~250, a probe module of ~300), and nothing is kept that
only the tests use."""
import ast

import pytest

from conftest import REPO_ROOT

MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 250
MAX_PROBE_MODULE_LINES = 300
SOURCES = sorted([*(REPO_ROOT / 'timm_ext').rglob('*.py'), *REPO_ROOT.glob('*.py')])
LIBRARY = sorted((REPO_ROOT / 'timm_ext').rglob('*.py'))
# what may use the library: the library itself, the scripts and the benches (tests/ never count)
USERS = sorted([*LIBRARY, *REPO_ROOT.glob('*.py'), *(REPO_ROOT / 'bench').glob('*.py')])
LAYERS_ABOVE_TRAINING = ('probe', 'tune', 'validate')


def imported_modules(tree: ast.AST, package: str) -> set:
    """Dotted names of the timm_ext modules a module imports (relative imports resolved against `package`)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split('.')[:len(package.split('.')) - node.level + 1]
                module = '.'.join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ''
            names.add(module)
            names.update(f'{module}.{alias.name}' for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {n for n in names if n.startswith('timm_ext')}


@pytest.mark.parametrize('path', SOURCES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_functions_and_classes_stay_readable(path):
    tree = ast.parse(path.read_text())
    too_long = []
    for node in ast.walk(tree):
        lines = getattr(node, 'end_lineno', 0) - getattr(node, 'lineno', 0) + 1
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and lines > MAX_FUNCTION_LINES:
            too_long.append(f'def {node.name}: {lines} lines')
        elif isinstance(node, ast.ClassDef) and lines > MAX_CLASS_LINES:
            too_long.append(f'class {node.name}: {lines} lines')
    assert not too_long, f'{path.name}: {too_long}'


# methods torch calls on our classes by name (TorchDispatchMode.ignore_compile_internals: TorchDynamo asks it)
TORCH_HOOKS = {'ignore_compile_internals'}


def defined_names(tree: ast.AST) -> set:
    """The functions, methods and classes a module defines (dunders and torch's hooks left out: they are called)."""
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return {node.name for node in ast.walk(tree)
            if isinstance(node, kinds) and not node.name.startswith('__') and node.name not in TORCH_HOOKS}


def referenced_names(tree: ast.AST) -> set:
    """Every name a module uses, bare (`f(x)`) or as an attribute (`obj.f`); a definition or an import is no use."""
    return ({node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
            | {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)})


@pytest.mark.parametrize('path', sorted([*(REPO_ROOT / 'timm_ext' / 'probe').glob('*.py'),
                                         *(REPO_ROOT / 'timm_ext' / 'memory_model').glob('*.py')]),
                         ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_probe_modules_stay_one_idea_long(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_PROBE_MODULE_LINES, f'{path.name}: {lines} lines; split it by job'


def test_every_library_function_is_used_outside_the_tests():
    """A function, method or class that nothing outside tests/ names is dead code: delete it with its tests, or use
    it. Names are matched, not resolved, so a name used for something else elsewhere hides a dead one; it never
    flags a live one."""
    used = set().union(*(referenced_names(ast.parse(path.read_text())) for path in USERS))
    unused = [f'{path.relative_to(REPO_ROOT)}: {name}' for path in LIBRARY
              for name in sorted(defined_names(ast.parse(path.read_text())) - used)]
    assert not unused, unused


def test_the_unused_check_sees_a_function_only_defined_and_exported():
    tree = ast.parse("__all__ = ['dead']\ndef dead(): pass\ndef live(): pass\nclass Box:\n    def size(self): pass\n"
                     "    def __len__(self): return 0\nBox().size()\nprint(live)\n")
    assert defined_names(tree) - referenced_names(tree) == {'dead'}


def test_training_imports_none_of_the_layers_built_on_it():
    offenders = []
    for path in (REPO_ROOT / 'timm_ext' / 'train').rglob('*.py'):
        package = 'timm_ext.train'
        for name in imported_modules(ast.parse(path.read_text()), package):
            if name.split('.')[1:2] and name.split('.')[1] in ('memory_model', *LAYERS_ABOVE_TRAINING):
                offenders.append(f'{path.name} imports {name}')
    assert not offenders, offenders


def test_shared_modules_import_no_layer():
    offenders = []
    for path in (REPO_ROOT / 'timm_ext').glob('*.py'):
        for name in imported_modules(ast.parse(path.read_text()), 'timm_ext'):
            if name.split('.')[1:2] and name.split('.')[1] in ('train', 'memory_model', *LAYERS_ABOVE_TRAINING):
                offenders.append(f'{path.name} imports {name}')
    assert not offenders, offenders


def test_the_import_check_sees_a_relative_import_upwards():
    tree = ast.parse('from ..tune.batch_choice import MIN_UPDATES\nfrom .loop import TrainLoop\n')
    assert imported_modules(tree, 'timm_ext.train') >= {'timm_ext.tune.batch_choice', 'timm_ext.train.loop'}


def test_the_memory_model_imports_none_of_the_layers_that_read_it():
    """The memory model is one package below the probe, the tuner and validate.py: they read it, never the reverse."""
    offenders = []
    for path in (REPO_ROOT / 'timm_ext' / 'memory_model').rglob('*.py'):
        for name in imported_modules(ast.parse(path.read_text()), 'timm_ext.memory_model'):
            if name.split('.')[1:2] and name.split('.')[1] in LAYERS_ABOVE_TRAINING:
                offenders.append(f'{path.name} imports {name}')
    assert not offenders, offenders
