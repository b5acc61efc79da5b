"""The scheduler's longest-processing-time order (blocks/tile_scheduler.lpt_order), run on
plain ints: the same arithmetic the kernels run on Int32."""

import pytest

pytest.importorskip("cutlass", reason="the CuTe DSL (nvidia-cutlass-dsl) is not installed")

from cute_attn.blocks.tile_scheduler import lpt_order  # noqa: E402


@pytest.mark.parametrize("blocks, heads, batch, section", [
    (32, 16, 4, 16), (7, 5, 3, 4), (1, 1, 1, 1), (9, 3, 2, 100), (5, 8, 1, 3), (128, 16, 1, 4)])
@pytest.mark.parametrize("longest_last", [True, False])
def test_every_tile_once_longest_first_within_each_section(blocks, heads, batch, section, longest_last):
    order = [lpt_order(n, blocks, heads, batch, section, longest_last) for n in range(blocks * heads * batch)]
    assert sorted(order) == [(b, h, t) for b in range(blocks) for h in range(heads) for t in range(batch)]
    # inside a section (a run of pairs), no tile comes before a longer one
    cost = (lambda b: b) if longest_last else (lambda b: blocks - b)
    pairs_of = lambda b, h, t: (t * heads + h) // section  # noqa: E731
    for i in range(len(order) - 1):
        (b0, h0, t0), (b1, h1, t1) = order[i], order[i + 1]
        if pairs_of(b0, h0, t0) == pairs_of(b1, h1, t1):
            assert cost(b0) >= cost(b1)
        else:  # the next section starts with its longest block
            assert cost(b1) == max(cost(b) for b in range(blocks))


def test_a_section_takes_each_heads_longest_block_before_any_next_one():
    # 4 blocks, 3 heads, sections of 2: heads 0 and 1 alternate, longest (block 3) first
    order = [lpt_order(n, 4, 3, 1, 2, True) for n in range(12)]
    assert order[:8] == [(3, 0, 0), (3, 1, 0), (2, 0, 0), (2, 1, 0), (1, 0, 0), (1, 1, 0), (0, 0, 0), (0, 1, 0)]
    assert order[8:] == [(3, 2, 0), (2, 2, 0), (1, 2, 0), (0, 2, 0)]
