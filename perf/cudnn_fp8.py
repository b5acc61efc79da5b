"""cuDNN's FP8 (e4m3) attention forward through nvidia-cudnn-frontend's graph API: issue 13's
anchor in perf/bench_fp8.py. An anchor only, never a dependency of the package: its wheel
travels to the GPU machine in a second call while the machine is warm (../shared/GPU.md:
`pip install --no-index --no-deps --target /tmp/site nvidia_cudnn_frontend-*.whl`), and
without it `unavailable()` says why and the benchmark records the skip.

What cuDNN computes differs from cute_attn's FP8 call in ways a reader of the numbers
should know:
- scales are per tensor (one descale each for q, k and v; a scale and a descale for S,
  the softmax's P quantised to e4m3; a scale for O), where cute_attn takes one descale
  per (batch entry, KV head); the benchmark quantises the same bf16 inputs per tensor
  for it (`quantize_per_tensor`);
- on Hopper O comes out in e4m3 (cuDNN writes a bf16 O on Blackwell only), half of
  cute_attn's bf16 output bytes;
- the layout is cute_attn's (batch, seqlen, heads, head_dim), described to cuDNN as
  (batch, heads, seqlen, head_dim) with the matching strides, so nothing is copied;
- its causal mask is top-left aligned, the same as cute_attn's bottom-right for the
  square (seqlen_q == seqlen_k) sweep; a causal call with seqlen_q != seqlen_k raises
  NotImplementedError rather than time another problem.
"""

E4M3_MAX = 448.0
# P in [0, 1] scaled onto e4m3's range before rounding, as cute_attn's own FP8 path does
# (cute_attn.fp8's p_scale): the same precision for P on both sides
P_SCALE = 256.0


def unavailable():
    """None when nvidia-cudnn-frontend imports, else the reason (a recorded skip)."""
    try:
        import cudnn  # noqa: F401
    except Exception as exc:  # noqa: BLE001 (an ImportError, or a library it cannot load)
        return f"nvidia-cudnn-frontend not importable: {type(exc).__name__}: {exc}"
    return None


def versions():
    """The frontend's and the cuDNN library's versions, for the results file."""
    import cudnn

    backend = getattr(cudnn, "backend_version", None)
    return {"frontend": getattr(cudnn, "__version__", None), "cudnn": backend() if callable(backend) else None}


def quantize_per_tensor(x):
    """(e4m3 tensor, float32 descale of shape (1, 1, 1, 1)): x / descale fits e4m3."""
    import torch

    descale = (x.abs().amax().float() / E4M3_MAX).clamp_min(1e-12).reshape(1, 1, 1, 1)
    return (x.float() / descale).to(torch.float8_e4m3fn), descale


def prepare(q, k, v):
    """cuDNN's inputs for bf16 q, k, v (batch, seqlen, heads, head_dim): (q8, k8, v8,
    scales), the six per-tensor scale tensors its graph reads, made once outside any
    timing. O comes out scaled by 1 / v's descale (in v's quantised range), so
    O_real = O * scales["descale_v"]."""
    import torch

    (q8, dq), (k8, dk), (v8, dv) = (quantize_per_tensor(t) for t in (q, k, v))
    one = dict(dtype=torch.float32, device=q.device)
    scales = {"descale_q": dq, "descale_k": dk, "descale_v": dv,
              "descale_s": torch.full((1, 1, 1, 1), 1 / P_SCALE, **one),
              "scale_s": torch.full((1, 1, 1, 1), P_SCALE, **one), "scale_o": 1 / dv}
    return q8, k8, v8, scales


class CudnnFp8Attention:
    """cuDNN's FP8 SDPA forward, one graph built per (shapes, strides, causal) and reused:
    call(q8, k8, v8, scales, causal) with `prepare`'s scales -> O in e4m3."""

    SCALES = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")

    def __init__(self):
        import cudnn

        self.cudnn = cudnn
        self.handle = cudnn.create_handle()
        self.graphs = {}

    def _build(self, q8, k8, v8, causal):
        cudnn = self.cudnn
        e4m3, fp32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        graph = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=fp32, compute_data_type=fp32,
                              handle=self.handle)

        def bhsd(name, t):  # (b, s, h, d) memory seen as (b, h, s, d)
            b, s, h, d = t.shape
            sb, ss, sh, sd = t.stride()
            return graph.tensor(name=name, dim=[b, h, s, d], stride=[sb, sh, ss, sd], data_type=e4m3)

        scalars = {name: graph.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=fp32)
                   for name in self.SCALES}
        q, k, v = bhsd("q", q8), bhsd("k", k8), bhsd("v", v8)
        o, _, amax_s, amax_o = graph.sdpa_fp8(
            q=q, k=k, v=v, **scalars, is_inference=True, attn_scale=q8.shape[-1] ** -0.5,
            use_causal_mask=causal, name="sdpa_fp8")
        b, s, h, d = q8.shape
        o.set_output(True).set_dim([b, h, s, d]).set_stride([s * h * d, d, h * d, 1]).set_data_type(e4m3)
        for amax in (amax_s, amax_o):
            amax.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(fp32)
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        return graph, (q, k, v, o, amax_s, amax_o), scalars

    def __call__(self, q8, k8, v8, scales, causal):
        import torch

        if causal and q8.shape[1] != k8.shape[1]:
            # use_causal_mask is top-left aligned: another problem than cute_attn's there
            raise NotImplementedError(f"cuDNN's causal mask is top-left aligned, cute_attn's bottom-right: "
                                      f"they differ at seqlen_q {q8.shape[1]} != seqlen_k {k8.shape[1]}")
        key = (q8.shape, k8.shape, q8.stride(), k8.stride(), v8.stride(), causal)
        entry = self.graphs.get(key)
        if entry is None:
            graph, tensors, scalars = self._build(q8, k8, v8, causal)
            workspace = torch.empty(graph.get_workspace_size(), dtype=torch.uint8, device=q8.device)
            entry = self.graphs[key] = (graph, tensors, scalars, workspace)
        graph, (q, k, v, o, amax_s, amax_o), scalars, workspace = entry
        out = torch.empty(q8.shape, dtype=q8.dtype, device=q8.device)  # (b, s, h, d), as o's strides say
        amaxes = torch.empty(2, 1, 1, 1, 1, dtype=torch.float32, device=q8.device)
        pack = {q: q8, k: k8, v: v8, o: out, amax_s: amaxes[0], amax_o: amaxes[1]}
        pack.update({scalars[name]: scales[name] for name in self.SCALES})
        self.cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
        graph.execute(pack, workspace, handle=self.handle)
        return out
