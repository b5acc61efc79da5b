"""The single-GPU attention a context-parallel step runs on its rank, behind one small
interface so that the ring and all-to-all logic can be tested on CPUs (gloo) with the fp32
reference standing in for the kernels:

  block_forward(q, k, v, causal, scale, softcap, window=(-1, -1)) -> (out, lse)
      attention of q over this block of keys alone (out normalised within the block, lse
      float32 (batch, heads, seqlen_q)): a partial for the LSE merge. Masks align
      bottom-right, as mha's.
  block_backward(dout, q, k, v, out, lse, causal, scale, softcap, window=(-1, -1)) -> (dq, dk, dv)
      this block's share of the gradients, given the whole row's out and lse (the merged
      ones): P = exp(S - lse) is then the block's slice of the full softmax, and
      dS = P (dP - rowsum(dO * O)) its slice of the full dS.
  varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                 scale, softcap) -> (out, lse)
  varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                  max_seqlen_k, causal, scale, softcap) -> (dq, dk, dv)
      the same over packed batches ((total, heads, head_dim) tensors, lse (heads, total)),
      sequences with no queries or no keys allowed.
  merge(o_part, lse_part, out, lse)
      the LSE merge of splits stacked on the batch mode (kernels/combine.py's layout).
  attention(q, k, v, causal, scale, window_size, softcap) -> (out, lse)
      whole attention under autograd (the all-to-all variant's local call).
"""

import torch

from cute_attn import reference


class KernelAttention:
    """cute_attn's kernels (CUDA tensors, 16-bit)."""

    def block_forward(self, q, k, v, causal, scale, softcap, window=(-1, -1)):
        from cute_attn import api

        return api.mha(q, k, v, causal=causal, softmax_scale=scale, softcap=softcap, window_size=window,
                       return_lse=True)

    def block_backward(self, dout, q, k, v, out, lse, causal, scale, softcap, window=(-1, -1)):
        from cute_attn import api, launcher
        from cute_attn.validation import prepare_dout

        features, args = api._features_and_args(causal, window, softcap, scale)
        return launcher.run_bwd(prepare_dout(dout, out), q, k, v, out, lse, features, args)

    def varlen_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, softcap):
        from cute_attn import api

        return api.mha_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, softmax_scale=scale, softcap=softcap,
                              return_lse=True, check_cu_seqlens=False)

    def varlen_backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, softcap):
        from cute_attn import api, launcher
        from cute_attn.validation import prepare_dout

        features, args = api._features_and_args(causal, (-1, -1), softcap, scale, varlen=(cu_q, cu_k, max_q, max_k))
        return launcher.run_bwd(prepare_dout(dout, out), q, k, v, out, lse, features, args)

    def merge(self, o_part, lse_part, out, lse):
        from cute_attn import launcher

        launcher.run_combine(o_part, lse_part, out, lse)

    def attention(self, q, k, v, causal, scale, window_size, softcap):
        from cute_attn import api

        return api.mha(q, k, v, causal=causal, softmax_scale=scale, window_size=window_size, softcap=softcap,
                       return_lse=True)


class ReferenceAttention:
    """The float32 reference (cute_attn.reference), on any device: the stand-in of the
    CPU tests. Outputs float32 whatever the input dtype."""

    def block_forward(self, q, k, v, causal, scale, softcap, window=(-1, -1)):
        return reference.attention_ref(q, k, v, causal=causal, softmax_scale=scale, softcap=softcap,
                                       window_size=window)

    def block_backward(self, dout, q, k, v, out, lse, causal, scale, softcap, window=(-1, -1)):
        return reference.grads_from_lse(dout, q, k, v, out, lse, softmax_scale=scale, causal=causal,
                                        window_size=window, softcap=softcap)

    def varlen_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, softcap):
        return reference.attention_ref_varlen(q, k, v, cu_q, cu_k, causal=causal, softmax_scale=scale,
                                              softcap=softcap)

    def varlen_backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, softcap):
        """block_backward per sequence (a host read of the offsets: a test stand-in)."""
        dq = torch.zeros_like(q, dtype=torch.float32)
        dk = torch.zeros_like(k, dtype=torch.float32)
        dv = torch.zeros_like(v, dtype=torch.float32)
        for q0, q1, k0, k1 in zip(cu_q.tolist(), cu_q.tolist()[1:], cu_k.tolist(), cu_k.tolist()[1:]):
            if q1 > q0 and k1 > k0:
                grads = self.block_backward(dout[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1],
                                            out[None, q0:q1], lse[None, :, q0:q1], causal, scale, softcap)
                dq[q0:q1], dk[k0:k1], dv[k0:k1] = (g[0] for g in grads)
        return dq, dk, dv

    def merge(self, o_part, lse_part, out, lse):
        batch = out.shape[0]
        splits = o_part.shape[0] // batch
        merged, merged_lse = reference.combine_splits(o_part.view(splits, batch, *o_part.shape[1:]),
                                                      lse_part.view(splits, batch, *lse_part.shape[1:]))
        out.copy_(merged)
        lse.copy_(merged_lse)

    def attention(self, q, k, v, causal, scale, window_size, softcap):
        return reference.attention_ref(q, k, v, causal=causal, softmax_scale=scale, window_size=window_size,
                                       softcap=softcap)
