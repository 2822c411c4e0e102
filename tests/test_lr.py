import math

import pytest
import timm.optim

from timm_ext.lr import rescale_lr, resolve_lr

# Every timm optimizer whose name stock train.py scales linearly (no 'ada' or 'lamb' in it), written out by hand.
LINEAR_BY_NAME = {
    'adopt', 'adoptc', 'adoptw', 'bnbademamix', 'bnbademamix8bit', 'bnblion', 'bnblion8bit', 'bnbsgd', 'bnbsgd8bit',
    'cadopt', 'cadoptc', 'cadoptw', 'claprop', 'clion', 'clionc', 'cmars', 'crmsproptf', 'csgdc', 'csgdp', 'csgdw',
    'fusednovograd', 'fusedsgd', 'kron', 'kronc', 'kronw', 'laprop', 'lapropc', 'larc', 'lars', 'lion', 'lionc',
    'madgrad', 'madgradw', 'mars', 'momentum', 'muon', 'nesterov', 'nesterovw', 'nlarc', 'nlars', 'nmuon', 'novograd',
    'novogradc', 'novogradw', 'rmsprop', 'rmsproptf', 'rmsproptfc', 'rmsproptfw', 'sgd', 'sgdc', 'sgdp', 'sgdw',
}
# Of those, the SGD-like ones: no hint expected.
SGD_LIKE = {'bnbsgd', 'bnbsgd8bit', 'csgdc', 'csgdp', 'csgdw', 'fusedsgd', 'larc', 'lars', 'momentum', 'nesterov',
            'nesterovw', 'nlarc', 'nlars', 'sgd', 'sgdc', 'sgdp', 'sgdw'}


@pytest.mark.parametrize('opt', timm.optim.list_optimizers())
def test_stock_rule_for_every_timm_optimizer(opt):
    # 128 per rank x 4 ranks x 2 accum = 1024 = 4 x lr_base_size
    choice = resolve_lr(None, 0.1, 256, '', opt, batch_size=128, world_size=4, grad_accum_steps=2)
    assert choice.global_batch == 1024 and choice.from_base
    if opt in LINEAR_BY_NAME:
        assert choice.scale == 'linear' and choice.lr == pytest.approx(0.4)
    else:
        assert choice.scale == 'sqrt' and choice.lr == pytest.approx(0.2)
    assert (choice.hint is not None) == (opt in LINEAR_BY_NAME - SGD_LIKE)


def test_message_states_lr_base_global_batch_and_rule():
    choice = resolve_lr(None, 5e-4, 512, '', 'adamw', batch_size=64, world_size=2, grad_accum_steps=4)
    assert choice.lr == pytest.approx(5e-4)  # 512 / 512
    for part in ('0.0005', 'sqrt', '512', 'adamw'):
        assert part in choice.message
    assert choice.hint is None


def test_explicit_scale_overrides_name_rule():
    choice = resolve_lr(None, 0.1, 256, 'sqrt', 'lion', batch_size=1024)
    assert choice.scale == 'sqrt' and choice.lr == pytest.approx(0.2) and choice.hint is None
    choice = resolve_lr(None, 0.1, 256, 'linear', 'adamw', batch_size=64)
    assert choice.lr == pytest.approx(0.025)


def test_given_lr_wins_like_stock():
    choice = resolve_lr(0.3, 0.1, 256, '', 'sgd', batch_size=4096, world_size=8)
    assert choice.lr == 0.3 and not choice.from_base and choice.scale == ''
    # Stock tests `not args.lr`, so --lr 0 falls back to base scaling too.
    assert resolve_lr(0.0, 0.1, 256, '', 'sgd', batch_size=512).lr == pytest.approx(0.2)


def test_fractional_policy_average_batch():
    choice = resolve_lr(None, 0.1, 256, 'linear', 'sgd', batch_size=96.5)
    assert choice.lr == pytest.approx(0.1 * 96.5 / 256)


@pytest.mark.parametrize('kwargs, name', [
    (dict(batch_size=0), 'batch_size'),
    (dict(batch_size=-8), 'batch_size'),
    (dict(batch_size=8, world_size=0), 'world_size'),
    (dict(batch_size=8, grad_accum_steps=0), 'grad_accum_steps'),
])
def test_rejects_non_positive_sizes(kwargs, name):
    with pytest.raises(ValueError, match=name):
        resolve_lr(None, 0.1, 256, '', 'sgd', **kwargs)


def test_rejects_unknown_scale_naming_allowed_values():
    with pytest.raises(ValueError, match=r"lr_base_scale.*'linear', 'sqrt'.*'cubic'"):
        resolve_lr(None, 0.1, 256, 'cubic', 'sgd', batch_size=8)


def test_rescale():
    assert rescale_lr(0.1, 256, 1024, 'linear') == pytest.approx(0.4)
    assert rescale_lr(0.1, 256, 1024, 'sqrt') == pytest.approx(0.2)
    assert rescale_lr(0.1, 1000, 992, 'sqrt') == pytest.approx(0.1 * math.sqrt(0.992))
    with pytest.raises(ValueError, match='scale'):
        rescale_lr(0.1, 256, 512, '')
    with pytest.raises(ValueError, match='new_global'):
        rescale_lr(0.1, 256, 0, 'linear')
