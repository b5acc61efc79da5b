"""Sequence lengths of the (batch, head) a CTA works on.

Dense batches read them off the tensor shapes; variable-length batches will read offsets
from cu_seqlens here, so kernels never compute sequence bounds themselves.
"""

from cutlass import Int32

from cute_attn.blocks.staged import Staged


class SeqlenInfo(Staged):
    def __init__(self, seqlen_q: Int32, seqlen_k: Int32):
        self.seqlen_q = seqlen_q
        self.seqlen_k = seqlen_k
