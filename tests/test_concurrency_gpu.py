"""Concurrency on an sm_90 GPU: two threads with a cold compile cache, and two CUDA streams.

- Threads: both call mha on a specialisation nobody has compiled in this process (the
  launcher's cache swapped for an empty one); a barrier releases them together, so both
  miss the cache at once. The launcher must compile it exactly once (its lock) and both
  results must be right.
- Streams: two problems launched on two side streams without synchronising in between,
  so their kernels may overlap; each result must match its own reference. The launcher
  launches on torch's current stream, so a kernel on the wrong stream would race the
  input copy (filled on that side stream just before) or the read of the output.
"""

import threading

import pytest
import torch
from gpu_helpers import exact_fp32_matmul, forget_bound_launches  # noqa: F401 (fixture)

import cute_attn
from cute_attn import launcher
from cute_attn.reference import attention_ref

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


def _inputs(seed, b=2, s=333, h=4, d=128, dtype=BF16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(b, s, h, d, device="cuda", dtype=dtype, generator=g) for _ in range(3)]


def _assert_matches_reference(q, k, v, out, **kw):
    ref, _ = attention_ref(q, k, v, **kw)
    ref_lp, _ = attention_ref(q, k, v, upcast=False, **kw)
    err = (out.float() - ref).abs().max().item()
    err_lp = (ref_lp.float() - ref).abs().max().item()
    assert err <= 2 * err_lp + 1e-5, (err, err_lp)


def test_two_threads_cold_cache_compile_once(monkeypatch):
    monkeypatch.setattr(launcher, "_cache", {})
    monkeypatch.setattr(launcher, "_default_configs", {})
    forget_bound_launches(monkeypatch)
    compiles = []
    real_compile_fwd = launcher.compile_fwd

    def counting_compile_fwd(key, *args, **kwargs):
        compiles.append(key)
        return real_compile_fwd(key, *args, **kwargs)

    monkeypatch.setattr(launcher, "compile_fwd", counting_compile_fwd)
    # fp16, head dim 96, a window and a softcap: a specialisation of its own
    kw = dict(window_size=(50, 7), softcap=20.0)
    inputs = [_inputs(seed, d=96, dtype=torch.float16) for seed in (1, 2)]
    outs, errors = [None, None], []
    start = threading.Barrier(2)

    def worker(i):
        try:
            start.wait()
            outs[i] = cute_attn.mha(*inputs[i], **kw)
            torch.cuda.current_stream().synchronize()
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(compiles) == 1, compiles
    for (q, k, v), out in zip(inputs, outs):
        _assert_matches_reference(q, k, v, out, **kw)


@pytest.mark.parametrize("second", ["full", "causal"])
def test_two_streams_at_once(second):
    """Two calls on two streams overlapping. Both causal: two persistent forwards taking
    tiles from their tile queues at once (512 and 256 tiles, more than the SMs), which
    must be one counter per stream (with one shared counter each call's CTAs would take
    tickets the other call drew: tiles of both left unwritten, caught by the reference)."""
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    shapes = [dict(b=4, s=2048, h=8), dict(b=2, s=1000, h=16)]
    kws = [dict(causal=True), dict(causal=second == "causal")]
    cute_attn.mha(*_inputs(0, **shapes[0]), **kws[0])  # compile outside the timed overlap
    cute_attn.mha(*_inputs(0, **shapes[1]), **kws[1])
    torch.cuda.synchronize()
    results = []
    for stream, shape, kw, seed in zip(streams, shapes, kws, (3, 4)):
        with torch.cuda.stream(stream):
            q, k, v = _inputs(seed, **shape)  # made on the side stream
            out = cute_attn.mha(q, k, v, **kw)
            results.append((q, k, v, out, kw))
    torch.cuda.synchronize()
    for q, k, v, out, kw in results:
        _assert_matches_reference(q, k, v, out, **kw)


def test_backward_on_two_streams_at_once():
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    results = []
    for stream, seed in zip(streams, (5, 6)):
        with torch.cuda.stream(stream):
            q, k, v = (t.requires_grad_() for t in _inputs(seed, s=700))
            dout = torch.randn_like(q)
            grads = torch.autograd.grad(cute_attn.mha(q, k, v, causal=True), (q, k, v), dout)
            results.append((q, k, v, dout, grads))
    torch.cuda.synchronize()
    for q, k, v, dout, grads in results:
        leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
        ref, _ = attention_ref(*leaves, causal=True)
        ref_grads = torch.autograd.grad(ref, leaves, dout.float())
        lp = [t.detach().requires_grad_() for t in (q, k, v)]
        ref_lp, _ = attention_ref(*lp, causal=True, upcast=False)
        lp_grads = torch.autograd.grad(ref_lp, lp, dout)
        for g, gr, gl in zip(grads, ref_grads, lp_grads):
            err = (g.float() - gr).abs().max().item()
            err_lp = (gl.float() - gr).abs().max().item()
            assert err <= 2 * err_lp + 1e-3, (err, err_lp)
