"""Context parallelism on GPUs: the LSE combine kernel against the reference merge, and
ring / all-to-all attention with NCCL and cute_attn's kernels against single-GPU `mha`
(tests/distributed_checks.py: the error bound is twice mha's own error against the fp32
reference). World size 1 runs on any one GPU; 2 needs two (a multi-GPU machine)."""

import pytest
import torch

from distributed_checks import Case, spawn

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits,seqlen", [(1, 300), (2, 300), (5, 300), (3, 259), (20, 259)])
def test_combine_kernel_matches_reference(splits, seqlen, out_dtype):
    """kernels/combine.py: random partials, some splits with rows that saw no key (lse
    -inf and, as the kernels write such rows, partial 0: weight 0), whole rows no split
    saw (out 0, lse -inf), 300 rows (not a multiple of its 128-row tile), poisoned
    outputs. 259 rows leave a 3-row last tile, which SplitMerge merges a chunk per thread
    (lse_combine._merge_one_chunk), over more splits than it loads at once at 20."""
    from cute_attn import launcher, reference

    batch, heads, head_dim = 2, 3, 128
    g = torch.Generator(device="cuda").manual_seed(splits)
    o_part = torch.randn(splits * batch, seqlen, heads, head_dim, device="cuda", generator=g)
    lse_part = torch.randn(splits * batch, heads, seqlen, device="cuda", generator=g) * 4
    unseen = torch.rand(splits * batch, heads, seqlen, device="cuda", generator=g) < 0.3
    lse_part[unseen] = float("-inf")
    o_part.masked_fill_(unseen.transpose(1, 2)[..., None], 0.0)
    for row in (7, seqlen - 2):  # rows of head 1 that no split saw a key for (first and last tile)
        lse_part[:, 1, row] = float("-inf")
        o_part[:, row, 1] = 0.0
    out = torch.full((batch, seqlen, heads, head_dim), float("nan"), device="cuda", dtype=out_dtype)
    lse = torch.full((batch, heads, seqlen), float("nan"), device="cuda")
    launcher.run_combine(o_part, lse_part, out, lse)
    want, want_lse = reference.combine_splits(o_part.view(splits, batch, seqlen, heads, head_dim),
                                              lse_part.view(splits, batch, heads, seqlen))
    tol = 1e-5 if out_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    for row in (7, seqlen - 2):
        assert (out[:, row, 1] == 0).all() and torch.isneginf(lse[:, 1, row]).all()


def test_combine_kernel_in_place_on_row_views():
    """The ring's use: out is split 0 of the partials (in place), on a row slice."""
    from cute_attn import launcher, reference

    batch, seqlen, heads, head_dim = 1, 257, 4, 64
    o_part = torch.randn(2 * batch, seqlen, heads, head_dim, device="cuda")
    lse_part = torch.randn(2 * batch, heads, seqlen, device="cuda")
    rows = slice(100, 257)
    want, want_lse = reference.combine_splits(o_part[:, rows].reshape(2, batch, -1, heads, head_dim),
                                              lse_part[:, :, rows].reshape(2, batch, heads, -1))
    before = o_part[:, :100].clone()
    lse = torch.full((batch, heads, seqlen), float("nan"), device="cuda")
    launcher.run_combine(o_part[:, rows], lse_part[:, :, rows], o_part[:batch, rows], lse[:, :, rows])
    torch.testing.assert_close(o_part[:batch, rows], want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[:, :, rows], want_lse, atol=1e-5, rtol=1e-5)
    assert torch.equal(o_part[:, :100], before) and torch.isnan(lse[:, :, :100]).all()


_CASES = [
    Case("ring", "zigzag", True, batch=1, seqlen=1000, heads=4, heads_kv=2, head_dim=128),
    Case("ring", "contiguous", True, batch=2, seqlen=520, heads=2, heads_kv=2, head_dim=64),
    Case("ring", "zigzag", False, batch=1, seqlen=776, heads=4, heads_kv=4, head_dim=128, softcap=30.0),
    Case("ring", "contiguous", True, batch=1, seqlen=1000, heads=4, heads_kv=2, head_dim=128, window=(300, 0)),
    Case("ring", "contiguous", False, batch=1, seqlen=1000, heads=2, heads_kv=1, head_dim=64, window=(700, 90)),
    # packed documents (ring_mha_varlen): an empty one, lengths not multiples of the tiles
    Case("ring", "zigzag", True, heads=4, heads_kv=2, head_dim=128, documents=(1000, 0, 248, 520)),
    Case("ring", "contiguous", False, heads=2, heads_kv=2, head_dim=64, documents=(364, 904)),
    Case("ulysses", "zigzag", True, batch=1, seqlen=1000, heads=4, heads_kv=2, head_dim=128),
    Case("ulysses", "contiguous", True, batch=1, seqlen=600, heads=2, heads_kv=2, head_dim=64, window=(100, 0)),
    Case("ulysses", "zigzag", False, batch=1, seqlen=520, heads=4, heads_kv=1, head_dim=128),  # KV copied per rank
]


@pytest.mark.parametrize("world_size", [1, 2])
def test_context_parallel_matches_single_gpu(world_size, tmp_path):
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs, this machine has {torch.cuda.device_count()}")
    spawn(world_size, _CASES, on_gpu=True, tmp_path=tmp_path)


@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_kernel_path_in_threads(world_size):
    """The ring's kernel path (dense and varlen, the merge kernel, the backward's
    accumulators) with W ranks as threads of one process on one GPU
    (distributed_checks.ThreadRing): needs no second GPU."""
    from distributed_checks import check_case_threads

    for case in _CASES:
        if case.variant == "ring" and case.window == (-1, -1):
            check_case_threads(case, world_size, on_gpu=True)
