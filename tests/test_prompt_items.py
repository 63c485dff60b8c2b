"""`python -m benchmarks.prompt_items`: its shapes argument (the timing itself is a benchmark)."""

import pytest

from benchmarks.prompt_items import parse_shapes


def test_shapes_parse_as_prompts_by_tokens():
    assert parse_shapes("4x37, 1x148") == [(4, 37), (1, 148)]


@pytest.mark.parametrize("bad", ["4", "x37", "0x37", "4x", "4*37", "ax3"])
def test_a_bad_shape_is_named(bad):
    with pytest.raises(ValueError, match="expected PROMPTSxTOKENS"):
        parse_shapes(bad)
