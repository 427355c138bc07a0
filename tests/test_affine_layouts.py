"""Few-block estimates of model-parallel layouts (autotune/probing/affine_blocks.py): which are
extended from small builds, and the proof that decides it (the same bytes as the full build)."""

import pathlib

import pytest

from autotune import ConfigError
from autotune.distributed.layout import parse_layout
from autotune.probing import affine_blocks
from autotune.probing.affine_blocks import few_blocks_for, full_builds

MODEL = pathlib.Path(__file__).with_name("twelve_block_llama.py")


def test_only_proven_splits_are_extended_and_pipelines_never():
    assert affine_blocks._few_blocks_proven(None) and affine_blocks._few_blocks_proven(parse_layout())
    assert affine_blocks._few_blocks_proven(parse_layout(tp=2))  # proved below
    assert affine_blocks._few_blocks_proven(parse_layout(tp=2, cp=2))
    assert not affine_blocks._few_blocks_proven(parse_layout(tp=2, pp=2))
    with few_blocks_for(("tp",)):
        assert not affine_blocks._few_blocks_proven(parse_layout(cp=2))
    with few_blocks_for(("tp", "cp", "pp")):
        assert not affine_blocks._few_blocks_proven(parse_layout(cp=2, pp=2))
    assert affine_blocks.PROVEN_SPLITS == frozenset({"tp", "cp"})


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("degrees, world", [(dict(tp=2), 2), (dict(tp=2), 4), (dict(cp=2), 2),
                                           (dict(cp=2), 4), (dict(tp=2, cp=2), 4),
                                           (dict(tp=2, cp=2), 8)])
def test_a_split_from_few_blocks_is_the_full_build_to_the_byte(monkeypatch, degrees, world):
    """The proof behind PROVEN_SPLITS (tp 2 and cp 2 alone, with each other, with FSDP 2)."""
    from autotune.probing.estimate import estimate_peaks

    ran = []
    original = affine_blocks.FewBlocksSession.run
    monkeypatch.setattr(affine_blocks.FewBlocksSession, "run",
                        lambda self, n, **kw: ran.append(max(self._sizes())) or original(self, n, **kw))
    settings = dict(sharding="fsdp", world_size=world, precision="bf16", parallel=parse_layout(**degrees))
    try:
        with few_blocks_for(degrees):
            few = estimate_peaks(MODEL, [1, 2], checkpointing="on", **settings)
    except ConfigError as exc:
        if "is not available in this build" in str(exc):
            pytest.skip(str(exc))
        raise
    with full_builds():
        full = estimate_peaks(MODEL, [1, 2], checkpointing="on", **settings)
    assert ran and max(ran) == 5  # small builds of 4 and 5 blocks ran, not the 12
    assert few == full
