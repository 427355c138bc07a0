"""LR scaling rules and warmup advice."""

import math

import pytest

from autotune.errors import ConfigError
from autotune.planning.lr import decide_lr, rule_for_optimizer, scale_factor


def test_linear_rule():
    d = decide_lr(rule="linear", target_batch=1024, base_lr=0.1, base_batch=256, optimizer="SGD")
    assert d.scale == 4
    assert d.lr == pytest.approx(0.4)


def test_sqrt_rule():
    d = decide_lr(rule="sqrt", target_batch=128, base_lr=3e-4, base_batch=32, optimizer="AdamW")
    assert d.scale == pytest.approx(2.0)
    assert d.lr == pytest.approx(6e-4)


def test_none_rule_keeps_base_lr():
    d = decide_lr(rule="none", target_batch=128, base_lr=3e-4, base_batch=32, optimizer="AdamW")
    assert d.lr == pytest.approx(3e-4)
    assert d.scale == 1
    assert d.warmup_steps == 0


@pytest.mark.parametrize("optimizer,rule", [("SGD", "linear"), ("Adam", "sqrt"), ("AdamW", "sqrt"),
                                            ("RMSprop", "sqrt"), ("MyOptimizer", "none"), (None, "none")])
def test_auto_rule_from_optimizer(optimizer, rule):
    assert rule_for_optimizer(optimizer)[0] == rule
    d = decide_lr(rule="auto", target_batch=64, base_lr=0.1, base_batch=32, optimizer=optimizer)
    assert d.rule == rule


def test_smaller_batch_scales_down_without_warmup():
    d = decide_lr(rule="linear", target_batch=64, base_lr=0.1, base_batch=256, optimizer="SGD",
                  dataset_size=1000)
    assert d.lr == pytest.approx(0.025)
    assert d.warmup_steps == 0
    assert "warm up" not in d.note


def test_warmup_in_optimizer_steps_when_lr_grows():
    d = decide_lr(rule="linear", target_batch=1000, base_lr=0.1, base_batch=250, optimizer="SGD",
                  dataset_size=10_000)
    assert d.warmup_steps == math.ceil(5 * 10_000 / 1000)
    assert "Goyal" in d.note
    assert "once per optimizer step" in d.note


def test_warmup_advice_without_dataset_size():
    d = decide_lr(rule="sqrt", target_batch=128, base_lr=1e-3, base_batch=32, optimizer="AdamW")
    assert d.warmup_steps == 0
    assert "5 epochs" in d.note and "build_dataset" in d.note


def test_without_base_lr_the_optimizer_lr_is_kept():
    d = decide_lr(rule="auto", target_batch=128, base_lr=None, base_batch=None, optimizer="AdamW",
                  optimizer_lr=1e-3)
    assert d.lr is None
    assert "left as the optimizer's own (lr=0.001)" in d.note
    assert "--base-lr" in d.note


def test_base_lr_without_base_batch_is_an_error():
    with pytest.raises(ConfigError) as info:
        decide_lr(rule="linear", target_batch=128, base_lr=0.1, base_batch=None, optimizer="SGD")
    assert "--base-batch" in str(info.value)


def test_unknown_rule_is_an_error():
    with pytest.raises(ConfigError) as info:
        scale_factor("cubic", 2.0)
    assert "--lr-rule 'cubic'" in str(info.value)
