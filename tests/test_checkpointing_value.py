"""The one checkpointing value: ``Checkpointing`` (off, every block, K of N) and the user's request."""

import json
from fractions import Fraction

import pytest

import autotune
from autotune.errors import ConfigError, cli_words
from autotune.workload.checkpoint_count import Checkpointing, CheckpointingRequest


# --- the request: every form a user may give ------------------------------------------------------

@pytest.mark.parametrize("value, parsed", [
    ("auto", "auto"), ("AUTO", "auto"), ("off", "off"), (" ON ", "on"), (True, "on"), (False, "off"),
    ("3", 3), (3, 3), (0, 0), ("1/3", Fraction(1, 3)), (Fraction(1, 3), Fraction(1, 3)),
    ("0.5", Fraction(1, 2)), (0.5, Fraction(1, 2)), (0.0, "off"), ("0/4", "off"), (1.0, Fraction(1)),
    (Checkpointing.off(4), "off"), (Checkpointing.every_block(4), "on"), (Checkpointing.of(2, 4), 2),
    (Checkpointing.every_block(), "on"),
])
def test_every_accepted_form_parses(value, parsed):
    request = CheckpointingRequest.parse(value)
    assert request.value == parsed
    assert CheckpointingRequest.parse(request) is request  # parsed once: a request passes through


@pytest.mark.parametrize("value", ["-1", "3/2", "half", "1/0", "nan", "inf", -2, 1.5, float("nan"),
                                   None, "", "on off"])
def test_bad_values_name_the_option_and_the_fix(value):
    fix = r".*(use auto, off, on|0 or more|between 0 and 1)"
    with pytest.raises(ConfigError, match=r"^checkpointing=" + fix):  # Python's word, by default
        CheckpointingRequest.parse(value)
    with cli_words(), pytest.raises(ConfigError, match=r"^--checkpointing " + fix):
        CheckpointingRequest.parse(value)


def test_errors_name_the_option_as_the_caller_wrote_it():
    with pytest.raises(ConfigError, match=r"^checkpointing='half' is not a checkpointing setting"):
        CheckpointingRequest.parse("half", option="checkpointing")  # from Python
    with cli_words(), pytest.raises(ConfigError, match=r"^--checkpointing 'half' is not a checkpointing"):
        CheckpointingRequest.parse("half", option="checkpointing")
    with pytest.raises(ConfigError, match=r"^checkpointing='half' is not a checkpointing setting"):
        autotune.probe("examples/none.py", checkpointing="half")


def test_auto_is_refused_where_a_setting_is_needed():
    with pytest.raises(ConfigError, match="use off, on, a block count K or a fraction"):
        CheckpointingRequest.parse("auto", allow_auto=False)
    with pytest.raises(ConfigError, match="only plan chooses"):
        CheckpointingRequest.parse("auto").resolve(4)
    assert CheckpointingRequest.parse("auto").auto and not CheckpointingRequest.parse("on").auto


@pytest.mark.parametrize("value, total, label", [
    ("off", 4, "off"), ("on", 4, "on"), (2, 4, "2 of 4 blocks"), ("1/3", 12, "4 of 12 blocks"),
    ("1/3", 4, "2 of 4 blocks"), (4, 4, "on"), (0, 4, "off"), ("on", None, "on"), (3, None, "3 blocks"),
    (1.0, 4, "on"),
])
def test_resolve_on_the_model(value, total, label):
    resolved = CheckpointingRequest.parse(value).resolve(total)
    assert resolved.label == label == str(resolved)


def test_resolve_refuses_more_blocks_than_the_model_has_and_fractions_without_a_count():
    with pytest.raises(ConfigError, match=r"^checkpointing=5: model has 4 repeated blocks.*from 0 to 4"):
        CheckpointingRequest.parse("5").resolve(4)
    with pytest.raises(ConfigError, match="has 0 repeated blocks"):
        CheckpointingRequest.parse("2").resolve(0, source="m.py")
    assert not CheckpointingRequest.parse("on").resolve(0)  # nothing to checkpoint: off
    with pytest.raises(ConfigError, match="needs the model's block count"):
        CheckpointingRequest.parse("1/2").resolve(None)


def test_request_labels_before_the_blocks_are_counted():
    assert [CheckpointingRequest.parse(v).label for v in ("off", "on", 2, "1/3")] == \
        ["off", "on", "2 blocks", "1/3"]
    assert str(CheckpointingRequest.parse("1/3")) == "1/3" and str(CheckpointingRequest.parse(2)) == "2"


# --- the value ------------------------------------------------------------------------------------

def test_value_is_frozen_truthy_and_labelled():
    off, on, some = Checkpointing.off(4), Checkpointing.every_block(4), Checkpointing.of(1, 4)
    assert not off and on and some
    assert (off.label, on.label, some.label) == ("off", "on", "1 of 4 blocks")
    assert (off.setting, on.setting, some.setting) == ("off", "on", 1)
    assert (off.count, on.count, some.count) == (0, 4, 1)
    assert on.all_blocks and not some.all_blocks and not off.all_blocks
    assert Checkpointing.every_block().count is None and Checkpointing.every_block().label == "on"
    assert repr(some) == "Checkpointing(1 of 4 blocks)"
    with pytest.raises(Exception):
        some.blocks = 2


def test_equality_is_by_the_blocks_checkpointed():
    assert Checkpointing.every_block() == Checkpointing.every_block(6) == Checkpointing.of(6, 6)
    assert Checkpointing.off() == Checkpointing.off(6) == Checkpointing.of(0, 6)
    assert Checkpointing.of(2, 6) != Checkpointing.of(2, 4) and Checkpointing.of(2, 6) != Checkpointing.of(3, 6)
    assert Checkpointing.of(2, 6) != Checkpointing.every_block(6)
    assert len({Checkpointing.every_block(), Checkpointing.of(6, 6), Checkpointing.off(),
                Checkpointing.of(2, 6)}) == 3
    assert Checkpointing.off() != "off"  # not a string: reports use .label


def test_parse_gives_the_value_directly():
    assert Checkpointing.parse("1/2", total=6) == Checkpointing.of(3, 6)
    assert Checkpointing.parse(True) == Checkpointing.every_block()
    assert Checkpointing.parse(Checkpointing.every_block(), total=6).count == 6
    value = Checkpointing.of(2, 6)
    assert Checkpointing.parse(value) is value


@pytest.mark.parametrize("blocks, total", [(-1, 4), (5, 4), (True, 4), (1, "4")])
def test_value_checks_its_counts(blocks, total):
    with pytest.raises(ConfigError, match="checkpointing"):
        Checkpointing(blocks=blocks, total=total)


def test_file_forms():
    for value in (Checkpointing.off(4), Checkpointing.every_block(4), Checkpointing.of(1, 4),
                  Checkpointing.every_block()):
        data = json.loads(json.dumps(value.to_dict()))
        assert Checkpointing.from_file(data) == value and Checkpointing.from_dict(data).total == value.total
    # Schema 1 and 2: a bool, and checkpointed_blocks (None: every block), of the plan's count.
    assert Checkpointing.from_file(False, None, 4) == Checkpointing.off(4)
    assert Checkpointing.from_file(True, None, 4) == Checkpointing.every_block(4)
    assert Checkpointing.from_file(True, 2, 4).label == "2 of 4 blocks"
    assert Checkpointing.from_file(True, 2, None).label == "2 blocks"


# --- blocks checkpointing cannot make smaller -----------------------------------------------------

def test_single_layer_blocks_are_named_and_transformer_blocks_are_not():
    from torch import nn

    from autotune.workload.activation_checkpointing import checkpointing_futile

    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.LayerNorm(16))
    assert checkpointing_futile(mlp).startswith("its repeated blocks are single layers (2 Linear, 1 LayerNorm)")
    blocks = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)) for _ in range(3)))
    assert checkpointing_futile(blocks) is None  # each block holds activations its input does not
    assert checkpointing_futile(nn.Sequential(nn.LSTM(8, 8), nn.LSTM(8, 8))) is None  # many steps each


def test_checkpointing_asked_for_on_single_layers_warns_and_auto_does_not(examples_dir):
    # examples/mlp.py: four Linears in one Sequential. Its plan with checkpointing on peaked at
    # 48.33 MiB, as with it off, and said nothing.
    common = dict(target_batch=64, memory_limit="64MiB", precision="fp32", eval_batch=False)
    asked = autotune.plan(examples_dir / "mlp.py", checkpointing="on", **common)
    assert asked.workload.checkpointing_futile is not None
    assert [w for w in asked.warnings if w.startswith("checkpointing='on': ") and "4 Linear" in w
            and "frees next to nothing" in w and "checkpointing='auto'" in w]
    auto = autotune.plan(examples_dir / "mlp.py", checkpointing="auto", **common)
    assert not [w for w in auto.warnings if "frees next to nothing" in w]
    lm = autotune.plan(examples_dir / "tiny_lm.py", checkpointing="on", **common)
    assert lm.workload.checkpointing_futile is None
    assert not [w for w in lm.warnings if "frees next to nothing" in w]
