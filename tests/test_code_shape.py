"""The layout rules of the library, checked on the code itself: layers import downwards only, and nothing grows past
the size a reader can hold (a function of ~80 lines, a class of ~250)."""
import ast

import pytest

from conftest import REPO_ROOT

MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 250
SOURCES = sorted([*(REPO_ROOT / 'timm_ext').rglob('*.py'), *REPO_ROOT.glob('*.py')])
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


def test_training_imports_none_of_the_layers_built_on_it():
    offenders = []
    for path in (REPO_ROOT / 'timm_ext' / 'train').rglob('*.py'):
        package = 'timm_ext.train'
        for name in imported_modules(ast.parse(path.read_text()), package):
            if name.split('.')[1:2] and name.split('.')[1] in LAYERS_ABOVE_TRAINING:
                offenders.append(f'{path.name} imports {name}')
    assert not offenders, offenders


def test_shared_modules_import_no_layer():
    offenders = []
    for path in (REPO_ROOT / 'timm_ext').glob('*.py'):
        for name in imported_modules(ast.parse(path.read_text()), 'timm_ext'):
            if name.split('.')[1:2] and name.split('.')[1] in ('train', *LAYERS_ABOVE_TRAINING):
                offenders.append(f'{path.name} imports {name}')
    assert not offenders, offenders


def test_the_import_check_sees_a_relative_import_upwards():
    tree = ast.parse('from ..tune.batch_choice import MIN_UPDATES\nfrom .loop import TrainLoop\n')
    assert imported_modules(tree, 'timm_ext.train') >= {'timm_ext.tune.batch_choice', 'timm_ext.train.loop'}
