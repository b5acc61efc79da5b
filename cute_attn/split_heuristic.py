"""How many splits of the keys a KV-cache (decode) forward should use (issue 12).

Why split at all: the forward gives each work tile (a query tile of one KV head of one
batch entry, GQA heads packed into its rows) one CTA that walks all of its keys. Decode
has few tiles (batch 1, 8 KV heads, one query: 8 CTAs on 132 SMs) and long key ranges, so
most SMs idle and the kernel reaches a small share of the memory bandwidth it is bound by
(perf/NOTES.md, "Split-KV"). With num_splits > 1, that many CTAs share a tile, each
walking an equal slice of its KV blocks (blocks/block_range.py), and the tile's last
split to finish merges their fp32 partial outputs by their LSEs (blocks/lse_combine.py).

What a split costs: its own prologue (the Q load, the pipeline's first stages), an fp32
partial write of tile rows x headdim (plus the LSEs) instead of the final store, and the
merge's read of it. So splits pay off only while the grid is short of the SMs, and
each must keep enough KV blocks for its mainloop to outweigh those fixed costs.

The rule (pure Python, no device query: the caller passes num_sms):

1. tiles = batch x nheads_kv x seqlen_q_tiles. At tiles >= FILL_FRACTION x num_sms the
   grid already (nearly) fills the machine: 1, no split (FlashAttention's heuristics
   use the same 0.8 threshold).
1b. With one query tile per head (decode) the kernel is memory-bound, and the CTAs that
   draw the GPU's bandwidth (memory_bound_ctas, below) may be fewer than its SMs:
   tiles >= MEMORY_BOUND_FILL_FRACTION x memory_bound_ctas, no split.
2. Otherwise splits = num_sms // tiles: as many CTAs as fit in one wave, never more (a
   second wave would make the slowest CTA's share the critical path twice).
2b. Memory-bound (one query tile per head): splits = memory_bound_ctas // tiles, where
   memory_bound_ctas depends on the GPU's HBM (memory_bound_ctas()):
   - H100 (3.35 TB/s): num_sms // 2. Measured (scratch A/B of 2026-11-25, 8 tiles: batch
     1, 8 KV heads): 8 splits beat 16 at 32K keys (67.2-69.2 vs 71.3-72.4 us), 8K
     (28.5-29.7 vs 32.0-34.0) and 16 queries x 64/8 heads at 64K (123.7 vs 132.9), tied
     at 128K (196.7-208.9 vs 201.7-203.5); 32 splits (two waves) lost 10-50%. Half the
     SMs already draw its bandwidth, and each split adds a fixed cost.
   - H200 (4.8 TB/s): num_sms. Measured (perf/ab_splits.py, 2026-11-25, forced
     splits through mha_with_kvcache): batch 1, 32/8 heads, 128K keys: 16 splits 141.0
     us vs 8 at 198.8 (3809 vs 2701 GB/s); 16 queries x 64/8 heads at 64K: 93.2 vs
     113.7; batch 8 (64 tiles) 2 splits vs none at 8K / 32K / 128K keys: 79.9 vs 96.8,
     254.2 vs 357.5, 1013 vs 1388 us; batch 4 at 32K: 4 splits 138.5, 2 198.5, 1 352.6.
     Half the SMs cannot draw 4.8 TB/s.
   Head dim 64 follows the same rule with config.split_decode_config's tile (H100,
   perf/NOTES.md, session 23; CUDA graphs, 64/8 heads, one query): batch 1 x 8K keys 8
   splits 12.6 us vs 16 at 13.8, 32K 31.0 vs 32.0, 128K 105.8 vs 98.6 (16 ahead there
   only); batch 2 x 8K 4 splits 18.7 vs 8 at 24.1, 32K 58.7 vs 16 at 58.0.
2c. But every SM where half of them split the tiles already (>= 2 splits) and each split
   would still read >= FULL_GRID_MIN_SPLIT_BYTES of K and V (the caller passes
   kv_block_bytes; the launcher does at head dim <= 64 only). Head
   dim 64's split tile (config.split_decode_config) has one consumer warpgroup, so each
   CTA draws less bandwidth than the 128-row tile's. Measured on an H100 in CUDA graphs
   (perf/ab_splits.py --graph, perf/NOTES.md session 24), 64/8 heads, one query: head dim
   64 batch 1 x 128K 16 splits 99.4 us vs 8 at 103.3, batch 2 x 32K 8 splits 54.1 vs 4 at
   56.0, batch 4 x 32K 4 splits 99.2 vs 2 at 103.1 (+3.5-3.9%); below 1 MB per split more
   lost (batch 1 x 32K, 0.5 MB: 31.3 vs 30.1; 8K 13.6 vs 12.3). Head dim 128 level or
   worse with the same rule (batch 1 x 32K 54.0 vs 53.7, 128K 183.9 vs 181.6, batch 4 x
   32K 182.3 vs 181.4): not taken there.
3. At most kv_blocks // MIN_BLOCKS_PER_SPLIT splits, so each keeps >= MIN_BLOCKS_PER_SPLIT
   KV blocks, except that a tile of at least SHORT_KEY_SPLITS x MIN_BLOCKS_PER_SHORT_SPLIT
   blocks may take SHORT_KEY_SPLITS splits (2K keys: 8 splits of 2 blocks); never more
   splits than KV blocks, and at most max_splits. Measured at tile_n 128 (head dims <=
   128, contiguous caches) on an H200 only; 80-key blocks (head dim 256) and paged tiles
   follow the same counts unmeasured.
4. Then as few splits as give the same blocks per split: the forward slices
   ceil(kv_blocks / splits) blocks per split, so e.g. 65 blocks in 16 splits are 5 per
   split in 13 busy splits and 3 empty ones; 13 splits do the same work with fewer
   partials to write and combine.

5. (merge_in_cluster) 2..8 splits that each read at most CLUSTER_MERGE_MAX_SPLIT_BYTES
   merge in a thread-block cluster through distributed shared memory; the launcher adds
   that the tile's rows be few (rows x head_dim / 4 <= its consumer threads: one
   16-byte chunk per merging thread). At most CLUSTER_MERGE_MAX_CTAS CTAs in all.

Constants to be checked on the device: see perf/NOTES.md. FILL_FRACTION and MAX_SPLITS
are first guesses from the costs above, not measurements; the short-split rule was
measured at batch 1 on an H200 only.
"""

# Tiles per SM at which the grid counts as full (step 1).
FILL_FRACTION = 0.8
# The same for memory-bound grids, one query tile per head (step 1b), as a share of
# memory_bound_ctas. Measured on an H100 (perf/bench_decode.py, 2026-11-25): batch 8 x 8
# KV heads = 64 tiles, one query, 8K keys, unsplit 104.0 us (86% of copy bandwidth) vs 2
# splits 108.3 us; 8 queries x 64/8 heads against 32K keys, 64 tiles: 368.9 vs 374.5 us.
# 64 tiles = 0.97 of its 66 memory-bound CTAs already saturate; 0.9 keeps that margin.
MEMORY_BOUND_FILL_FRACTION = 0.9
# HBM bandwidth (GB/s, the GPU's peak) from which half the SMs no longer draw it (H100:
# 3350, H200: 4800; see step 2b).
ALL_SMS_FROM_GBS = 4000
# KV blocks (of the forward's tile_n keys, 128 at head dims <= 128) a split keeps at
# least: 4 blocks = 512 keys, a mainloop several times the length of the prologue and of
# the partial write it adds. Up to SHORT_KEY_SPLITS splits may keep as few as
# MIN_BLOCKS_PER_SHORT_SPLIT. Measured on an H200 (perf/NOTES.md, session 20; batch 1,
# 64/8 heads, one query, us): 2K keys (16 blocks) 8 splits of 2 blocks 14.7-14.8 vs 4 of 4
# 17.1-17.8; 4K (32 blocks) 8 of 4 16.9 vs 16 of 2 18.1; 8K 16 of 4 22.5 vs 32 of 2 29.4:
# short splits pay where the tile would otherwise have few CTAs, not beyond 8 (each split
# adds a partial the merge reads).
MIN_BLOCKS_PER_SPLIT = 4
MIN_BLOCKS_PER_SHORT_SPLIT = 2
SHORT_KEY_SPLITS = 8
# Bytes of K and V each split must still read for a memory-bound decode to take every SM
# instead of memory_bound_ctas (step 2c).
FULL_GRID_MIN_SPLIT_BYTES = 1 << 20
# The most splits: one tile alone can use at most one wave (num_sms = 132 CTAs on an
# H100), so 128 loses nothing on Hopper, and it bounds the fp32 partials (splits x rows x
# headdim x 4 bytes) and the combine's loop over splits per row. FlashAttention 2 passes
# the same cap to its heuristic.
MAX_SPLITS = 128


def memory_bound_ctas(num_sms: int, hbm_gbs: float) -> int:
    """The CTAs (one per SM) a memory-bound forward needs to draw the GPU's bandwidth
    (step 2b): half the SMs below ALL_SMS_FROM_GBS of peak HBM bandwidth, else all."""
    return num_sms if hbm_gbs >= ALL_SMS_FROM_GBS else num_sms // 2


def choose_num_splits(batch: int, nheads_kv: int, seqlen_q_tiles: int, kv_blocks: int,
                      num_sms: int = 132, max_splits: int = MAX_SPLITS, hbm_gbs: float = 3350.0,
                      kv_block_bytes: int = 0) -> int:
    """The number of splits of the keys for a forward of this shape (>= 1; 1: no split).

    batch, nheads_kv: the grid's batch entries and KV heads; seqlen_q_tiles: query tiles
    per (entry, KV head), with packed GQA the tiles of seqlen_q x group rows; kv_blocks:
    KV blocks (tile_n keys each) of the longest entry's keys; num_sms: the GPU's SMs
    (132 on an H100 SXM); max_splits: the cap (MAX_SPLITS); hbm_gbs: the GPU's peak HBM
    bandwidth (an H100 SXM's by default); kv_block_bytes: bytes of K and V in one KV block
    of one tile (0: unknown, step 2c off). See the module docstring for the reasoning, and
    for the constants still to be measured.
    """
    tiles = batch * nheads_kv * seqlen_q_tiles
    if tiles <= 0 or kv_blocks <= 0 or tiles >= FILL_FRACTION * num_sms:
        return 1
    target = num_sms
    if seqlen_q_tiles == 1:
        # one query tile per head (decode): memory-bound (steps 1b, 2b)
        target = memory_bound_ctas(num_sms, hbm_gbs)
        if tiles >= MEMORY_BOUND_FILL_FRACTION * target:
            return 1
        every_sm = min(num_sms // tiles, max_splits)
        # only where half the SMs split already (measured at 8-32 tiles; 34-59 tiles would
        # go from unsplit to 2-3 splits, unmeasured)
        if target < num_sms and target // tiles >= 2 and \
                kv_blocks // every_sm * kv_block_bytes >= FULL_GRID_MIN_SPLIT_BYTES:
            target = num_sms  # step 2c
    by_length = kv_blocks // MIN_BLOCKS_PER_SPLIT
    if kv_blocks >= MIN_BLOCKS_PER_SHORT_SPLIT * SHORT_KEY_SPLITS:  # short splits where measured (2K keys up)
        by_length = max(by_length, SHORT_KEY_SPLITS)
    splits = min(target // tiles, by_length, max_splits)
    if splits <= 1:
        return 1
    blocks_per_split = -(-kv_blocks // splits)
    return -(-kv_blocks // blocks_per_split)


# The most KV bytes one split reads for its tile's splits to merge in a thread-block cluster
# (FwdConfig.cluster_splits) rather than through fp32 partials in global memory. Measured
# on an H100 (perf/NOTES.md, session 22; CUDA graphs, one query, causal, against the global
# merge): 8 splits of 128 KB (b1 x 2K, 32/8 heads, hd 128) 1.135x, of 512 KB (8K) 1.040x,
# of 1 MB (32K at hd 64, 64/8) 1.044x; of 2 MB (32K at hd 128) 0.967x / 1.016x; of 8 MB
# (128K; batch 4 x 32K in pairs) 0.948x / 0.949x. The cluster saves a fixed ~1-2 us (no
# partial round trip through L2, no counter, no zeroed workspace) but its CTAs stream
# keys more slowly: a cluster's CTAs share a GPC, so a small grid of clusters reaches
# fewer GPCs than one of free CTAs (our reading; the launch has no spread policy to ask).
CLUSTER_MERGE_MAX_SPLIT_BYTES = 1 << 20


# The most CTAs (tiles x splits) whose splits merge in clusters: clusters of up to 8 CTAs
# must each fit in one GPC, and past about half the SMs they no longer all fit at once.
# Measured on an H100 (perf/NOTES.md, session 23; CUDA graphs, head dim 64, 64/8 heads,
# one query): batch 2 x 8 splits (128 CTAs in 16 clusters of 8) 69.7 us at 32K keys and
# 24.1 at 8K, against 58.0-58.7 and 18.7 for 64 CTAs in clusters or 256 without.
CLUSTER_MERGE_MAX_CTAS = 64


def merge_in_cluster(num_splits: int, kv_blocks: int, kv_block_bytes: int, max_cluster: int,
                     tiles: int = 1) -> bool:
    """Whether num_splits splits over kv_blocks KV blocks (kv_block_bytes of K and V each)
    merge in a cluster: at most max_cluster of them, each reading at most
    CLUSTER_MERGE_MAX_SPLIT_BYTES, over tiles work tiles of at most
    CLUSTER_MERGE_MAX_CTAS CTAs in all."""
    if not 2 <= num_splits <= max_cluster or tiles * num_splits > CLUSTER_MERGE_MAX_CTAS:
        return False
    return -(-kv_blocks // num_splits) * kv_block_bytes <= CLUSTER_MERGE_MAX_SPLIT_BYTES
