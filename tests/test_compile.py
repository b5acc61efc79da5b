"""Every supported forward specialisation compiles for sm_90a on a machine with no GPU,
and its PTX holds the Hopper machinery the design relies on."""

import os
import re
import subprocess
import sys

import pytest

# cutlass first, and no CUTE_DSL_ARCH set here: the package names its target (sm_90a) to
# every compile itself, whatever the environment and the import order
pytest.importorskip("cutlass", reason="the CuTe DSL (nvidia-cutlass-dsl) is not installed")

from cute_attn import ptx as ptx_tool  # noqa: E402
from cute_attn.config import CAPABILITIES, AttnFeatures  # noqa: E402


def test_compiles_for_sm90a_without_cute_dsl_arch_and_with_cutlass_imported_first():
    """The DSL reads CUTE_DSL_ARCH once, when cutlass is imported, and detects sm_100a
    without it on a machine with no GPU (WGMMA then refuses to build): the launcher must
    name sm_90a to the compile itself, and must not need (or set) the variable."""
    code = (
        "import os, cutlass\n"
        "from cute_attn.config import AttnFeatures, fwd_config_for\n"
        "from cute_attn.launcher import FwdKey, compile_fwd\n"
        "f = AttnFeatures()\n"
        "fn = compile_fwd(FwdKey('bf16', 64, f, fwd_config_for(64, f)), '--keep-ptx')\n"
        "assert '.target sm_90a' in fn.__ptx__\n"
        "assert 'CUTE_DSL_ARCH' not in os.environ\n"
    )
    env = {name: value for name, value in os.environ.items() if name != "CUTE_DSL_ARCH"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]


def _cached_compiler(compile_artifacts):
    cache = {}

    def get(dtype, head_dim, causal):
        key = (dtype, head_dim, causal)
        if key not in cache:
            cache[key] = compile_artifacts(dtype, head_dim, AttnFeatures(mask="causal" if causal else "none"))
        return cache[key]

    return get


@pytest.fixture(scope="module")
def compiled():
    return _cached_compiler(ptx_tool.compile_fwd_artifacts)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", CAPABILITIES["fwd"].head_dims)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_forward_compiles_with_hopper_instructions(compiled, dtype, head_dim, causal):
    art = compiled(dtype, head_dim, causal)
    text = art.ptx
    assert ".target sm_90a" in text
    wgmma_type = "bf16.bf16" if dtype == "bf16" else "f16.f16"
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.{wgmma_type}", text)
    assert "cp.async.bulk.tensor" in text  # TMA loads and the O store
    assert "setmaxnreg.dec" in text and "setmaxnreg.inc" in text
    assert "mbarrier.try_wait" in text
    assert "bar.sync" in text  # named barriers (epilogue; ping-pong for 2+ warpgroups)
    # ptxas ignores setmaxnreg without a register cap at launch (C7508): never silently
    assert "C7508" not in art.ptxas_report
    # ptxas fences WGMMAs itself (C7519, "warpgroup.arrive is injected") where registers an
    # in-flight WGMMA reads are written by other instructions: P converted by scalar cvts
    # between the PV WGMMAs did that at 80-, 96- and 176-key blocks (mma_sm90.acc_to_operand_a)
    assert "C7519" not in art.ptxas_report


@pytest.mark.parametrize("head_dim", [64, 128])
def test_no_register_spills(compiled, head_dim):
    report = compiled("bf16", head_dim, False).ptxas_report
    if "ptxas not found" in report:
        pytest.skip("ptxas is not on PATH: no resource report on this machine")
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert m, report
    assert (int(m.group(1)), int(m.group(2))) == (0, 0), report


def test_unmasked_mainloop_has_no_mask_selects(compiled):
    """Regression: a per-element `if` in the mask once carried the whole score tile
    through every branch (~2000 selp per block, 277 vs 629 TF/s). Non-causal kernels
    mask only their first block: a handful of selects per row, not thousands."""
    text = compiled("bf16", 128, False).ptx
    assert text.count("selp.f32") < 400


def test_cli_prints_ptx(tmp_path, capsys):
    from cute_attn.__main__ import main

    out = tmp_path / "k.ptx"
    assert main(["ptx", "--dtype", "bf16", "--headdim", "128", "--causal", "--out", str(out)]) == 0
    text = out.read_text()
    assert "wgmma.mma_async" in text and ".entry" in text
    assert "FwdKey" in capsys.readouterr().err


# ---- backward: preprocess, main kernel, postprocess ----

BWD_HEAD_DIMS = CAPABILITIES["bwd"].head_dims


@pytest.fixture(scope="module")
def compiled_bwd():
    return _cached_compiler(ptx_tool.compile_bwd_artifacts)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", BWD_HEAD_DIMS)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_backward_compiles_with_hopper_instructions(compiled_bwd, dtype, head_dim, causal):
    arts = compiled_bwd(dtype, head_dim, causal)
    assert set(arts) == {"preprocess", "main", "postprocess"}
    text = arts["main"].ptx
    assert ".target sm_90a" in text
    wgmma_type = "bf16.bf16" if dtype == "bf16" else "f16.f16"
    # the five products: S^T and dP^T from smem, dV and dK with A from registers, dQ
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.{wgmma_type}", text)
    assert "cp.async.bulk.tensor" in text  # TMA loads of Q, K, V, dO and the dK/dV stores
    # LSE2 and D chunks: 1-D tiles of (rows, heads, batch) by tensor map, no raw bulk copy
    # (racecheck cannot order a raw bulk copy's write after the consumers' loads)
    assert "cp.async.bulk.tensor.3d.shared::cta.global.tile.mbarrier" in text
    assert "cp.async.bulk.shared::cluster.global" not in text
    # every consumer warp syncs before its lane 0 releases a stage it read with loads
    assert "bar.warp.sync" in text
    if head_dim <= 192:
        assert "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32" in text  # dQ by the writer warp
    elif head_dim == 256:
        # dQ by atomics from registers (BwdConfig.dq_atomic), no bulk reduce-add
        assert "red.global.add.v2.f32" in text and "cp.reduce.async.bulk" not in text
    assert "setmaxnreg.dec" in text and "setmaxnreg.inc" in text
    assert "mbarrier.try_wait" in text
    for name, art in arts.items():
        assert "C7508" not in art.ptxas_report, name


@pytest.mark.parametrize("kernel", ["preprocess", "main"])
@pytest.mark.parametrize("head_dim", BWD_HEAD_DIMS)
def test_backward_has_no_register_spills(compiled_bwd, head_dim, kernel):
    report = compiled_bwd("bf16", head_dim, True)[kernel].ptxas_report
    if "ptxas not found" in report:
        pytest.skip("ptxas is not on PATH: no resource report on this machine")
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert m, report
    assert (int(m.group(1)), int(m.group(2))) == (0, 0), report


@pytest.mark.parametrize("head_dim", BWD_HEAD_DIMS)
def test_backward_preprocess_moves_whole_rows_and_zeroes_its_dq_accum_chunk(compiled_bwd, head_dim):
    """The preprocess reads each tile of O and dO with 16-byte loads (all passes issued
    before the row sums) and zeroes the tile's dQ_accum chunk with 16-byte stores of 0:
    the main kernel adds into a buffer torch.empty left unset, so a missing store is a
    wrong gradient. Counts per thread: the tile's bytes over the CTA's threads."""
    from cute_attn.config import DTYPES, bwd_config_for
    from cute_attn.kernels.bwd_prepost import BwdPreprocess

    causal = AttnFeatures(mask="causal")
    cfg = bwd_config_for(head_dim, causal)
    threads = BwdPreprocess(DTYPES["bf16"], head_dim, cfg, causal).num_threads
    text = compiled_bwd("bf16", head_dim, True)["preprocess"].ptx
    loads = re.findall(r"ld\.global(?:\.\w+)*\.v4\.b32", text)
    zero_stores = re.findall(r"st\.global\.v4\.b32\s+\[[^]]+\], \{(?:0f00000000(?:, )?){4}\}", text)
    assert len(loads) * threads * 16 == 2 * cfg.tile_m * head_dim * 2
    assert len(zero_stores) * threads * 16 == cfg.tile_m * head_dim * 4


def test_deterministic_backward_orders_dq_with_turn_counters():
    from cute_attn import launcher
    from cute_attn.config import bwd_config_for

    causal = AttnFeatures(mask="causal")
    key = launcher.BwdKey("bf16", 128, causal, bwd_config_for(128, causal, deterministic=True), deterministic=True)
    main = launcher.compile_bwd(key, "--keep-ptx")[1]
    text = main.__ptx__
    assert "ld.acquire.gpu.global" in text and "red.release.gpu.global.add" in text


def test_cli_prints_backward_ptx(tmp_path, capsys):
    from cute_attn.__main__ import main

    out = tmp_path / "bwd.ptx"
    assert main(["ptx", "--kernel", "bwd", "--headdim", "64", "--out", str(out)]) == 0
    text = out.read_text()
    for name in ("preprocess", "main", "postprocess"):
        assert f"// ===== {name} =====" in text
    assert text.count(".entry") == 3
    assert "BwdKey" in capsys.readouterr().err


def test_cli_backward_ptx_follows_the_query_length(tmp_path, capsys):
    """--seqlen-q picks the backward's config as the launcher does: causal head dim 128 takes
    the 80-row swapped-dQ kernel from config.SWAPPED_DQ_CAUSAL_FROM_QUERIES query rows."""
    from cute_attn.__main__ import main
    from cute_attn.config import SWAPPED_DQ_CAUSAL_FROM_QUERIES

    out = tmp_path / "bwd.ptx"
    argv = ["ptx", "--kernel", "bwd", "--headdim", "128", "--causal", "--out", str(out)]
    assert main([*argv, "--seqlen-q", str(SWAPPED_DQ_CAUSAL_FROM_QUERIES)]) == 0
    assert "m64n80k16" in out.read_text() and "dq_swapped=True" in capsys.readouterr().err


# ---- the feature specialisations: sliding window, softcap, varlen (GQA needs none) ----

FEATURES = [
    AttnFeatures(mask="local"),
    AttnFeatures(softcap=True),
    AttnFeatures(varlen=True),
    AttnFeatures(mask="causal", varlen=True),
    AttnFeatures(mask="local", softcap=True, varlen=True),
]


def _features_id(f):
    return "-".join([f.mask] + [name for name in ("softcap", "varlen") if getattr(f, name)])


@pytest.fixture(scope="module")
def compiled_features():
    cache = {}

    def get(kind, head_dim, features):
        key = (kind, head_dim, features)
        if key not in cache:
            fn = ptx_tool.compile_fwd_artifacts if kind == "fwd" else ptx_tool.compile_bwd_artifacts
            cache[key] = fn("bf16", head_dim, features=features)
        return cache[key]

    return get


def _check_feature_ptx(text, features):
    assert ".target sm_90a" in text and "wgmma.mma_async" in text
    assert "setmaxnreg.inc" in text and "mbarrier.try_wait" in text
    # softcap: one tanh per score, the hardware approximation
    assert ("tanh.approx.f32" in text) == features.softcap
    if features.varlen:
        # cu_seqlens are read from global memory; outputs leave row by row, 16 B each
        assert "st.global.v4" in text


@pytest.mark.parametrize("features", FEATURES, ids=_features_id)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_forward_feature_specialisations_compile(compiled_features, head_dim, features):
    art = compiled_features("fwd", head_dim, features)
    _check_feature_ptx(art.ptx, features)
    assert "C7508" not in art.ptxas_report
    if features.varlen:
        # the O tile is stored row by row, so the only bulk tensor copies are loads
        assert "cp.async.bulk.tensor.4d.shared::cta.global" in art.ptx
        assert "cp.async.bulk.tensor.4d.global.shared::cta" not in art.ptx
    if "ptxas not found" not in art.ptxas_report:
        m = re.search(r"(\d+) bytes spill stores", art.ptxas_report)
        assert m and int(m.group(1)) == 0, art.ptxas_report


@pytest.mark.parametrize("features", FEATURES, ids=_features_id)
def test_backward_feature_specialisations_compile(compiled_features, features):
    arts = compiled_features("bwd", 128, features)
    _check_feature_ptx(arts["main"].ptx, features)
    for name, art in arts.items():
        assert "C7508" not in art.ptxas_report, name


def test_cli_prints_feature_specialisations(tmp_path, capsys):
    from cute_attn.__main__ import main

    out = tmp_path / "k.ptx"
    argv = ["ptx", "--headdim", "128", "--mask", "local", "--softcap", "--varlen", "--out", str(out)]
    assert main(argv) == 0
    assert "tanh.approx.f32" in out.read_text()
    assert "mask='local', softcap=True, varlen=True" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["ptx", "--causal", "--mask", "local"])


# ---- packed GQA (FwdConfig.pack_gqa) ----

from cute_attn.config import FwdConfig, choose_pack_gqa  # noqa: E402


@pytest.mark.parametrize("seqlen_q, group, expected", [
    (1, 4, 4), (1, 8, 8), (64, 4, 4), (129, 8, 8),  # short: most per-head rows are padding
    (100, 4, 1), (1000, 8, 1), (8192, 4, 1),        # long: tiles full either way
    (1, 1, 1), (1, 3, 1),                            # no group; a group not dividing 128
])
def test_pack_gqa_heuristic(seqlen_q, group, expected):
    assert choose_pack_gqa(seqlen_q, group, 128, varlen=False) == expected
    assert choose_pack_gqa(seqlen_q, group, 128, varlen=True) == 1


@pytest.mark.parametrize("mask", ["none", "causal", "local"])
def test_packed_gqa_forward_compiles_with_a_two_level_row_mode(mask):
    from cute_attn import launcher

    key = launcher.FwdKey("bf16", 128, AttnFeatures(mask=mask), FwdConfig(128, 128, 2, pack_gqa=4))
    fn = launcher.compile_fwd(key, "--keep-ptx")
    # Q and O address (group, seqlen) rows: one more TMA dimension than K and V
    assert "cp.async.bulk.tensor.5d.shared::cta.global" in fn.__ptx__
    assert "cp.async.bulk.tensor.5d.global.shared::cta" in fn.__ptx__
    assert "cp.async.bulk.tensor.4d.shared::cta.global" in fn.__ptx__
    report = ptx_tool.ptxas_report(fn.__ptx__)
    if "ptxas not found" not in report:
        m = re.search(r"(\d+) bytes spill stores", report)
        assert m and int(m.group(1)) == 0, report


# ---- the backward tile choice measured in perf/NOTES.md (session 4) ----

from cute_attn.config import bwd_config_for  # noqa: E402


def test_backward_head_dim_64_takes_128_query_rows_unless_window_or_softcap():
    assert bwd_config_for(64, AttnFeatures()).tile_m == 128
    assert bwd_config_for(64, AttnFeatures(mask="causal")).tile_m == 128
    assert bwd_config_for(64, AttnFeatures(mask="local")).tile_m == 64
    assert bwd_config_for(64, AttnFeatures(softcap=True)).tile_m == 64
    # head dim 128, no mask or causal: 80 rows with dQ transposed (swapped_dq_bwd_config)
    assert bwd_config_for(128, AttnFeatures()).tile_m == 80
    assert bwd_config_for(128, AttnFeatures(mask="causal")).tile_m == 64  # short queries
    assert bwd_config_for(128, AttnFeatures(mask="causal"), max_seqlen_q=2048).tile_m == 80
    assert bwd_config_for(128, AttnFeatures(mask="local")).tile_m == 64


# ---- split-KV: the scheduler's run-time split, BlockRange's clipping, fp32 partials ----


@pytest.mark.parametrize("pack", [1, 4])
@pytest.mark.parametrize("mask", ["none", "causal", "local"])
def test_split_kv_forward_compiles_and_writes_fp32_partials(mask, pack):
    """FwdConfig.split_kv: it compiles spill-free; its PTX divides by the run-time
    num_splits (the block index, the KV range), writes the partial O as fp32 from
    registers, while the unsplit kernel stores O by TMA."""
    import dataclasses

    from cute_attn import launcher
    from cute_attn.config import fwd_config_for

    features = AttnFeatures(mask=mask)
    base = fwd_config_for(128, features, pack)
    split = launcher.compile_fwd(
        launcher.FwdKey("bf16", 128, features, dataclasses.replace(base, split_kv=True)), "--keep-ptx"
    ).__ptx__
    single = launcher.compile_fwd(launcher.FwdKey("bf16", 128, features, base), "--keep-ptx").__ptx__
    assert len(re.findall(r"\bdiv\.", split)) > len(re.findall(r"\bdiv\.", single))
    # O: fp32 pairs of adjacent columns from registers (64-bit stores), no TMA store;
    # the unsplit kernel stores O by TMA (shared -> global) and has no such stores
    stores = re.compile(r"st\.global\.v2\.(b|f)32")
    tma_store = re.compile(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared")
    assert len(stores.findall(split)) >= 16 and not tma_store.search(split)
    assert not stores.search(single) and tma_store.search(single)
    report = ptx_tool.ptxas_report(split)
    if "ptxas not found" not in report:
        m = re.search(r"(\d+) bytes spill stores", report)
        assert m and int(m.group(1)) == 0, report


@pytest.mark.parametrize("head_dim, mask, tile_queue", [(64, "none", False), (128, "none", False),
                                                        (128, "causal", True), (64, "causal", True)])
def test_persistent_forward_compiles_with_a_tile_loop(head_dim, mask, tile_queue):
    """FwdConfig.persistent_ctas: spill-free, no warpgroup.arrive injected by ptxas, and
    a loop over work tiles, which steps by the grid's size (nctaid.x): the one-tile grid
    of the same features never reads it. With the tile queue: one atomic add (the
    ticket), the NEXT_TILE hand-off between the producer warp and the consumers, and
    the TILE_SLOT_FREE barriers back."""
    import dataclasses

    from cute_attn import launcher
    from cute_attn.blocks.barriers import NamedBarrier
    from cute_attn.config import fwd_config_for

    features = AttnFeatures(mask=mask)
    base = fwd_config_for(head_dim, features)
    config = dataclasses.replace(base, persistent_ctas=132, tile_queue=tile_queue)
    persistent = launcher.compile_fwd(launcher.FwdKey("bf16", head_dim, features, config), "--keep-ptx").__ptx__
    assert "%nctaid.x" in persistent
    handoff = 32 + 128 * config.num_mma_warpgroups
    assert (len(re.findall(r"atom(\.relaxed)?(\.gpu)?\.global\.add", persistent)) == 1) == tile_queue
    # pass_turn's bar.arrive names its barrier by register too, with 256 threads
    assert bool(re.search(rf"bar\.arrive %r\d+, {handoff};", persistent)) == tile_queue
    # the slots' TILE_SLOT_FREE barriers: the consumers arrive, the producer waits
    free_0 = int(NamedBarrier.TILE_SLOT_FREE_0)
    assert bool(re.search(rf"bar\.sync\s+{free_0}, {handoff};", persistent)) == tile_queue
    if mask == "none":
        single = launcher.compile_fwd(launcher.FwdKey("bf16", head_dim, features, base), "--keep-ptx").__ptx__
        assert "%nctaid.x" not in single
    report = ptx_tool.ptxas_report(persistent)
    if "ptxas not found" not in report:
        m = re.search(r"(\d+) bytes spill stores", report)
        assert m and int(m.group(1)) == 0, report
        assert "C7519" not in report


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_split_forward_merges_its_tiles_in_kernel(dtype, varlen):
    """The split forward's last split per tile merges (fwd_sm90.merge_if_last): one
    acq_rel atomic on the tile's counter between GPU-scope fences, its reset, then the
    LSE merge (blocks/lse_combine.py). No second kernel (kernels/combine.py is context
    parallelism's)."""
    import dataclasses

    from cute_attn import launcher
    from cute_attn.config import fwd_config_for

    features = AttnFeatures(mask="causal", varlen=varlen)
    config = dataclasses.replace(fwd_config_for(128, features), split_kv=True)
    ptx = launcher.compile_fwd(launcher.FwdKey(dtype, 128, features, config), "--keep-ptx").__ptx__
    assert ".target sm_90a" in ptx
    assert len(re.findall(r"atom\.global\.acq_rel(\.gpu)?\.add\.u32", ptx)) == 1
    assert ptx.count("fence.acq_rel.gpu") >= 2
    # blocks/lse_combine.py: an lg2 per row's LSE, 16-byte loads of the fp32 partials and
    # 8-byte stores of 4 outputs (2 x 16-bit packed)
    assert "lg2.approx" in ptx and "ld.global.v4.b32" in ptx and "st.global.v2.b32" in ptx


@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
def test_lse_combine_compiles(out_dtype):
    """kernels/combine.py (context parallelism's merge) for sm_90a: blocks/lse_combine.py's
    SplitMerge, so 16-byte loads of the fp32 partials, an lg2 per row's LSE, and stores
    of 4 outputs per 16-byte chunk (16 bytes in fp32, 8 in bf16)."""
    from cute_attn import launcher

    ptx = launcher.compile_combine(launcher.CombineKey(out_dtype, 128), "--keep-ptx").__ptx__
    assert ".target sm_90a" in ptx and "lg2.approx" in ptx and "ld.global.v4.b32" in ptx
    assert ("st.global.v4.b32" if out_dtype == "float32" else "st.global.v2.b32") in ptx


@pytest.mark.parametrize("head_dim", CAPABILITIES["fwd"].head_dims)
def test_kv_append_takes_every_forward_head_dim_in_whole_tokens(head_dim):
    """mha_with_kvcache appends at every head dim the forward takes: a CTA covers whole
    tokens (head_dim / 8 threads each), 128 threads or fewer (96 and 192: 120), and the
    paged kernel compiles there too (96 and 192 failed an assert before session 32)."""
    from cute_attn import launcher
    from cute_attn.config import DTYPES
    from cute_attn.kernels.kv_append import MAX_THREADS, KVAppend

    append = KVAppend(DTYPES["bf16"], head_dim, paged=True)
    per_token = head_dim // 8
    assert append.threads == append.tokens_per_cta * per_token and MAX_THREADS - per_token < append.threads <= MAX_THREADS
    assert ".target sm_90a" in launcher.compile_append(launcher.AppendKey("bf16", head_dim, True), "--keep-ptx").__ptx__


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_kv_append_compiles(dtype, paged):
    """kernels/kv_append.py for sm_90a: 16-byte loads and stores of K and V (one chunk
    per thread), the new length's 32-bit store, and (paged) the page-table read."""
    from cute_attn import launcher

    ptx = launcher.compile_append(launcher.AppendKey(dtype, 128, paged), "--keep-ptx").__ptx__
    assert ".target sm_90a" in ptx
    assert ptx.count("ld.global.v4.b32") == 2 and ptx.count("st.global.v4.b32") == 2
    # cache_seqlens (+ the page table's entry when paged); the new length
    assert ptx.count("ld.global.b32") == (2 if paged else 1) and ptx.count("st.global.b32") == 1


@pytest.mark.parametrize("page_size", [16, 64, 256])
@pytest.mark.parametrize("split", [False, True])
def test_paged_kv_forward_compiles_and_loads_a_box_per_page(page_size, split):
    """FwdConfig.page_size (with kv_lengths): compiles spill-free, its producer reads the
    page table (one 32-bit global load per block the unpaged kernel lacks), and a KV block
    that spans pages is tile_n / page_size TMA boxes: that many times the unpaged
    kernel's K/V TMA loads (4-D: seqlen, head_dim, heads, batch or page)."""
    import dataclasses

    from cute_attn import launcher
    from cute_attn.config import fwd_config_for

    features = AttnFeatures(mask="causal", kv_lengths=True)
    base = dataclasses.replace(fwd_config_for(128, features, 4), split_kv=split)
    paged_config = dataclasses.replace(fwd_config_for(128, features, 4, page_size), split_kv=split)
    assert paged_config.tile_n == base.tile_n == 128
    paged = launcher.compile_fwd(launcher.FwdKey("bf16", 128, features, paged_config), "--keep-ptx").__ptx__
    plain = launcher.compile_fwd(launcher.FwdKey("bf16", 128, features, base), "--keep-ptx").__ptx__
    loads = re.compile(r"ld\.global(\.nc)?\.(u|s|b)32")
    assert len(loads.findall(paged)) > len(loads.findall(plain))
    kv_boxes = re.compile(r"cp\.async\.bulk\.tensor\.4d\.shared::cta\.global")
    assert len(kv_boxes.findall(paged)) == max(1, 128 // page_size) * len(kv_boxes.findall(plain))
    report = ptx_tool.ptxas_report(paged)
    if "ptxas not found" not in report:
        m = re.search(r"(\d+) bytes spill stores", report)
        assert m and int(m.group(1)) == 0, report


def test_page_size_must_nest_with_the_kv_block():
    import dataclasses

    from cute_attn.config import fwd_config_for

    base = fwd_config_for(128, AttnFeatures(kv_lengths=True))
    for bad in (24, 48, 192, 12):
        with pytest.raises(ValueError, match="page_size"):
            dataclasses.replace(base, page_size=bad)
    # head dims whose blocks (96, 80 keys) do not nest with a page size take 64-key blocks
    features = AttnFeatures(kv_lengths=True)
    assert [fwd_config_for(256, features, page_size=p).tile_n for p in (16, 32, 64, 128, 256)] == [80, 64, 64, 64, 64]
    assert [fwd_config_for(192, features, page_size=p).tile_n for p in (16, 32, 64, 128, 256)] == [96, 96, 64, 64, 64]
    assert fwd_config_for(128, features, page_size=16).kv_box_rows == 16
    assert fwd_config_for(128, features, page_size=256).kv_box_rows == 128


# ----------------------------------------------------------------------------------------
# FP8 (e4m3) forward and its V transpose
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_fp8_forward_compiles_with_e4m3_wgmma(head_dim, mask):
    """Both GEMMs run as e4m3 WGMMAs (K = 32) with fp32 accumulators; P is converted with
    saturating e4m3x2 conversions and put into the A layout by byte permutes alone, V^T's
    keys being in the order of P's registers (blocks/fp8_operand.py): no shuffle with a
    computed lane (the quad exchange V^T in key order would need); the output leaves as
    bf16; nothing spills."""
    from cute_attn.config import fp8_fwd_config_for

    features = AttnFeatures(mask=mask)
    config = fp8_fwd_config_for(head_dim, features)
    art = ptx_tool.compile_fwd_artifacts("e4m3", head_dim, features, config)
    ptx = art.ptx
    assert ".target sm_90a" in ptx
    assert f"wgmma.mma_async.sync.aligned.m64n{config.tile_n}k32.f32.e4m3.e4m3" in ptx  # S = Q K^T
    assert f"wgmma.mma_async.sync.aligned.m64n{head_dim}k32.f32.e4m3.e4m3" in ptx  # O += P V
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "prmt.b32" in ptx
    assert not re.search(_LANE_FROM_REGISTER, ptx)
    assert "cvt.rn.bf16x2.f32" in ptx
    # FwdConfig.pv_wait_after_softmax (fp8_fwd_config_for's at head dims 64 and 128)
    assert ("vote.sync.all.pred" in ptx and "// the other path" in ptx) == config.pv_wait_after_softmax
    if art.cubin is not None:
        assert " 0 bytes spill stores" in art.ptxas_report, art.ptxas_report
        assert "serialized" not in art.ptxas_report, art.ptxas_report  # ptxas's C7510-C7515


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_fp8_persistent_forward_compiles_without_spills(head_dim, mask):
    """config.fp8_with_persistent_grid's kernels (what mha runs on a GPU at head dims 128
    and 256) compile spill-free; a softcap keeps one tile per CTA (it spilled 4 bytes on
    the persistent grid at 128 x 224)."""
    from cute_attn.config import fp8_fwd_config_for, fp8_with_persistent_grid

    features = AttnFeatures(mask=mask)
    config = fp8_with_persistent_grid(fp8_fwd_config_for(head_dim, features), head_dim, features, 132)
    assert config.persistent_ctas == 132
    art = ptx_tool.compile_fwd_artifacts("e4m3", head_dim, features, config)
    if art.cubin is not None:
        assert " 0 bytes spill stores" in art.ptxas_report, art.ptxas_report
        # ptxas falls back to one WGMMA at a time (C7510-C7515) when it cannot keep the
        # asynchronous groups apart: registers, or a path without the PV wait
        assert "serialized" not in art.ptxas_report, art.ptxas_report
    # FwdConfig.pv_wait_after_softmax at head dim 128: the warp-uniform gate on the row sums
    # and the wait on its never-taken side (mma_sm90.wait_all_groups_after)
    assert config.pv_wait_after_softmax == (head_dim == 128)
    gated = "vote.sync.all.pred" in art.ptx and "// the other path" in art.ptx
    assert gated == config.pv_wait_after_softmax
    capped = AttnFeatures(mask=mask, softcap=True)
    assert fp8_with_persistent_grid(fp8_fwd_config_for(head_dim, capped), head_dim, capped, 132).persistent_ctas == 0


# a shuffle whose source lane is computed (P's quad exchange), not a constant broadcast
_LANE_FROM_REGISTER = r"shfl\.sync\.idx\.b32\s+%r\d+, %r\d+, %r\d+"


def test_v_permutation_puts_each_threads_pairs_in_its_operand_words():
    """blocks/fp8_operand.V_PERMUTATION against the two register layouts it joins: thread
    t of a quad holds QK^T's accumulator columns 8g + 2t, 8g + 2t + 1 (g = 0..3 of a 32-key
    step) and the FP8 A operand's positions 4t .. 4t + 3 and 16 + 4t .. 16 + 4t + 3; its
    words, unshuffled, put the pairs of groups (0, 1) in the first and (2, 3) in the second,
    so V^T column p must hold the key that lands at position p."""
    from cute_attn.blocks.fp8_operand import V_PERMUTATION

    perm32 = V_PERMUTATION + tuple(16 + k for k in V_PERMUTATION)
    for t in range(4):
        held = [8 * g + 2 * t + i for g in range(4) for i in range(2)]  # accumulator order
        positions = [4 * t + j for j in range(4)] + [16 + 4 * t + j for j in range(4)]
        assert [perm32[p] for p in positions] == held
    assert sorted(perm32) == list(range(32))


@pytest.mark.parametrize("head_dim, mask", [(128, "causal"), (256, "none")])
def test_fp8_forward_with_a_sink_compiles(head_dim, mask):
    """An attention sink in the FP8 forward (AttnFeatures.sink): the FP8 entry point reads
    the sink's logit (a global load the kernel without a sink does not have) and compiles
    spill-free."""
    from cute_attn.config import fp8_fwd_config_for

    plain = AttnFeatures(mask=mask)
    features = AttnFeatures(mask=mask, sink=True)
    art = ptx_tool.compile_fwd_artifacts("e4m3", head_dim, features, fp8_fwd_config_for(head_dim, features))
    without = ptx_tool.compile_fwd_artifacts("e4m3", head_dim, plain, fp8_fwd_config_for(head_dim, plain))
    assert f"wgmma.mma_async.sync.aligned.m64n{head_dim}k32.f32.e4m3.e4m3" in art.ptx
    assert art.ptx.count("ld.global") > without.ptx.count("ld.global")
    if art.cubin is not None:
        assert " 0 bytes spill stores" in art.ptxas_report, art.ptxas_report
        assert "serialized" not in art.ptxas_report, art.ptxas_report


@pytest.mark.parametrize("varlen", [False, True])
def test_fp8_v_transpose_compiles_with_16_byte_accesses(varlen):
    """kernels/v_transpose.py: rows in and columns out in 16-byte global accesses (the key
    permutation is in the shared-memory reads)."""
    from cute_attn import launcher

    ptx = launcher.compile_transpose(launcher.TransposeKey(128, varlen), "--keep-ptx").__ptx__
    assert ".target sm_90a" in ptx
    assert ptx.count("ld.global.v4.b32") >= 1 and ptx.count("st.global.v4.b32") >= 1
    assert "ld.global.u8" not in ptx and "st.global.u8" not in ptx


def _converts_before_waiting_for_pv(ptx):
    """Whether some e4m3 conversion of P sits between a wait for the QK^T WGMMA
    (wait_group 1: the PV WGMMA still in flight) and the next wait_group 0."""
    events = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+([01])|(cvt\.rn\.satfinite\.e4m3x2)", ptx)
    in_flight = False
    for wait, cvt in events:
        if wait:
            in_flight = wait == "1"
        elif cvt and in_flight:
            return True
    return False


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_fp8_double_buffered_p_converts_beside_the_pv_wgmma(head_dim, mask):
    """FwdConfig.p_double_buffer: block j's P is converted while block j-1's PV WGMMA still
    runs (the default kernel waits for it first), with no spill and no WGMMA serialisation
    from ptxas ("wgmma.mma_async instructions are serialized", C751x: e.g. registers of an
    in-flight WGMMA defined by other instructions), which would undo the overlap."""
    import dataclasses

    from cute_attn.config import fp8_fwd_config_for

    features = AttnFeatures(mask=mask)
    base = dataclasses.replace(fp8_fwd_config_for(head_dim, features), p_double_buffer=False,
                               pv_wait_after_softmax=False)
    default = ptx_tool.compile_fwd_artifacts("e4m3", head_dim, features, base)
    double = ptx_tool.compile_fwd_artifacts("e4m3", head_dim, features, dataclasses.replace(base, p_double_buffer=True))
    assert not _converts_before_waiting_for_pv(default.ptx)
    assert _converts_before_waiting_for_pv(double.ptx)
    if double.cubin is not None:
        assert " 0 bytes spill stores" in double.ptxas_report, double.ptxas_report
        assert "serialized" not in double.ptxas_report, double.ptxas_report


@pytest.mark.parametrize("head_dim", [192, 256])
@pytest.mark.parametrize("features", [AttnFeatures(), AttnFeatures(mask="causal"),
                                      AttnFeatures(mask="local", softcap=True), AttnFeatures(mask="causal", varlen=True)],
                         ids=["none", "causal", "local-softcap", "varlen-causal"])
def test_split_d_backward_compiles_without_spills(head_dim, features):
    """BwdConfig.split_d (head dims 192/256 without recomputing S and dP per head-dim slice, bwd_config_for's
    choice): both warpgroups' S^T / dP^T as one N-split WGMMA, dV and dK from shared memory
    (P^T in its own buffer), a single CTA per KV block, two stages; dQ by vector atomics
    from registers at 256 (no bulk reduce-add), by the sdQ tile and the writer's bulk
    reduce-add at 192; no spill and no WGMMA serialisation in the main kernel."""
    from cute_attn.config import bwd_config_for

    config = bwd_config_for(head_dim, features)
    assert config.split_d and config.dq_atomic == (head_dim == 256) and config.num_stages == 2
    arts = ptx_tool.compile_bwd_artifacts("bf16", head_dim, features, config)
    main = arts["main"]
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n32k16\.f32\.bf16\.bf16", main.ptx)  # S^T, dP^T halves
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{head_dim // 2}k16\.f32\.bf16\.bf16", main.ptx)  # dK, dV
    atomics, bulk = "red.global.add.v2.f32" in main.ptx, "cp.reduce.async.bulk" in main.ptx
    assert (atomics, bulk) == ((True, False) if config.dq_atomic else (False, True))
    if main.cubin is not None:
        assert " 0 bytes spill stores" in main.ptxas_report, main.ptxas_report
        assert "serialized" not in main.ptxas_report, main.ptxas_report


@pytest.mark.parametrize("head_dim, mask", [(128, "causal"), (256, "none")])
def test_backward_dp_wait_after_exp2_compiles(head_dim, mask):
    """BwdConfig.dp_wait_after_exp2 (off by default, not yet measured): the wait on dP^T
    behind a warp-uniform branch on P^T's converted words (mma_sm90.wait_all_groups_after,
    a wait on both sides), spill-free and without WGMMA serialisation; off, the plain wait."""
    import dataclasses

    from cute_attn.config import bwd_config_for

    features = AttnFeatures(mask=mask)
    base = bwd_config_for(head_dim, features)
    late = ptx_tool.compile_bwd_artifacts("bf16", head_dim, features,
                                          dataclasses.replace(base, dp_wait_after_exp2=True))["main"]
    assert "vote.sync.all.pred" in late.ptx and "// the other path" in late.ptx
    assert "// the other path" not in ptx_tool.compile_bwd_artifacts("bf16", head_dim, features, base)["main"].ptx
    if late.cubin is not None:
        assert " 0 bytes spill stores" in late.ptxas_report, late.ptxas_report
        assert "serialized" not in late.ptxas_report, late.ptxas_report


def test_split_d_deterministic_backward_keeps_the_ordered_reduce():
    """The deterministic backward at 256 cannot take dQ atomics (no order): bwd_config_for
    gives it the sdQ tile and the dQ writer's turn-ordered bulk reduce-adds, one stage."""
    from cute_attn.config import bwd_config_for

    features = AttnFeatures(mask="causal")
    config = bwd_config_for(256, features, deterministic=True)
    assert config.split_d and not config.dq_atomic and config.num_stages == 1
    main = ptx_tool.compile_bwd_artifacts("bf16", 256, features, config, deterministic=True)["main"]
    assert "red.global.add.v2.f32" not in main.ptx and "cp.reduce.async.bulk" in main.ptx
    if main.cubin is not None:
        assert " 0 bytes spill stores" in main.ptxas_report, main.ptxas_report


def test_dq_handoff_per_wg_backward_meets_the_writer_per_warpgroup():
    """BwdConfig.dq_handoff_per_wg: the dQ writer and each consumer warpgroup meet on
    barriers of 128 + 32 threads (warpgroup 0 on DQ_FULL / DQ_EMPTY, 1 on their _WG1
    twins), never on the joint 288-thread pair; spill-free. It needs two sdS buffers."""
    import dataclasses

    from cute_attn.blocks.barriers import NamedBarrier
    from cute_attn.config import BwdConfig

    features = AttnFeatures(mask="causal")
    config = dataclasses.replace(bwd_config_for(128, features), ds_stages=2, dq_handoff_per_wg=True)
    main = ptx_tool.compile_bwd_artifacts("bf16", 128, features, config)["main"]
    # the writer names both pairs; the consumers take theirs by warpgroup, an id in a register
    for barrier in (NamedBarrier.DQ_FULL_WG1, NamedBarrier.DQ_EMPTY_WG1):
        assert re.search(rf"bar\.(sync|arrive)\s+{int(barrier)}, 160;", main.ptx), barrier
    assert re.search(r"bar\.sync\s+%r\d+, 160;", main.ptx) and re.search(r"bar\.arrive\s+%r\d+, 160;", main.ptx)
    assert ", 288;" not in main.ptx
    if "ptxas not found" not in main.ptxas_report:
        m = re.search(r"(\d+) bytes spill stores", main.ptxas_report)
        assert m and int(m.group(1)) == 0, main.ptxas_report
    with pytest.raises(ValueError, match="dq_handoff_per_wg"):
        BwdConfig(tile_m=64, tile_n=128, num_stages=2, ds_stages=1, dq_handoff_per_wg=True)


def test_split_d_config_is_validated():
    from cute_attn.config import BwdConfig, split_d_bwd_config
    from cute_attn.kernels.bwd_sm90 import FlashBwdSm90
    from cute_attn.config import DTYPES

    assert split_d_bwd_config(256, dq_atomic=True).num_mma_warpgroups == 2
    assert split_d_bwd_config(256, dq_atomic=True).num_stages == 2
    assert split_d_bwd_config(256, dq_atomic=False).num_stages == 1
    assert split_d_bwd_config(192, dq_atomic=False).num_stages == 2
    with pytest.raises(ValueError, match="deterministic"):
        FlashBwdSm90(DTYPES["bf16"], 256, AttnFeatures(), split_d_bwd_config(256, dq_atomic=True), deterministic=True)
    for bad in (dict(tile_n=128), dict(dq_warpgroups=1)):
        with pytest.raises(ValueError, match="split_d"):
            BwdConfig(**{**dict(tile_m=64, tile_n=64, dq_warpgroups=2, split_d=True), **bad})


def test_one_stage_do_ring_compiles_spill_free_with_its_own_barriers():
    """BwdConfig.do_stages 1 under split_d (head dim 256, Q two stages): a dO ring of its
    own (one stage, 32 KB less shared memory), spill-free; refused outside split_d or at
    Q's depth or deeper."""
    import dataclasses

    from cute_attn.config import BwdConfig, split_d_bwd_config

    cfg = dataclasses.replace(split_d_bwd_config(256, dq_atomic=True), do_stages=1)
    assert cfg.do_ring == 1 and split_d_bwd_config(256, dq_atomic=True).do_ring == 2
    main = ptx_tool.compile_bwd_artifacts("bf16", 256, AttnFeatures(mask="causal"), cfg)["main"]
    m = re.search(r"(\d+) bytes spill stores", main.ptxas_report)
    assert m and int(m.group(1)) == 0, main.ptxas_report
    # Q's two stages and dO's one: full + empty barriers each, beside K/V's pair
    inits = re.findall(r"mbarrier\.init\.shared\.b64", main.ptx)
    assert len(inits) == 2 + 2 * 2 + 2 * 1, len(inits)
    for bad in (dict(do_stages=2), dict(do_stages=3), dict(do_stages=1, split_d=False, tile_n=128)):
        with pytest.raises(ValueError, match="do_stages"):
            BwdConfig(**{**dict(tile_m=64, tile_n=64, num_stages=2, dq_warpgroups=2, split_d=True), **bad})


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_head_dim_64_backward_splits_dq_by_queries(mask):
    """At head dim 64 (128 query rows per step, two warpgroups) dQ = dS K runs as 64 x 64
    WGMMAs, one per warpgroup's 64 rows (dq_accum.make_dq_mma stacks the warpgroups along
    M), not as 64 x 32 halves of the head dim: the main kernel has no n32 WGMMA left (S^T
    and dP^T are n128, dV and dK n64), and no spill."""
    arts = ptx_tool.compile_bwd_artifacts("bf16", 64, AttnFeatures(mask=mask))
    main = arts["main"]
    assert main.key.config.tile_m == 128 and main.key.config.dq_warpgroups == 2
    shapes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", main.ptx))
    assert shapes == {"64", "128"}, shapes
    if main.cubin is not None:
        assert " 0 bytes spill stores" in main.ptxas_report, main.ptxas_report


def test_backward_ds_stages_config_is_checked():
    """BwdConfig.ds_stages: two sdS buffers ride Q's two-stage ring and the sdQ tile of
    every dQ warpgroup."""
    from cute_attn.config import BwdConfig

    base = dict(tile_m=64, tile_n=128, num_stages=2)
    assert BwdConfig(**base, ds_stages=2).ds_stages == 2
    for bad in (dict(ds_stages=3), dict(ds_stages=2, num_stages=3), dict(ds_stages=2, dq_atomic=True),
                dict(ds_stages=2, dq_warpgroups=1)):
        with pytest.raises(ValueError, match="ds_stages"):
            BwdConfig(**{**base, **bad})


def test_backward_takes_two_sds_buffers_where_measured():
    """bwd_config_for's ds_stages 2 exactly where the session-19 A/B measured a gain: head
    dim 64's 128-row tiles, and head dim 128 without a mask; one buffer elsewhere."""
    two = {(d, mask) for d in (64, 96, 128) for mask in ("none", "causal", "local")
           if bwd_config_for(d, AttnFeatures(mask=mask)).ds_stages == 2}
    assert two == {(64, "none"), (64, "causal"), (128, "none")}, two
    for features in (AttnFeatures(softcap=30.0), AttnFeatures(dropout=True), AttnFeatures(sink=True)):
        assert bwd_config_for(128, features).ds_stages == 1 and bwd_config_for(64, features).ds_stages == 1
    assert bwd_config_for(64, AttnFeatures(sink=True)).tile_m == 128  # the sink keeps its tiles
    assert bwd_config_for(64, AttnFeatures(mask="none"), deterministic=True).ds_stages == 2


def test_backward_hands_dq_over_per_warpgroup_from_long_queries():
    """bwd_config_for's dq_handoff_per_wg exactly where the session-28 A/Bs measured a gain:
    head dims 64 and 128, plain masks, not deterministic, from 4K query rows (not at 1K);
    it then takes two sdS buffers (128 causal too) and otherwise the short config's tiles."""
    import dataclasses

    from cute_attn.config import DQ_HANDOFF_PER_WG_FROM_QUERIES as long

    for d in (64, 96, 128, 256):
        for mask in ("none", "causal", "local"):
            if d == 128 and mask != "local":
                continue  # swapped_dq_bwd_config at every length (the test below)
            short = bwd_config_for(d, AttnFeatures(mask=mask), max_seqlen_q=long - 1)
            assert short == bwd_config_for(d, AttnFeatures(mask=mask)) and not short.dq_handoff_per_wg
            cfg = bwd_config_for(d, AttnFeatures(mask=mask), max_seqlen_q=long)
            assert cfg.dq_handoff_per_wg == (d in (64, 128) and mask != "local"), (d, mask)
            if cfg.dq_handoff_per_wg:
                assert cfg == dataclasses.replace(short, ds_stages=2, dq_handoff_per_wg=True)
    for features in (AttnFeatures(softcap=30.0), AttnFeatures(dropout=True), AttnFeatures(sink=True)):
        assert not bwd_config_for(128, features, max_seqlen_q=long).dq_handoff_per_wg
    assert not bwd_config_for(128, AttnFeatures(), deterministic=True, max_seqlen_q=long).dq_handoff_per_wg


def test_backward_head_dim_128_takes_80_rows_and_swapped_dq():
    """bwd_config_for's session-29 choice: head dim 128 with no mask (at every query length)
    or causal (from SWAPPED_DQ_CAUSAL_FROM_QUERIES rows), dense or varlen, GQA alike, takes
    swapped_dq_bwd_config; a window, softcap, dropout, mods or the deterministic backward
    keep the 64-row tiles."""
    from cute_attn.config import DQ_HANDOFF_PER_WG_FROM_QUERIES as long
    from cute_attn.config import swapped_dq_bwd_config

    swapped = swapped_dq_bwd_config()
    assert (swapped.tile_m, swapped.dq_swapped, swapped.dq_order, swapped.ds_stages) == (80, True, "before_dk", 2)
    from cute_attn.config import SWAPPED_DQ_CAUSAL_FROM_QUERIES as causal_from

    for features in (AttnFeatures(), AttnFeatures(varlen=True)):
        for s in (0, 1024, long, 4 * long):
            assert bwd_config_for(128, features, max_seqlen_q=s) == swapped
    for features in (AttnFeatures(mask="causal"), AttnFeatures(mask="causal", varlen=True)):
        for s in (causal_from, long, 4 * long):
            assert bwd_config_for(128, features, max_seqlen_q=s) == swapped
        for s in (0, causal_from - 1):  # short causal queries keep the 64-row tiles
            assert bwd_config_for(128, features, max_seqlen_q=s).tile_m == 64
    # (a sink never reaches bwd_config_for: launcher.run_bwd drops it from the features, so
    # a sink's backward takes the sink-free choice)
    for features in (AttnFeatures(mask="local"), AttnFeatures(softcap=True), AttnFeatures(mask="causal", softcap=True),
                     AttnFeatures(dropout=True)):
        cfg = bwd_config_for(128, features, max_seqlen_q=long)
        assert not cfg.dq_swapped and cfg.tile_m == 64, features
    for mask in ("none", "causal"):
        cfg = bwd_config_for(128, AttnFeatures(mask=mask), deterministic=True)
        assert not cfg.dq_swapped and cfg.tile_m == 64
    for d in (64, 96, 192, 256):
        assert not bwd_config_for(d, AttnFeatures()).dq_swapped


@pytest.mark.parametrize("head_dim, mask", [(64, "none"), (128, "causal")])
def test_backward_with_two_sds_buffers_compiles_without_spills(head_dim, mask):
    """BwdConfig.ds_stages 2: spill-free, and one DQ_EMPTY barrier per step as with one
    buffer (it moved from before the dS^T store to before the sdQ stores), so the dQ
    writer's protocol is unchanged."""
    import dataclasses

    from cute_attn.blocks.barriers import NamedBarrier

    features = AttnFeatures(mask=mask)
    base = bwd_config_for(head_dim, features)
    one, two = (dataclasses.replace(base, ds_stages=n) for n in (1, 2))
    arts = {c: ptx_tool.compile_bwd_artifacts("bf16", head_dim, features, c)["main"] for c in (one, two)}
    dq_empty = int(NamedBarrier.DQ_EMPTY)
    counts = {c: len(re.findall(rf"bar\.sync\s+{dq_empty}, ", a.ptx)) for c, a in arts.items()}
    assert counts[two] == counts[one] > 0, counts
    if arts[two].cubin is not None:
        assert " 0 bytes spill stores" in arts[two].ptxas_report, arts[two].ptxas_report




@pytest.mark.parametrize("dq_order", ["after_dkv", "after_dv", "before_dk"])
@pytest.mark.parametrize("features, per_wg", [(AttnFeatures(), False), (AttnFeatures(varlen=True), False),
                                              (AttnFeatures(), True), (AttnFeatures(mask="causal"), True),
                                              (AttnFeatures(mask="causal", varlen=True), True)],
                         ids=["dense", "varlen", "dense-per-wg", "causal-per-wg", "causal-varlen-per-wg"])
def test_backward_80_query_rows_with_swapped_dq_compiles(features, per_wg, dq_order):
    """BwdConfig.dq_swapped with 80 query rows per step at head dim 128 (with before_dk and
    the per-warpgroup hand-off: config.swapped_dq_bwd_config, the default without a mask and
    for causal from 2K query rows): S^T, dP^T and dQ^T = K^T dS^T are m64n80 WGMMAs and dV, dK m64n128 (no
    n64 left), dS goes to shared memory by stmatrix .trans and so does the postprocess's
    dQ^T; no spill and no WGMMA serialisation (C7512) in the main kernel, the deterministic
    one included (the joint hand-off), and its shared memory within a CTA's (the launch
    checks that at trace time). Each BwdConfig.dq_order."""
    import dataclasses

    from cute_attn.config import BwdConfig

    config = BwdConfig(tile_m=80, tile_n=128, num_stages=2, ds_stages=2, dq_swapped=True, dq_handoff_per_wg=per_wg,
                       dq_order=dq_order)
    # the deterministic backward takes the joint hand-off
    for deterministic in (False, True):
        if deterministic:
            config = dataclasses.replace(config, dq_handoff_per_wg=False)
        arts = ptx_tool.compile_bwd_artifacts("bf16", 128, features, config, deterministic=deterministic)
        main = arts["main"]
        shapes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", main.ptx))
        assert shapes == {"80", "128"}, shapes
        assert "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in main.ptx
        assert "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in arts["postprocess"].ptx
        assert "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32" in main.ptx
        if main.cubin is not None:
            assert " 0 bytes spill stores" in main.ptxas_report, main.ptxas_report
            assert "C7512" not in main.ptxas_report and "serialized" not in main.ptxas_report, main.ptxas_report


def test_backward_swapped_dq_config_is_checked():
    """tile_m 80 needs dq_swapped (dQ's M is 64 per warpgroup); dq_swapped refuses split_d,
    dQ atomics, a window, the per-element features and the mods' kernel (a sink in the
    features), and head dims that are not 64 rows per dQ warpgroup; it takes no mask and
    the causal mask. The defaults take it at head dim 128 only (swapped_dq_bwd_config)."""
    from cute_attn.config import DTYPES, BwdConfig
    from cute_attn.kernels.bwd_sm90 import FlashBwdSm90

    with pytest.raises(ValueError, match="dq_swapped"):
        BwdConfig(tile_m=80)
    with pytest.raises(ValueError, match="dq_swapped"):
        BwdConfig(dq_order="before_dk")
    with pytest.raises(ValueError, match="dq_order"):
        BwdConfig(tile_m=80, dq_swapped=True, dq_order="dk_first")
    for bad in (dict(dq_atomic=True, ds_stages=1), dict(tile_n=64, split_d=True)):
        with pytest.raises(ValueError, match="dq_swapped"):
            BwdConfig(**{**dict(tile_m=80, dq_swapped=True), **bad})
    config = BwdConfig(tile_m=80, dq_swapped=True)
    for features in (AttnFeatures(mask="local"), AttnFeatures(softcap=True), AttnFeatures(mask="causal", softcap=True),
                     AttnFeatures(dropout=True), AttnFeatures(sink=True)):
        with pytest.raises(ValueError, match="dq_swapped takes no mask or the causal mask"):
            FlashBwdSm90(DTYPES["bf16"], 128, features, config)
    for features in (AttnFeatures(), AttnFeatures(mask="causal"), AttnFeatures(mask="causal", varlen=True)):
        FlashBwdSm90(DTYPES["bf16"], 128, features, config)  # constructs
    with pytest.raises(ValueError, match="head_dim"):
        FlashBwdSm90(DTYPES["bf16"], 96, AttnFeatures(), BwdConfig(tile_m=80, dq_warpgroups=1, dq_swapped=True))
    swapped = {(d, m) for d in CAPABILITIES["bwd"].head_dims for m in ("none", "causal", "local")
               for s in (0, 1024, 2048, 4096, 16384) if bwd_config_for(d, AttnFeatures(mask=m), max_seqlen_q=s).dq_swapped}
    assert swapped == {(128, "none"), (128, "causal")}, swapped
