"""CPU tests of the block-mask builder (cute_attn/block_mask.py) against the brute-force
classification of mask_reference.block_mask, of the mod kernels' compile, and of the
API's checks for mask/score mods (raised before any kernel runs)."""

import math

import pytest
import torch

import cute_attn
from cute_attn import block_mask as bm
from cute_attn import masks, validation
from cute_attn.mask_reference import EMPTY, FULL, PARTIAL, block_mask as reference_classes
from cpu_standin import LauncherTrap, fake_cuda


def _doc_ids(batch, seqlen, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 3, (batch, seqlen), generator=g).cumsum(dim=1) // 2).to(torch.int32)


CASES = [
    ("block_diffusion", lambda: masks.block_diffusion(4), 1, 1, 46, 46),
    ("block_diffusion_odd", lambda: masks.block_diffusion(3), 2, 1, 37, 37),
    ("document", lambda: masks.document(_doc_ids(2, 41, 0)), 2, 2, 41, 41),
    ("prefix_lm", lambda: masks.prefix_lm([0, 17]), 2, 3, 29, 29),
    ("causal_rect", lambda: masks.causal(), 1, 1, 13, 50),
    ("per_head", lambda: (lambda b, h, q, kv: (kv <= q) & (kv >= q - 3 * (h + 1))), 1, 3, 33, 33),
    ("nothing", lambda: masks.or_masks(), 1, 1, 9, 20),
]
TILES = [(4, 4), (8, 5), (16, 16), (128, 128)]


def _kernel_view(classes, seqlen_k, tile_n):
    """The reference's classes as the kernel needs them: a cut last KV tile is never FULL."""
    classes = classes.clone()
    if seqlen_k % tile_n:
        last = classes[..., -1]
        last[last == FULL] = PARTIAL
    return classes


@pytest.mark.parametrize("tile", TILES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_builder_matches_brute_force(case, tile, monkeypatch):
    name, make, batch, heads, sq, sk = case
    mod = make()
    # small chunks, so that several chunks (and a ragged last one) are exercised
    monkeypatch.setattr(bm, "_CHUNK_PAIRS", 3 * tile[0] * sk)
    built = bm.build_block_mask(mod, batch, heads, sq, sk, *tile, device="cpu")
    expected = _kernel_view(reference_classes(mod, batch, heads, sq, sk, *tile), sk, tile[1])
    got = built.classes().expand(batch, heads, -1, -1)
    assert torch.equal(got, expected)
    tiles_m, tiles_n = math.ceil(sq / tile[0]), math.ceil(sk / tile[1])
    # the lists: each class's tiles, last first, then -1
    for lists, cls in (((built.partial_count, built.partial_idx), PARTIAL), ((built.full_count, built.full_idx), FULL)):
        count, idx = (t.expand(batch, heads, *t.shape[2:]) for t in lists)
        assert count.dtype == idx.dtype == torch.int32 and idx.shape == (batch, heads, tiles_m, tiles_n)
        for b in range(batch):
            for h in range(heads):
                for m in range(tiles_m):
                    want = [n for n in reversed(range(tiles_n)) if expected[b, h, m, n] == cls]
                    c = int(count[b, h, m])
                    assert idx[b, h, m, :c].tolist() == want
                    assert (idx[b, h, m, c:] == -1).all()
    # the backward's lists: per KV tile, each class's query tiles, first first, then -1
    back = bm.build_block_mask(mod, batch, heads, sq, sk, *tile, device="cpu", transposed=True)
    assert back.transposed and torch.equal(back.classes().expand(batch, heads, -1, -1), expected)
    for lists, cls in (((back.partial_count, back.partial_idx), PARTIAL), ((back.full_count, back.full_idx), FULL)):
        count, idx = (t.expand(batch, heads, *t.shape[2:]) for t in lists)
        assert idx.shape == (batch, heads, tiles_n, tiles_m)
        for b in range(batch):
            for h in range(heads):
                for n in range(tiles_n):
                    want = [m for m in range(tiles_m) if expected[b, h, m, n] == cls]
                    c = int(count[b, h, n])
                    assert idx[b, h, n, :c].tolist() == want
                    assert (idx[b, h, n, c:] == -1).all()
    # the deterministic backward's turns: KV tile n adds into query tile m's dQ after the
    # KV tiles before it that visit m; a forward mask has none
    assert built.dq_turn is None
    turns = back.dq_turns()
    assert turns.dtype == torch.int32 and turns.shape == (batch, heads, tiles_n, tiles_m)
    for b in range(batch):
        for h in range(heads):
            for m in range(tiles_m):
                visitors = [n for n in range(tiles_n) if expected[b, h, m, n] != EMPTY]
                assert [int(turns[b, h, n, m]) for n in visitors] == list(range(len(visitors)))


def test_builder_keeps_batch_and_head_only_when_the_mod_reads_them():
    built = bm.build_block_mask(masks.block_diffusion(4), 3, 5, 40, 40, 8, 8, device="cpu")
    assert built.partial_count.shape[:2] == (1, 1)
    assert built.kernel_tensors()[0].shape == (3, 5, 5)
    built = bm.build_block_mask(masks.document(_doc_ids(3, 40, 1)), 3, 5, 40, 40, 8, 8, device="cpu")
    assert built.partial_count.shape[:2] == (3, 1)
    built = bm.build_block_mask(lambda b, h, q, kv: kv <= q + h, 3, 5, 40, 40, 8, 8, device="cpu")
    assert built.partial_count.shape[:2] == (1, 5)


def test_block_diffusion_skips_most_tiles_at_small_blocks():
    built = bm.build_block_mask(masks.block_diffusion(16), 1, 1, 8192, 8192, 128, 128, device="cpu")
    # 32 x 32 tiles per quadrant: noisy-noisy visits its 32 diagonal tiles; noisy-clean
    # (strictly block-lower, but blocks of 16 cut the diagonal tiles) and clean-clean
    # (block-lower) the 528 on and below the diagonal; clean-noisy none
    assert built.sparsity() == 1 - (32 + 2 * 528) / 4096


def test_cached_block_mask_rebuilds_when_aux_changes():
    ids = _doc_ids(1, 30, 2)
    mod = masks.document(ids)
    a = bm.cached_block_mask(mod, 1, 1, 30, 30, 8, 8, "cpu")
    assert bm.cached_block_mask(mod, 1, 1, 30, 30, 8, 8, "cpu") is a
    ids[0, :15] = 99  # in place: a new version
    b = bm.cached_block_mask(mod, 1, 1, 30, 30, 8, 8, "cpu")
    assert b is not a
    assert torch.equal(b.classes(), _kernel_view(reference_classes(mod, 1, 1, 30, 30, 8, 8), 30, 8))


def test_cached_block_mask_is_not_fooled_by_a_recycled_address():
    """A new aux tensor at a freed one's address, with the same version (0) and shape, as
    the caching allocator hands out when a training loop makes fresh document ids each
    step, must build its own mask: keyed by data pointer and version, the cache once
    returned the old tensor's (tiles it marked EMPTY were then never computed)."""
    import numpy as np

    memory = np.zeros((1, 30), dtype=np.int32)
    memory[0, 15:] = 1  # two documents
    first = torch.from_numpy(memory)
    mod = masks.document(first)
    a = bm.cached_block_mask(mod, 1, 1, 30, 30, 8, 8, "cpu")
    del mod, first
    memory[0, 15:] = 0  # one document, written behind torch's back: no version change
    second = torch.from_numpy(memory)
    mod = masks.document(second)
    assert second._version == 0
    b = bm.cached_block_mask(mod, 1, 1, 30, 30, 8, 8, "cpu")
    assert not torch.equal(a.classes(), b.classes())
    assert torch.equal(b.classes(), _kernel_view(reference_classes(mod, 1, 1, 30, 30, 8, 8), 30, 8))


VARLEN_CASES = [
    # (name, mod factory given the packed lengths, lengths_q, lengths_k)
    ("document_packed", lambda lq: masks.document(torch.tensor([i % 3 // 2 + 2 * s for s, n in enumerate(lq)
                                                                for i in range(n)]), causal=True),
     [13, 0, 29, 7], [13, 0, 29, 7]),
    ("causal_cross", lambda lq: masks.causal(), [5, 17, 1], [9, 40, 3]),
    ("block_diffusion", lambda lq: masks.block_diffusion(3), [22, 9, 31], [22, 9, 31]),
    ("prefix_lm_per_sequence", lambda lq: masks.prefix_lm([0, 4, 100]), [10, 12, 6], [10, 12, 6]),
    ("per_head_window", lambda lq: masks.Modifier("mask", lambda b, h, q, kv, seq: (kv - seq.offset_k) >=
                                                  (q - seq.offset_q) - 2 * (h + 1), (), "per_head_window"),
     [11, 3], [11, 14]),
]


def _varlen_expected(mod, lengths_q, lengths_k, heads, tile):
    """Per sequence, the reference's classes at its own lengths with its global indices
    and index b (the kernel's view: a cut last KV tile is never FULL), padded with EMPTY
    to the longest sequence's tiles."""
    tm, tn = tile
    oq, ok = [0], [0]
    for a, c in zip(lengths_q, lengths_k):
        oq.append(oq[-1] + a)
        ok.append(ok[-1] + c)
    tiles_m, tiles_n = math.ceil(max(lengths_q) / tm), math.ceil(max(lengths_k) / tn)
    out = torch.zeros(len(lengths_q), heads, tiles_m, tiles_n, dtype=torch.int8)
    for b, (lq, lk) in enumerate(zip(lengths_q, lengths_k)):
        if lq and lk:
            classes = reference_classes(mod, 1, heads, lq, lk, tm, tn, None, oq[b], ok[b], b)
            out[b, :, :math.ceil(lq / tm), :math.ceil(lk / tn)] = _kernel_view(classes, lk, tn)[0]
    return out, (tuple(oq), tuple(ok))


@pytest.mark.parametrize("tile", [(4, 4), (8, 5), (128, 128)], ids=str)
@pytest.mark.parametrize("case", VARLEN_CASES, ids=lambda c: c[0])
def test_varlen_builder_matches_per_sequence_reference(case, tile):
    """build_varlen_block_mask: each sequence's tiles classified at its own lengths with the
    kernel's indices (global, b = the sequence), tiles past a shorter sequence EMPTY; the
    backward's transposed lists and turns follow the same classes."""
    name, make, lengths_q, lengths_k = case
    heads = 3
    mod = make(lengths_q)
    cu_q, cu_k = (torch.tensor([0] + n).cumsum(0).to(torch.int32) for n in (lengths_q, lengths_k))
    expected, offsets = _varlen_expected(mod, lengths_q, lengths_k, heads, tile)
    built = bm.build_varlen_block_mask(mod, cu_q, cu_k, heads, *tile, device="cpu")
    assert built.cu_seqlens == offsets and built.batch == len(lengths_q)
    assert (built.seqlen_q, built.seqlen_k) == (max(lengths_q), max(lengths_k))
    assert torch.equal(built.classes().expand(len(lengths_q), heads, -1, -1), expected)
    back = bm.build_varlen_block_mask(mod, cu_q, cu_k, heads, *tile, device="cpu", transposed=True)
    assert torch.equal(back.classes().expand(len(lengths_q), heads, -1, -1), expected)
    turns = back.dq_turns()
    for b in range(len(lengths_q)):
        for h in range(heads):
            for m in range(expected.shape[2]):
                visitors = [n for n in range(expected.shape[3]) if expected[b, h, m, n] != EMPTY]
                assert [int(turns[b, h, n, m]) for n in visitors] == list(range(len(visitors)))


def test_varlen_block_mask_checks_and_cache():
    mod = masks.causal()
    cu = torch.tensor([0, 10, 30], dtype=torch.int32)
    built = bm.create_varlen_block_mask(mod, cu, cu, 2, head_dim=64)
    cfg = __import__("cute_attn.config", fromlist=["x"]).mod_fwd_config_for(64)
    bm.check_varlen_block_mask(built, mod, cu, cu, 2, cfg.tile_m, cfg.tile_n)  # passes
    with pytest.raises(ValueError, match="other cu_seqlens"):
        other = torch.tensor([0, 11, 30], dtype=torch.int32)
        bm.check_varlen_block_mask(built, mod, other, other, 2, cfg.tile_m, cfg.tile_n)
    with pytest.raises(ValueError, match=r"\(heads, tile_m, tile_n\)"):
        bm.check_varlen_block_mask(built, mod, cu, cu, 3, cfg.tile_m, cfg.tile_n)
    with pytest.raises(ValueError, match="another mask mod"):
        bm.check_varlen_block_mask(built, masks.block_diffusion(2), cu, cu, 2, cfg.tile_m, cfg.tile_n)
    with pytest.raises(ValueError, match="pass it to mha_varlen"):
        bm.check_block_mask(built, mod, 2, 2, 20, 20, cfg.tile_m, cfg.tile_n)
    dense = bm.create_block_mask(mod, 2, 2, 20, 20, head_dim=64)
    with pytest.raises(ValueError, match="create_varlen_block_mask"):
        bm.check_varlen_block_mask(dense, mod, cu, cu, 2, cfg.tile_m, cfg.tile_n)
    # the cache: the same live offset tensors give the same mask; an in-place write a new one
    a = bm.cached_varlen_block_mask(mod, cu, cu, 2, 8, 8)
    assert bm.cached_varlen_block_mask(mod, cu, cu, 2, 8, 8) is a
    cu[1] = 12
    b = bm.cached_varlen_block_mask(mod, cu, cu, 2, 8, 8)
    assert b is not a and b.cu_seqlens == ((0, 12, 30), (0, 12, 30))


def _cpu_qkv(dtype=torch.bfloat16):
    """CPU tensors that report cuda:0 (validation reads only .device)."""
    return tuple(fake_cuda(torch.randn(1, 64, 2, 64, dtype=dtype)) for _ in range(3))


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(mask_mod=masks.causal(), causal=True), ValueError, "replace causal"),
    (dict(mask_mod=masks.causal(), window_size=(3, 0)), ValueError, "replace causal"),
    (dict(mask_mod=masks.causal(), softcap=5.0), ValueError, "replace causal"),
    (dict(block_mask=None, aux_tensors=(torch.zeros(3),)), ValueError, "go with a mask_mod"),
    (dict(score_mod=masks.alibi([1.0, 2.0]), mask_mod=masks.causal(), aux_tensors=(torch.zeros(3),)), ValueError,
     "plain-function"),
    (dict(mask_mod=masks.alibi([1.0, 2.0])), TypeError, "expected a mask mod"),
    (dict(mask_mod=lambda b, h, q: q), TypeError, "positional"),
    (dict(mask_mod=masks.causal(), aux_tensors=[1]), ValueError, "plain-function"),
    (dict(learnable_sink=[0.0, 0.0]), TypeError, "must be a torch.Tensor"),
    (dict(learnable_sink=fake_cuda(torch.zeros(3))), ValueError, r"shape \(nheads,\) = \(2,\)"),
    (dict(learnable_sink=fake_cuda(torch.zeros(1, 2))), ValueError, "shape"),
    (dict(learnable_sink=fake_cuda(torch.zeros(2, dtype=torch.int32))), TypeError, "float32, bfloat16"),
    (dict(learnable_sink=torch.zeros(2)), ValueError, "learnable_sink is on cpu"),
    # aux tensors too small for the call (batch 1, 64 tokens, 2 heads): the kernel would
    # read past them (ALiBi's slopes) or the block-mask builder index past them
    (dict(score_mod=masks.alibi(fake_cuda(torch.ones(1)))), ValueError,
     r"alibi: aux tensor 0 has shape \(1,\), but dim 0 is indexed by heads and this call has heads = 2"),
    (dict(mask_mod=masks.document(fake_cuda(torch.zeros(1, 32, dtype=torch.int32)))), ValueError,
     "dim 1 is indexed by tokens and this call has tokens = 64"),
    (dict(mask_mod=masks.prefix_lm(fake_cuda(torch.zeros(0, dtype=torch.int32)))), ValueError,
     "indexed by batch and this call has batch = 1"),
    (dict(mask_mod=masks.and_masks(masks.causal(), masks.document(fake_cuda(torch.zeros(63, dtype=torch.int32))))),
     ValueError, r"and\(causal, document\): aux tensor 0 has shape \(63,\)"),
])
def test_api_rejects_bad_mod_arguments(kwargs, error, match, monkeypatch):
    monkeypatch.setattr(cute_attn.api, "_launcher_module", LauncherTrap(" on bad mod arguments"))
    monkeypatch.setattr(validation, "_device_capability", lambda device: (9, 0))
    q, k, v = _cpu_qkv()
    with pytest.raises(error, match=match):
        cute_attn.mha(q, k, v, **kwargs)


def test_mod_kernels_compile_per_mod_not_per_value():
    """Compiles the BD3LM and document kernels on the CPU (sm_90a); two block sizes are two
    keys, two id tensors one."""
    from cute_attn.config import AttnFeatures, mod_fwd_config_for
    from cute_attn.launcher import FwdKey, compile_fwd

    a, b = masks.document(_doc_ids(1, 8, 0)), masks.document(_doc_ids(2, 9, 1))
    assert a.spec == b.spec
    assert masks.block_diffusion(4).spec != masks.block_diffusion(16).spec
    cfg = mod_fwd_config_for(128)
    for mask, score in ((masks.block_diffusion(16), None), (masks.causal(), masks.alibi([1.0]))):
        features = AttnFeatures(mask_mod=mask.spec, score_mod=None if score is None else score.spec)
        fn = compile_fwd(FwdKey("bf16", 128, features, cfg), "--keep-ptx")
        ptx = fn.__ptx__
        assert "wgmma.mma_async" in ptx and "FlashFwdSm90Mods" in ptx


def test_masks_reading_token_ids_are_evaluated_before_the_scores():
    """config._fwd_tile_config's mask placement (FwdConfig.mask_before_scores): on for a
    mask mod reading a per-token aux tensor (documents, alone or combined), off for index
    arithmetic (BD3LM) and per-entry aux (prefix-LM); the documents kernel compiles with
    its verdicts packed into bits (sm_90a, CPU)."""
    from cute_attn.config import AttnFeatures, fwd_config_for
    from cute_attn.launcher import FwdKey, compile_fwd

    ids = torch.zeros(2, 64, dtype=torch.int32)
    early = {
        "document": masks.document(ids),
        "document packed": masks.document(ids.view(-1), causal=True),
        "and(causal, document)": masks.and_masks(masks.causal(), masks.document(ids)),
    }
    late = {
        "block_diffusion": masks.block_diffusion(16),
        "prefix_lm": masks.prefix_lm(torch.tensor([3, 5], dtype=torch.int32)),
        "causal": masks.causal(),
    }
    for name, mod in {**early, **late}.items():
        config = fwd_config_for(128, AttnFeatures(mask_mod=mod.spec))
        assert config.mask_before_scores == (name in early), name
    # a score mod alone has no mask to place
    assert not fwd_config_for(128, AttnFeatures(score_mod=masks.alibi([1.0]).spec)).mask_before_scores
    features = AttnFeatures(mask_mod=early["document"].spec)
    ptx = compile_fwd(FwdKey("bf16", 128, features, fwd_config_for(128, features)), "--keep-ptx").__ptx__
    assert "wgmma.mma_async" in ptx and "FlashFwdSm90Mods" in ptx


def test_sink_kernels_compile():
    """A sink alone (the dense mask kinds through the mods' entry point) and a sink with a
    mask mod compile on the CPU (sm_90a)."""
    from cute_attn.config import AttnFeatures, mod_fwd_config_for
    from cute_attn.launcher import FwdKey, compile_fwd

    for features in (AttnFeatures(mask="causal", softcap=True, sink=True),
                     AttnFeatures(mask_mod=masks.block_diffusion(16).spec, sink=True)):
        ptx = compile_fwd(FwdKey("bf16", 128, features, mod_fwd_config_for(128)), "--keep-ptx").__ptx__
        assert "wgmma.mma_async" in ptx and "FlashFwdSm90Mods" in ptx


def test_deterministic_mod_backward_compiles():
    """The deterministic backward with a mask mod reads its dQ turn from the block mask
    and spins on the turn counter (ld.acquire) before each dQ add."""
    from cute_attn.config import AttnFeatures, bwd_config_for
    from cute_attn.launcher import BwdKey, compile_bwd

    features = AttnFeatures(mask_mod=masks.block_diffusion(16).spec)
    _, main, _ = compile_bwd(BwdKey("bf16", 128, features, bwd_config_for(128, features), True), "--keep-ptx")
    ptx = main.__ptx__
    assert "FlashBwdSm90Mods" in ptx and "ld.acquire.gpu.global.b32" in ptx and "red.release.gpu" in ptx


@pytest.mark.parametrize("head_dim, deterministic", [(128, True), (256, False)], ids=["deterministic", "dq_atomic"])
def test_varlen_mod_backward_guards_dq_by_the_sequence(head_dim, deterministic):
    """A packed batch's mask-mod backward walks block-mask lists that may outlive the
    offsets (rewritten behind torch's version counter): its dQ adds (the writer's bulk
    reduce and turn counter, or head dim 256's atomics) are guarded by the clamped
    sequence (FlashBwdSm90.in_sequence). It compiles; the turn wait spins on `<`, so a
    collision of turns cannot hang."""
    from cute_attn.config import AttnFeatures, bwd_config_for
    from cute_attn.launcher import BwdKey, compile_bwd

    features = AttnFeatures(mask_mod=masks.document(torch.zeros(8, dtype=torch.int32)).spec, varlen=True)
    config = bwd_config_for(head_dim, features, deterministic)
    assert config.dq_atomic == (not deterministic)
    _, main, _ = compile_bwd(BwdKey("bf16", head_dim, features, config, deterministic), "--keep-ptx")
    ptx = main.__ptx__
    assert "FlashBwdSm90Mods" in ptx
    if deterministic:
        assert "setp.lt.s32 p, v," in ptx and "red.release.gpu" in ptx


def test_mod_backward_kernels_compile():
    """The backward with mods compiles on the CPU (sm_90a): a mask mod walking the
    transposed block mask, and a score mod differentiated through masks.Dual."""
    from cute_attn.config import AttnFeatures, bwd_config_for
    from cute_attn.launcher import BwdKey, compile_bwd

    for mask, score in ((masks.block_diffusion(16), None), (masks.causal(), masks.softcap(30.0))):
        features = AttnFeatures(mask_mod=mask.spec, score_mod=None if score is None else score.spec)
        _, main, _ = compile_bwd(BwdKey("bf16", 128, features, bwd_config_for(128, features)), "--keep-ptx")
        ptx = main.__ptx__
        assert "wgmma.mma_async" in ptx and "FlashBwdSm90Mods" in ptx
        if score is not None:
            assert "tanh.approx.f32" in ptx


@pytest.mark.parametrize("n", [1, 2, 3, 7, 56, 57])
def test_tree_sum_adds_every_value_once(n):
    """blocks/softmax.tree_sum (the softmax's pairwise row sums, unrolled at trace time)
    on plain Python numbers: every value once, odd lengths included, depth ceil(log2 n)."""
    from cute_attn.blocks.softmax import tree_sum

    values = [2 ** i for i in range(n)]  # distinct powers of two: any lost or doubled term shows
    assert tree_sum(values) == 2 ** n - 1

    class Depth(int):
        def __add__(self, other):
            return Depth(int(max(self, other)) + 1)

    assert tree_sum([Depth(0)] * n) == (n - 1).bit_length()


def test_varlen_builder_probes_the_mod_where_a_sequence_is():
    """The head-dependence probe evaluates the mod at the first live sequence's own first
    indices (its offsets, its b): a mod reading a per-sequence aux at q_idx - offset_q
    must not be called at index 0 of another sequence."""
    per_seq = [torch.arange(20) % 3, torch.arange(10) % 2]  # sequence 0 has no keys

    def mod(b, h, q, kv, seq):
        return seq.aux[0][q - seq.offset_q] >= 0 if seq.offset_q == 20 else kv >= 0

    m = masks.Modifier("mask", mod, (torch.cat(per_seq)[20:],), "probe")
    cu_q, cu_k = torch.tensor([0, 20, 30], dtype=torch.int32), torch.tensor([0, 0, 10], dtype=torch.int32)
    built = bm.build_varlen_block_mask(m, cu_q, cu_k, 2, 8, 8, device="cpu")
    assert built.classes()[1].ne(EMPTY).any() and not built.classes()[0].ne(EMPTY).any()


def test_varlen_caches_skip_inference_tensors_and_drop_dead_entries():
    import gc

    mod = masks.causal()
    with torch.inference_mode():
        cu = torch.tensor([0, 10, 30], dtype=torch.int32)
    a = bm.cached_varlen_block_mask(mod, cu, cu, 2, 8, 8)  # no version counter: built, not cached
    assert a is not bm.cached_varlen_block_mask(mod, cu, cu, 2, 8, 8)
    bm.check_varlen_block_mask(a, mod, cu, cu, 2, 8, 8)
    live = torch.tensor([0, 7, 9], dtype=torch.int32)
    bm.cached_varlen_block_mask(mod, live, live, 2, 8, 8)
    before = len(bm._varlen_cache)
    del live
    gc.collect()
    assert len(bm._varlen_cache) == before - 1, "a freed offsets tensor's entry is dropped"
    gpu_mask = a._replace(partial_count=a.partial_count.to("meta"))
    with pytest.raises(ValueError, match="is on meta"):
        bm.check_varlen_block_mask(gpu_mask, mod, torch.tensor([0, 10, 30], dtype=torch.int32),
                                   torch.tensor([0, 10, 30], dtype=torch.int32), 2, 8, 8)
