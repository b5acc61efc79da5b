"""Dropout's generator and mask on the CPU (cute_attn/dropout.py): Philox4x32-10 against
its published known-answer vectors, the mask's keep rate and its independence of the
shape it is drawn at, and mha's dropout argument checks (before any kernel)."""

import dataclasses
import math
import re

import numpy as np

import pytest
import torch

import cute_attn
import cute_attn.validation as validation
from cpu_standin import LauncherTrap, fake_cuda
from cute_attn.dropout import PHILOX_ROUNDS, dropout_mask, keep_scale, philox4x32, threshold


# Random123's kat_vectors for philox4x32_R(10): (counter, key) -> words
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,expected", KAT)
def test_philox_known_answers(counter, key, expected):
    assert tuple(int(w) for w in philox4x32(counter, key)) == expected



def philox_multiplies(ptx: str) -> int:
    """The Philox rounds' 32 x 32 -> 64-bit multiplies in PTX (mul.wide.u32 by one of the
    round multipliers), not the address arithmetic that also uses mul.wide."""
    from cute_attn.dropout import PHILOX_M

    found = re.findall(r"mul\.wide\.u32\s+%rd\d+, %r\d+, (-?\d+);", ptx)
    return sum(1 for value in found if int(value) % (1 << 32) in PHILOX_M)

def test_philox_vectorised_equals_scalar():
    c0 = torch.arange(50, dtype=torch.int64) * 977
    words = philox4x32((c0, 3, 4, 5), (11, 12))
    for i in (0, 17, 49):
        scalar = philox4x32((int(c0[i]), 3, 4, 5), (11, 12))
        assert all(int(w[i]) == int(s) for w, s in zip(words, scalar))


def _seed(a, b):
    return torch.tensor([a, b], dtype=torch.int32)


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_keep_rate_within_binomial_bound(rate):
    keep = dropout_mask(_seed(7, -3), 2, 3, 200, 300, rate)
    p = threshold(rate) / 256  # the drop probability the byte threshold gives
    n = keep.numel()
    rate = keep.float().mean().item()
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(rate - (1 - p)) < 5 * sigma, f"keep rate {rate:.5f} vs {1 - p} (5 sigma {5 * sigma:.5f})"
    # rows and columns too: no structure in the layout of the units
    row_rates = keep.float().mean(-1).flatten()
    assert (row_rates - (1 - p)).abs().max() < 6 * math.sqrt(p * (1 - p) / 300)


def test_mask_depends_on_the_element_not_the_shape_or_tile():
    small = dropout_mask(_seed(1, 2), 2, 2, 40, 50, 0.3)
    big = dropout_mask(_seed(1, 2), 3, 4, 64, 80, 0.3)
    assert torch.equal(small, big[:2, :2, :40, :50])


def test_seeds_heads_and_batch_entries_draw_different_masks():
    a = dropout_mask(_seed(1, 2), 2, 2, 64, 64, 0.5)
    b = dropout_mask(_seed(1, 3), 2, 2, 64, 64, 0.5)
    assert (a != b).float().mean() > 0.4
    assert (a[0, 0] != a[0, 1]).float().mean() > 0.4 and (a[0, 0] != a[1, 0]).float().mean() > 0.4


def test_threshold_and_scale():
    assert threshold(0.0) == 0 and threshold(0.5) == 128 and threshold(0.9999) == 255
    assert keep_scale(0.1) == 1 / (1 - 26 / 256)


def test_mask_follows_the_group_layout():
    """Element (q, k)'s byte: group counter (q0, k0 & ~17, head, batch), word
    (k0 >> 4 & 1) * 2 + (k0 & 1), byte (q // 8 % 2) * 2 + k // 8 % 2 (dropout.py)."""
    seed, p = _seed(9, 8), 0.5
    keep = dropout_mask(seed, 2, 3, 40, 70, p)
    for b, h, q, k in ((0, 0, 0, 0), (1, 2, 13, 41), (1, 1, 39, 69), (0, 2, 24, 17)):
        q0, k0 = q - 8 * (q // 8 % 2), k - 8 * (k // 8 % 2)
        words = philox4x32((q0, k0 & ~17, h, b), (9, 8), PHILOX_ROUNDS)
        word = int(words[(k0 >> 4 & 1) * 2 + (k0 & 1)])
        byte = word >> (8 * ((q // 8 % 2) * 2 + k // 8 % 2)) & 0xFF
        assert bool(keep[b, h, q, k]) == (byte >= threshold(p))


def _cpu_qkv():
    return tuple(fake_cuda(torch.randn(1, 64, 2, 64, dtype=torch.bfloat16)) for _ in range(3))


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(dropout_p=1.0), ValueError, r"in \[0, 1\)"),
    (dict(dropout_p=-0.1), ValueError, r"in \[0, 1\)"),
    (dict(dropout_p=True), TypeError, "must be a float"),
    (dict(dropout_p="0.1"), TypeError, "must be a float"),
    (dict(dropout_p=0.1, dropout_seed=torch.zeros(2, dtype=torch.int64)), ValueError, "int32 tensor of shape"),
    (dict(dropout_p=0.1, dropout_seed=torch.zeros(3, dtype=torch.int32)), ValueError, "int32 tensor of shape"),
    (dict(dropout_p=0.1, dropout_seed=[1, 2]), TypeError, "must be a torch.Tensor"),
    (dict(dropout_p=0.0, dropout_seed=torch.zeros(2, dtype=torch.int32)), ValueError, "goes with dropout_p"),
    (dict(dropout_p=0.1, dropout_seed=torch.zeros(2, dtype=torch.int32)), ValueError, "dropout_seed is on cpu"),
    (dict(dropout_p=0.1, dropout_seed=torch.zeros(4, dtype=torch.int32)[::2]), ValueError,
     "dropout_seed must be contiguous"),
    (dict(dropout_p=np.float32(1.5)), ValueError, r"in \[0, 1\)"),  # a numpy scalar is a float, checked as one
    (dict(dropout_p=0.001), ValueError, "rounds to no dropout"),  # below 1/512: the 8-bit threshold is 0
])
def test_api_rejects_bad_dropout_arguments(kwargs, error, match, monkeypatch):
    monkeypatch.setattr(cute_attn.api, "_launcher_module", LauncherTrap(" on bad dropout arguments"))
    monkeypatch.setattr(validation, "_device_capability", lambda device: (9, 0))
    q, k, v = _cpu_qkv()
    with pytest.raises(error, match=match):
        cute_attn.mha(q, k, v, **kwargs)


@pytest.mark.parametrize("head_dim, score", [(128, "softcap"), (64, "alibi")])
def test_dropout_backward_with_a_score_derivative_compiles(head_dim, score):
    """Dropout beside a softcap or a score mod in the backward: dP^T takes the mask before
    the derivative folds in, P^T after dS^T. The two passes draw the same Philox words,
    which the compiler computes once (as many wide multiplies as a dropout backward
    without a score derivative) and keeps live across the fold: spill-free at head dim
    64; head dim 128 with a softcap spills 100 bytes (ptxas), accepted for this
    combination (without it the call had no backward at all)."""
    from cute_attn import masks
    from cute_attn import ptx as ptx_tool
    from cute_attn.config import AttnFeatures, bwd_config_for
    from cute_attn.launcher import BwdKey, compile_bwd

    plain = AttnFeatures(mask="causal", dropout=True)
    if score == "softcap":
        features = AttnFeatures(mask="causal", softcap=True, dropout=True)
    else:
        features = AttnFeatures(mask_mod=masks.causal().spec, score_mod=masks.alibi(torch.ones(2)).spec, dropout=True)
    counts = []
    for f in (plain, features):
        _, main, _ = compile_bwd(BwdKey("bf16", head_dim, f, bwd_config_for(head_dim, f), False), "--keep-ptx")
        counts.append(philox_multiplies(main.__ptx__))
    assert counts[1] == counts[0] > 0, counts
    report = ptx_tool.ptxas_report(main.__ptx__)
    if "ptxas not found" not in report and head_dim == 64:
        assert " 0 bytes spill stores" in report, report


def test_dropout_kernels_compile():
    """Forward and backward with dropout compile on the CPU (sm_90a), the Philox rounds
    in the PTX as 32 x 32 -> 64-bit multiplies."""
    from cute_attn.config import AttnFeatures, bwd_config_for, fwd_config_for
    from cute_attn.launcher import BwdKey, FwdKey, compile_bwd, compile_fwd

    features = AttnFeatures(mask="causal", dropout=True)
    fwd = compile_fwd(FwdKey("bf16", 128, features, fwd_config_for(128, features)), "--keep-ptx").__ptx__
    _, main, _ = compile_bwd(BwdKey("bf16", 128, features, bwd_config_for(128, features), False), "--keep-ptx")
    for ptx in (fwd, main.__ptx__):
        assert "wgmma.mma_async" in ptx and philox_multiplies(ptx) >= 20
    # the backward's lane pairs share each call: one computes it, a shuffle (xor 4)
    # passes the other its word
    assert "shfl.sync.bfly.b32" in main.__ptx__


def _varlen_qkv():
    q, k, v = (fake_cuda(torch.randn(70, 2, 64, dtype=torch.bfloat16)) for _ in range(3))
    cu = fake_cuda(torch.tensor([0, 30, 70], dtype=torch.int32))
    return q, k, v, cu


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(dropout_p=1.0), ValueError, r"in \[0, 1\)"),
    (dict(dropout_p=0.1, dropout_seed=torch.zeros(3, dtype=torch.int32)), ValueError, "int32 tensor of shape"),
    (dict(learnable_sink=torch.zeros(3)), ValueError, r"shape \(nheads,\) = \(2,\)"),
    (dict(learnable_sink=torch.zeros(2, dtype=torch.int32)), TypeError, "float32, bfloat16 or float16"),
    (dict(learnable_sink=torch.zeros(2)), ValueError, "learnable_sink is on cpu"),
])
def test_varlen_rejects_bad_sink_and_dropout_arguments(kwargs, error, match, monkeypatch):
    monkeypatch.setattr(cute_attn.api, "_launcher_module", LauncherTrap(" on bad varlen sink/dropout arguments"))
    monkeypatch.setattr(validation, "_device_capability", lambda device: (9, 0))
    q, k, v, cu = _varlen_qkv()
    with pytest.raises(error, match=match):
        cute_attn.mha_varlen(q, k, v, cu, cu, 40, 40, check_cu_seqlens=False, **kwargs)


def test_padded_rows_follow_the_backward_statistics_layout():
    """launcher._padded_rows: sequence b's rows start at (cu[b] + b * tile_m) // tile_m *
    tile_m (blocks/seqlen.py), computed per token on the device side."""
    from cute_attn.launcher import _padded_rows

    lengths, tile_m = [5, 0, 130, 1, 64], 64
    cu_short = torch.tensor([0, 5, 5, 135], dtype=torch.int32)  # unchecked offsets ending short of the tokens
    assert _padded_rows(cu_short, 140, tile_m).shape == (140,)
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    rows = _padded_rows(cu, int(cu[-1]), tile_m).tolist()
    expect = [(int(cu[b]) + b * tile_m) // tile_m * tile_m + i for b, n in enumerate(lengths) for i in range(n)]
    assert rows == expect
    assert len(set(rows)) == len(rows) and max(rows) < int(cu[-1]) + len(lengths) * tile_m


def test_varlen_sink_and_dropout_kernels_compile():
    """Packed sequences through the mods' entry points compile on the CPU (sm_90a): a
    sink alone (forward; its backward is the dense varlen one) and dropout with a sink,
    forward and backward."""
    from cute_attn.config import AttnFeatures, bwd_config_for, fwd_config_for
    from cute_attn.launcher import BwdKey, FwdKey, compile_bwd, compile_fwd

    for features in (AttnFeatures(mask="causal", varlen=True, sink=True),
                     AttnFeatures(mask="local", varlen=True, sink=True, dropout=True)):
        fwd = compile_fwd(FwdKey("bf16", 128, features, fwd_config_for(128, features)), "--keep-ptx").__ptx__
        assert "wgmma.mma_async" in fwd and "FlashFwdSm90Mods" in fwd
    features = dataclasses.replace(features, sink=False)  # run_bwd drops the sink: it is in lse
    _, main, _ = compile_bwd(BwdKey("bf16", 128, features, bwd_config_for(128, features), False), "--keep-ptx")
    assert "wgmma.mma_async" in main.__ptx__ and philox_multiplies(main.__ptx__) >= 20


def _prmt(a: int, b: int, selector: int) -> int:
    """PTX prmt.b32 (default mode) on Python ints: byte i of the result is byte s & 7 of
    the 8-byte (b, a), or that byte's sign replicated when s & 8 (s: selector nibble i)."""
    pool = a | b << 32
    out = 0
    for i in range(4):
        s = selector >> (4 * i) & 0xF
        byte = pool >> (8 * (s & 7)) & 0xFF
        out |= (0xFF if byte & 0x80 else 0) << (8 * i) if s & 8 else byte << (8 * i)
    return out


def test_keep_flags_and_pair_masks_decide_like_a_byte_compare():
    """The forward's word-wise dropout (blocks/dropout.py keep_flags, apply_to_pairs),
    its arithmetic on Python ints: bit 7 of each flag byte is (byte >= threshold) for
    every threshold, and a pair's prmt mask is all ones in the half whose element is
    kept (e = 0 from the first flag word, e = 1 from the second, byte rh * 2 + kh)."""
    import random

    rng = random.Random(0)
    words = [rng.getrandbits(32) for _ in range(600)] + [0, 0xFFFFFFFF, 0x7F7F7F7F, 0x80808080, 0x00FF7F80]
    for t in range(256):
        low = (t & 0x7F) * 0x01010101
        top_clear = (0 - (1 - (t >> 7))) & 0xFFFFFFFF  # all ones iff t < 128
        flags = []
        for w in words:
            x = ((w | 0x80808080) - low) & 0xFFFFFFFF
            f = (w & x) | ((w | x) & top_clear)
            for i in range(4):
                assert (f >> (8 * i + 7)) & 1 == ((w >> (8 * i) & 0xFF) >= t), (hex(w), t, i)
            flags.append(f)
        for f0, f1, w0, w1 in zip(flags[::2], flags[1::2], words[::2], words[1::2]):
            for byte in range(4):
                sel = (8 | byte) | (8 | byte) << 4 | (12 | byte) << 8 | (12 | byte) << 12
                mask = _prmt(f0, f1, sel)
                assert mask & 0xFFFF == (0xFFFF if (w0 >> (8 * byte) & 0xFF) >= t else 0)
                assert mask >> 16 == (0xFFFF if (w1 >> (8 * byte) & 0xFF) >= t else 0)
