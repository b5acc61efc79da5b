"""Mask and score mods (cute_attn/masks.py) applied to a score tile in registers, and the
block-mask tile lists that say which KV tiles a query tile visits (cute_attn/block_mask.py).

The mods are Python functions traced here with scalar Int32 indices: each element of the
tile calls the body once, and the compiler shares what the elements of a row (or column)
have in common. Indices are global (the sequence's offset added, masks.py) and clamped
into the sequence before the call, so a mod that reads an aux tensor at q_idx or kv_idx
never reads past the entry's rows, whatever the tile's padding. Keys past the sequence's
end are masked here too: a block mask lists the last KV tile as PARTIAL whenever it is
cut, so FULL tiles need no mask at all.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cute_attn.blocks.mma_sm90 import acc_as_rows_cols
from cute_attn.blocks.seqlen import SeqlenInfo
from cute_attn.blocks.staged import Staged
from cute_attn.masks import Dual, SeqInfo


class ModTile(Staged):
    """The mods of one kernel for one work tile: batch entry b, query head h."""

    def __init__(self, mask_mod, score_mod, tile_m: int, tile_n: int, seqlen: SeqlenInfo, batch: Int32, head: Int32,
                 aux: tuple, softmax_scale: Float32):
        self.mask_mod, self.score_mod = mask_mod, score_mod  # masks.ModSpec or None (static)
        self.tile_m, self.tile_n = tile_m, tile_n
        self.seqlen = seqlen
        self.batch, self.head = batch, head
        self.aux = aux  # the mask mod's aux tensors, then the score mod's
        self.softmax_scale = softmax_scale

    def _seq(self, mod) -> SeqInfo:
        """What mod sees: its own slice of the aux tensors, the entry's lengths."""
        start = 0
        if mod is self.score_mod and self.mask_mod is not None:
            start = len(self.mask_mod.aux_signature)
        aux = tuple(self.aux[start:start + len(mod.aux_signature)])
        s = self.seqlen
        return SeqInfo(aux, s.seqlen_q, s.seqlen_k, s.offset_q, s.offset_k)

    def _indices(self, coords, r, c, m_block, n_block, keys_on_rows):
        """(q_idx, kv_idx) of element (r, c): global, clamped into the sequence
        (SeqlenInfo.global_q / global_k)."""
        row, col = coords[r, c][0], coords[r, c][1]
        if cutlass.const_expr(keys_on_rows):
            row, col = col, row
        s = self.seqlen
        return s.global_q(m_block * self.tile_m + row), s.global_k(n_block * self.tile_n + col)

    @cute.jit
    def apply_score(self, acc_S: cute.Tensor, tScS: cute.Tensor, m_block: Int32, n_block: Int32,
                    keys_on_rows: cutlass.Constexpr[bool] = False):
        """S <- score_mod(softmax_scale * S, b, h, q_idx, kv_idx) in place (the kernel's
        softmax then runs at scale 1: softmax.fold_score_scale)."""
        S = acc_as_rows_cols(acc_S)
        coords = acc_as_rows_cols(tScS)
        seq = self._seq(self.score_mod)
        for r in cutlass.range_constexpr(cute.size(S.shape[0])):
            for c in cutlass.range_constexpr(cute.size(S.shape[1])):
                q, kv = self._indices(coords, r, c, m_block, n_block, keys_on_rows)
                S[r, c] = self.score_mod(S[r, c] * self.softmax_scale, self.batch, self.head, q, kv, seq=seq)

    def _score_and_grad(self, score, q, kv, seq):
        """score_mod and its derivative at score (traced, not run: plain Python)."""
        try:
            out = self.score_mod(Dual(score), self.batch, self.head, q, kv, seq=seq)
        except TypeError as e:
            raise TypeError(f"score mod {self.score_mod.name!r} cannot be differentiated: {e}") from e
        return Dual.parts(out)

    @cute.jit
    def apply_score_grad(self, acc_S: cute.Tensor, acc_dP: cute.Tensor, dsum, tScS: cute.Tensor, m_block: Int32,
                         n_block: Int32, keys_on_rows: cutlass.Constexpr[bool] = True):
        """The backward's apply_score: S <- score_mod(softmax_scale * S) as above, and
        dP <- (dP - D) * d score_mod / d score, the mod differentiated by tracing it on a
        masks.Dual. Folding the derivative into dP - D at once (dsum: D per column, see
        softmax.ColumnStat) needs no registers beyond S and dP; dS = P * dP follows once
        P is known. The caller waits for the dP GEMM first."""
        S = acc_as_rows_cols(acc_S)
        dP = acc_as_rows_cols(acc_dP)
        coords = acc_as_rows_cols(tScS)
        seq = self._seq(self.score_mod)
        for c in cutlass.range_constexpr(cute.size(S.shape[1])):
            dsum_c = dsum[c]
            for r in cutlass.range_constexpr(cute.size(S.shape[0])):
                q, kv = self._indices(coords, r, c, m_block, n_block, keys_on_rows)
                value, grad = self._score_and_grad(S[r, c] * self.softmax_scale, q, kv, seq)
                S[r, c] = value
                dP[r, c] = (dP[r, c] - dsum_c) * grad

    @cute.jit
    def apply(self, acc_S: cute.Tensor, tScS: cute.Tensor, m_block: Int32, n_block: Int32,
                   keys_on_rows: cutlass.Constexpr[bool] = False):
        """-inf where mask_mod says invisible or the key lies past the sequence's end (the
        interface of mask.AttentionMask.apply: the kernels call either)."""
        S = acc_as_rows_cols(acc_S)
        coords = acc_as_rows_cols(tScS)
        seq = self._seq(self.mask_mod)
        keys_left = self.seqlen.seqlen_k - n_block * self.tile_n  # keys of this tile in the sequence
        for r in cutlass.range_constexpr(cute.size(S.shape[0])):
            for c in cutlass.range_constexpr(cute.size(S.shape[1])):
                visible = self._visible(coords, r, c, m_block, n_block, keys_on_rows, seq, keys_left)
                S[r, c] = S[r, c] if visible else -Float32.inf

    def _visible(self, coords, r, c, m_block, n_block, keys_on_rows, seq, keys_left):
        """mask_mod's verdict on element (r, c), and False past the sequence's keys (the
        element's key within this tile against keys_left, the tile's keys in the
        sequence) (traced, not run: plain Python)."""
        q, kv = self._indices(coords, r, c, m_block, n_block, keys_on_rows)
        key_col = coords[r, c][0] if cutlass.const_expr(keys_on_rows) else coords[r, c][1]
        return self.mask_mod(self.batch, self.head, q, kv, seq=seq) & (key_col < keys_left)

    @cute.jit
    def visible_bits(self, tScS: cute.Tensor, m_block: Int32, n_block: Int32):
        """apply's verdicts packed one bit per element into Int32 words (element i of the
        row-major (row, col) walk in bit i % 32 of word i // 32), for a mask evaluated
        before the scores exist: only the indices and the aux tensors feed it, so the
        forward runs it while its warpgroup waits for K and its WGMMA turn, and its integer
        work and aux loads leave the softmax's path (FwdConfig.mask_before_scores)."""
        coords = acc_as_rows_cols(tScS)
        rows, cols = cute.size(coords.shape[0]), cute.size(coords.shape[1])
        words = cute.make_rmem_tensor(((rows * cols + 31) // 32,), Int32)
        words.fill(0)
        seq = self._seq(self.mask_mod)
        keys_left = self.seqlen.seqlen_k - n_block * self.tile_n
        for r in cutlass.range_constexpr(rows):
            for c in cutlass.range_constexpr(cols):
                i = r * cols + c
                visible = self._visible(coords, r, c, m_block, n_block, False, seq, keys_left)
                words[i // 32] = words[i // 32] | (Int32(1 << (i % 32)) if visible else Int32(0))
        return words

    @cute.jit
    def apply_bits(self, acc_S: cute.Tensor, words: cute.Tensor):
        """-inf where visible_bits left a 0."""
        S = acc_as_rows_cols(acc_S)
        cols = cute.size(S.shape[1])
        for r in cutlass.range_constexpr(cute.size(S.shape[0])):
            for c in cutlass.range_constexpr(cols):
                i = r * cols + c
                S[r, c] = S[r, c] if (words[i // 32] & Int32(1 << (i % 32))) != 0 else -Float32.inf


class BlockList(Staged):
    """The tiles one tile visits, from a block mask (block_mask.BlockMask): its PARTIAL
    list, then its FULL list, as one sequence i = 0 .. count - 1. The forward's: the KV
    tiles of query tile `major`, each list last tile first; the backward's (a transposed
    block mask): the query tiles of KV tile `major`, first first."""

    def __init__(self, sparse: tuple, batch: Int32, head: Int32, major: Int32):
        partial_count, partial_idx, full_count, full_idx = sparse[:4]  # the backward's fifth: dQ turns
        self.num_partial = partial_count[batch, head, major]
        self.count = self.num_partial + full_count[batch, head, major]
        self.partial = partial_idx[batch, head, major, None]
        self.full = full_idx[batch, head, major, None]
        self.last = partial_idx.shape[3] - 1

    @cute.jit
    def block(self, i: Int32) -> Int32:
        # both reads stay in bounds; the select picks the list i falls in
        p = self.partial[cutlass.min(i, self.last)]
        f = self.full[cutlass.max(i - self.num_partial, 0)]
        return p if i < self.num_partial else f
