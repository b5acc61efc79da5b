"""Review of the FP8 forward's host side (session 32), on the CPU: the descales and a sink
are read by the kernel through their addresses, so they get the memory checks q, k and v
get; quantize_fp8 has no host read under torch.compile; mha_with_kvcache refuses e4m3
naming itself. Devices are faked (cpu_standin.fake_cuda, capability monkeypatched)."""

import pytest
import torch

import cute_attn
from cpu_standin import LauncherTrap, fake_cuda
from test_validation_review_cpu import _Wrapper  # a DTensor-like wrapper: cuda:0, no storage
from cute_attn import api, validation

FP8 = torch.float8_e4m3fn


@pytest.fixture
def trapped(monkeypatch):
    monkeypatch.setattr(api, "_launcher_module", LauncherTrap(" (a bad descale or sink got through)"))
    monkeypatch.setattr(validation, "_device_capability", lambda device: (9, 0))


def _qkv():
    torch.manual_seed(0)
    return [fake_cuda(torch.randn(2, s, n, 128).to(FP8)) for s, n in ((16, 4), (24, 2), (24, 2))]


@pytest.mark.parametrize("make", [lambda: fake_cuda(torch._neg_view(torch.ones(2, 2))),
                                  lambda: _Wrapper(torch.ones(2, 2))], ids=["negative-bit-view", "wrapper"])
def test_a_descale_gets_the_memory_checks_of_q_k_v(trapped, make):
    """A negative-bit view would be read as +descale (the output's sign flipped silently);
    a wrapper subclass has address 0 (an illegal access in the kernel)."""
    with pytest.raises(ValueError, match="k_descale"):
        cute_attn.mha(*_qkv(), k_descale=make())


def test_a_negative_bit_view_sink_is_resolved_and_a_wrapper_sink_refused(trapped):
    from cute_attn.api import _checked_sink

    q = _qkv()[0]
    sink = _checked_sink(fake_cuda(torch._neg_view(torch.full((4,), 2.0))), q)
    assert not sink.is_neg() and torch.equal(sink, torch.full((4,), -2.0))
    with pytest.raises(ValueError, match="learnable_sink"):
        cute_attn.mha(*_qkv(), learnable_sink=_Wrapper(torch.zeros(4)))


def test_quantize_fp8_traces_without_a_graph_break():
    """quantize_fp8 under torch.compile(fullgraph=True): no host read of device values (the
    finiteness check runs eagerly only), the same results as eager."""
    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    compiled = torch.compile(cute_attn.quantize_fp8, fullgraph=True, backend="eager")
    for got, want in zip(compiled(q, q, q), cute_attn.quantize_fp8(q, q, q)):
        assert torch.equal(got.float(), want.float())
    bad = q.clone()
    bad[0, 3, 1, 5] = float("nan")
    with pytest.raises(ValueError, match="^v has non-finite"):
        cute_attn.quantize_fp8(q, q, bad)


def test_kvcache_refuses_fp8_naming_itself():
    with pytest.raises(NotImplementedError, match="mha_with_kvcache has no FP8 path"):
        cute_attn.mha_with_kvcache(*_qkv(), cache_seqlens=fake_cuda(torch.zeros(2, dtype=torch.int32)))
