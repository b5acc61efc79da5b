"""The kernel families: one module per family, each a class that takes a frozen config
from cute_attn/config.py and is compiled by cute_attn/launcher.py. No kernel module
imports another: what two kernels share lives in cute_attn/blocks/.

  fwd_sm90     FlashFwdSm90: O and LSE of softmax(Q K^T * scale) V for one query tile
               per CTA; warp-specialized (a TMA producer warp, 1-3 WGMMA consumer
               warpgroups), online softmax in registers, intra-warpgroup overlap and
               ping-pong. Every mask kind, softcap, varlen, GQA (packed for short queries).
  bwd_sm90     FlashBwdSm90: dK, dV for one KV tile per CTA and its share of dQ, added
               into an fp32 accumulator with bulk reduce-adds (deterministic mode orders
               them with turn counters) or, at head dim 256, vector atomics (dq_atomic).
  bwd_prepost  BwdPreprocess (D = rowsum(dO * O), LSE * log2(e), padded to whole tiles;
               the tile's dQ_accum chunk zeroed) and BwdPostprocess (dQ from the fp32
               accumulator), one query tile per CTA.
               FlashFwdSm90SplitKV: the same with FwdConfig.split_kv, several CTAs per
               query tile, the tile's last one merging their partials by LSE.
  kv_append    KVAppend: a decode step's new keys and values into the KV cache, in place.
  v_transpose  FP8's V^T per KV head (FP8 WGMMA wants both operands K-major).
  combine      LseCombine: blocks/lse_combine.SplitMerge as a kernel of its own, over
               partials stacked on the batch mode (context parallelism's merge).

Adding a family (an FP8 forward, mask/score mods):
put it in a new module here, with a config dataclass and a `*_config_for` heuristic in
config.py, its capability row in config.CAPABILITIES and its dtypes in config.DTYPES,
and a compile/run pair in launcher.py. Build it from the blocks, not beside them:

  grid and work tiles       blocks/tile_scheduler.TileScheduler (block, head, batch, split);
                            never a hand-written grid
  sequence bounds, varlen   blocks/seqlen.SeqlenInfo
  which KV / query blocks   blocks/block_range.BlockRange (split-KV clipping included)
  masks                     blocks/mask.Window + AttentionMask
  softmax                   blocks/softmax: fold_score_scale, OnlineSoftmax (forward,
                            decode), probs_from_lse (backward), softcap_scores
  merging partials by LSE   blocks/lse_combine.SplitMerge (split-KV, combine)
  global-memory views       blocks/views (BSHD -> kernel view, packed GQA rows)
  TMA + mbarrier rings      blocks/tma_pipeline (TmaTensor, make_tma_pipeline)
  WGMMA, smem layouts       blocks/mma_sm90
  epilogues                 blocks/epilogue (stmatrix to smem, TMA or row stores)
  named barriers            blocks/barriers.NamedBarrier (one registry of ids)
  dQ accumulator contract   blocks/dq_accum
  register budgets, dtypes  config.REGISTER_BUDGETS, config.DtypePolicy

Split-KV (decode, small grids) is the forward with FwdConfig.split_kv (a run-time
num_splits: the work tile's split, BlockRange's clipping) writing fp32 partial O and LSE,
which the last split of each tile to finish merges (launcher._run_fwd_split). An FP8 forward is the
forward under a new DtypePolicy (V transposed for the K-major PV operand).
"""
