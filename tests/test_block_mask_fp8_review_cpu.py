"""CPU tests from a review of create_block_mask / the block-mask caches and of
quantize_fp8: each block-mask test failed before its fix in cute_attn/block_mask.py; the
FP8 test pins down properties the review checked (FlashAttention-3's descale convention,
e4m3 rounding, saturation, -0.0, strided inputs) and found right."""

import gc
import weakref
from collections import OrderedDict

import pytest
import torch

import cute_attn
from cute_attn import block_mask as bm
from cute_attn import masks
from cpu_standin import fake_cuda


# ----------------------------------------------------------------------------------------
# create_block_mask / create_varlen_block_mask: arguments
# ----------------------------------------------------------------------------------------


def test_aux_tensor_too_small_is_a_value_error_not_an_index_past_it():
    """The builder evaluates the mod with raw indices (no clamp, unlike the kernels): an aux
    tensor smaller than the batch, the heads or the tokens was indexed past its end, an
    IndexError on the CPU and a device-side assert (a dead CUDA context) on the GPU."""
    ids = torch.zeros(2, 50, dtype=torch.int32)
    with pytest.raises(ValueError, match="aux tensor 0 has shape"):
        cute_attn.create_block_mask(masks.document(ids), 4, 1, 50, 50, device="cpu")  # batch 4 > 2
    with pytest.raises(ValueError, match="aux tensor 0 has shape"):
        cute_attn.create_block_mask(masks.document(ids), 2, 1, 100, 100, device="cpu")  # 100 tokens > 50
    with pytest.raises(ValueError, match="aux tensor 0 has shape"):
        # batch 3, 2 prefix lengths
        cute_attn.create_block_mask(masks.prefix_lm(torch.tensor([3, 4])), 3, 1, 10, 10, device="cpu")
    cute_attn.create_block_mask(masks.document(ids), 2, 1, 50, 50, device="cpu")  # fits: builds
    cu = torch.tensor([0, 20, 40], dtype=torch.int32)
    with pytest.raises(ValueError, match="aux tensor 0 has shape"):  # packed ids for 30 of 40 tokens
        cute_attn.create_varlen_block_mask(masks.document(torch.zeros(30, dtype=torch.int32)), cu, cu, 1,
                                           device="cpu")
    with pytest.raises(ValueError, match="aux tensor 0 has shape"):  # 2 sequences, 1 prefix length
        cute_attn.create_varlen_block_mask(masks.prefix_lm(torch.tensor([3])), cu, cu, 1, device="cpu")
    cute_attn.create_varlen_block_mask(masks.document(torch.zeros(40, dtype=torch.int32)), cu, cu, 1, device="cpu")


@pytest.mark.parametrize("kwargs, name", [
    (dict(batch=None), "batch"),  # FlexAttention's B=None
    (dict(heads=None), "heads"),
    (dict(seqlen_q=100.0), "seqlen_q"),  # failed deep inside torch's expand()
    (dict(seqlen_k=True), "seqlen_k"),
])
def test_shape_arguments_must_be_ints(kwargs, name):
    args = dict(batch=1, heads=2, seqlen_q=100, seqlen_k=100) | kwargs
    with pytest.raises(TypeError, match=f"{name} must be an int"):
        cute_attn.create_block_mask(masks.causal(), args["batch"], args["heads"], args["seqlen_q"], args["seqlen_k"],
                                    device="cpu")


def test_varlen_offsets_must_be_non_decreasing():
    """A negative length built a mask (its rows EMPTY) instead of refusing the offsets."""
    with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
        cute_attn.create_varlen_block_mask(masks.causal(), [0, 10, 5], [0, 10, 20], 1, device="cpu")
    with pytest.raises(ValueError, match="cu_seqlens_k must be non-decreasing"):
        cute_attn.create_varlen_block_mask(masks.causal(), [0, 10, 20], [0, 10, 5], 1, device="cpu")


# ----------------------------------------------------------------------------------------
# The caches under CUDA graph capture (simulated: no GPU here)
# ----------------------------------------------------------------------------------------


class _Lists:
    """A stand-in for a built BlockMask that can be weakly referenced."""


@pytest.fixture
def capture(monkeypatch):
    """A CUDA device whose stream capture is switched by state["on"], builds that return a
    fresh _Lists, and empty caches."""
    state = {"on": False, "builds": 0}

    def build(*args, **kwargs):
        state["builds"] += 1
        return _Lists()

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["on"])
    monkeypatch.setattr(bm, "build_block_mask", build)
    monkeypatch.setattr(bm, "build_varlen_block_mask", build)
    monkeypatch.setattr(bm, "_cache", OrderedDict())
    monkeypatch.setattr(bm, "_varlen_cache", OrderedDict())
    monkeypatch.setattr(bm, "_held_by_graphs", {}, raising=False)
    return state


def test_a_mask_built_during_capture_is_not_remembered(capture):
    """Under capture the build's kernels are recorded, not run: its lists hold nothing until
    the graph replays. Cached, an eager call of that shape got them (garbage tile indices)."""
    mod, cuda = masks.causal(), torch.device("cuda", 0)
    capture["on"] = True
    a = bm.cached_block_mask(mod, 1, 2, 300, 300, 128, 128, cuda)
    assert not bm._cache, "a capture's build must not enter the cache"
    capture["on"] = False
    b = bm.cached_block_mask(mod, 1, 2, 300, 300, 128, 128, cuda)
    assert b is not a and capture["builds"] == 2
    assert bm.cached_block_mask(mod, 1, 2, 300, 300, 128, 128, cuda) is b  # eager: remembered


def test_a_mask_a_capture_used_outlives_its_cache_entry(capture):
    """A graph replays with the lists' addresses: an entry it hit (built by the warm-up) must
    not be freed when the LRU evicts it or an aux tensor changes, or replays read memory
    the allocator has handed to other tensors."""
    cuda = torch.device("cuda", 0)
    ids = torch.zeros(1, 300, dtype=torch.int32)
    mod = masks.document(ids)
    warm = bm.cached_block_mask(mod, 1, 2, 300, 300, 128, 128, cuda)
    capture["on"] = True
    assert bm.cached_block_mask(mod, 1, 2, 300, 300, 128, 128, cuda) is warm  # the capture hits
    capture["on"] = False
    alive = weakref.ref(warm)
    del warm
    ids.add_(1)  # a new version: the next eager call replaces the entry
    bm.cached_block_mask(mod, 1, 2, 300, 300, 128, 128, cuda)
    bm._cache.clear()
    gc.collect()
    assert alive() is not None, "the captured graph's lists were freed"

    cu = fake_cuda(torch.tensor([0, 100, 300], dtype=torch.int32))  # the offsets' device decides
    warm = bm.cached_varlen_block_mask(masks.causal(), cu, cu, 2, 128, 128)
    capture["on"] = True
    assert bm.cached_varlen_block_mask(masks.causal(), cu, cu, 2, 128, 128) is warm
    alive = weakref.ref(warm)
    del warm
    bm._varlen_cache.clear()
    gc.collect()
    assert alive() is not None


def test_caches_on_the_cpu_never_ask_cuda_about_capture(monkeypatch):
    """torch.cuda.is_current_stream_capturing raises in CPU builds of torch."""
    def refuse():
        raise AssertionError("asked on a CPU device")

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", refuse)
    ids = torch.zeros(1, 40, dtype=torch.int32)
    a = bm.cached_block_mask(masks.document(ids), 1, 1, 40, 40, 8, 8, "cpu")
    assert bm.cached_block_mask(masks.document(ids), 1, 1, 40, 40, 8, 8, "cpu") is a


# ----------------------------------------------------------------------------------------
# quantize_fp8: properties checked by the review (no bug found)
# ----------------------------------------------------------------------------------------


@pytest.mark.skipif(getattr(torch, "float8_e4m3fn", None) is None, reason="torch without float8_e4m3fn")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_quantize_fp8_convention_rounding_and_signs(dtype):
    # one (batch, kv head) slice of amax 7: scale 64, descale 7 / 448 = 1 / 64, all exact
    x = torch.zeros(1, 1, 1, 16)
    x[0, 0, 0, :9] = torch.tensor([7.0, -7.0, -0.0, 1.0625 / 64, 1.1875 / 64, 2.0 ** -15, 3 * 2.0 ** -16, 1e-9, 3.5])
    q8, k8, v8, qd, kd, vd = cute_attn.quantize_fp8(x.to(dtype), x.to(dtype), x.to(dtype))
    assert qd.dtype == torch.float32 and qd.shape == (1, 1) and qd.item() == 7.0 / 448
    stored = q8.float()[0, 0, 0, :9]
    # amax -> +-448 (no NaN: torch's cast past 448 is NaN); ties to even (1.0625 -> 1,
    # 1.1875 -> 1.25, 1.5 subnormal units -> 2); the smallest subnormal 2^-9 kept; 1e-9 -> 0
    assert stored.tolist() == [448.0, -448.0, 0.0, 1.0, 1.25, 2.0 ** -9, 2.0 ** -8, 0.0, 224.0]
    assert torch.signbit(stored[2]), "-0.0 keeps its sign (e4m3 0x80)"
    # FlashAttention-3's convention: real = stored * descale
    assert torch.equal(stored[[0, 1, 8]] * qd.item(), torch.tensor([7.0, -7.0, 3.5]))
    # a strided (b, h, s, d)-major input quantises to the same values as its contiguous copy
    q = torch.randn(2, 4, 6, 64).to(dtype).transpose(1, 2)
    k = torch.randn(2, 2, 6, 64).to(dtype).transpose(1, 2)
    strided, dense = cute_attn.quantize_fp8(q, k, k), cute_attn.quantize_fp8(q.contiguous(), k.contiguous(),
                                                                              k.contiguous())
    assert all(torch.equal(a.float(), b.float()) for a, b in zip(strided, dense))
