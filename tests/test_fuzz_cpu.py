"""The fuzz test's machinery without a GPU (tests/fuzz.py, tests/gpu_checks.py): the draw
repeats per seed, every case reproduces from its one-line spec, shards split the cases by
compile specialisation, N = 2000 covers every feature combination, every drawn case passes
the API's checks, the default run stays within its compile budget, and the shared checker
passes the fp32 reference standing in for the kernel and fails wrong stand-ins."""

import math
import shlex

import fuzz
import pytest
import torch
from fuzz import COMBOS, FuzzCase, compile_keys, draw_cases, shard, spec_key
from gpu_checks import assert_cap_bites, check_case, reference, seen

import cute_attn
from cute_attn.config import CAPABILITIES
from cute_attn.validation import check_cu_seqlens_values

BIG = 2000  # the acceptance run's N
SEEDS = (fuzz.DEFAULT_SEED, 1, 2)


@pytest.fixture(scope="module")
def big_draw():
    return draw_cases(fuzz.DEFAULT_SEED, BIG)


def test_draw_is_a_function_of_the_seed(big_draw):
    assert draw_cases(fuzz.DEFAULT_SEED, BIG) == big_draw
    assert draw_cases(fuzz.DEFAULT_SEED, 30) == big_draw[:30]  # a smaller N is a prefix
    assert draw_cases(fuzz.DEFAULT_SEED + 1, 30) != big_draw[:30]
    assert len({c.seed for c in big_draw}) > 0.99 * BIG  # inputs differ case to case


def test_every_case_reproduces_from_its_one_line_spec(big_draw):
    for case in big_draw + draw_cases(1, BIG):
        line = case.repro()
        assert "\n" not in line
        assert line.startswith("pytest tests/test_fuzz_gpu.py --fuzz-case ")
        args = shlex.split(line)  # as a shell would pass it
        assert FuzzCase.parse(args[args.index("--fuzz-case") + 1]) == case, line


def test_parse_rejects_unknown_keys():
    with pytest.raises(ValueError, match="unknown fuzz-case keys"):
        FuzzCase.parse("dtype=bf16 d=64 h=1 hkv=1 b=1 sq=1 sk=1 cusal=1")


@pytest.mark.parametrize("n", [1, 3, 8])
def test_shards_partition_the_cases_by_spec_key(big_draw, n):
    shards = [shard(big_draw, i, n) for i in range(n)]
    assert sorted(map(repr, sum(shards, []))) == sorted(map(repr, big_draw))
    owner = {}
    for i, cases in enumerate(shards):
        for case in cases:
            assert owner.setdefault(spec_key(case), i) == i, f"{spec_key(case)} in two shards"
    # the deal gives every shard the same number of specialisations, +-1
    keys_per_shard = [len({spec_key(c) for c in cases}) for cases in shards]
    assert max(keys_per_shard) - min(keys_per_shard) <= 1, keys_per_shard


def test_combos_are_everything_both_passes_accept():
    fwd, bwd = CAPABILITIES["fwd"], CAPABILITIES["bwd"]
    assert set(fuzz.HEAD_DIMS) == set(fwd.head_dims) & set(bwd.head_dims)
    assert set(fuzz.DTYPE_NAMES) == set(fwd.dtypes) & set(bwd.dtypes) == {"bf16", "fp16"}
    assert len(COMBOS) == len(fuzz.DTYPE_NAMES) * len(fuzz.HEAD_DIMS) * 3 * 2 * 2


@pytest.mark.parametrize("seed", SEEDS)
def test_2000_cases_cover_every_combination(seed):
    cases = draw_cases(seed, BIG)
    drawn = {(c.dtype, c.head_dim, c.mask, c.softcap > 0, c.varlen) for c in cases}
    assert drawn == set(COMBOS)
    dense = [c for c in cases if not c.varlen]
    varlen_pairs = [pair for c in cases if c.varlen for pair in c.lens]
    windows = [c.window_size for c in cases if c.mask == "local"]
    seen_features = {
        "sq > sk": any(c.seqlen_q > c.seqlen_k for c in dense),
        "sq < sk": any(c.seqlen_q < c.seqlen_k for c in dense),
        "sq == sk": any(c.seqlen_q == c.seqlen_k for c in dense),
        "seqlen 1": any(c.seqlen_q == 1 for c in dense) and any(c.seqlen_k == 1 for c in dense),
        "batch 1": any(c.batch == 1 for c in dense),
        "empty q sequence": any(lq == 0 < lk for lq, lk in varlen_pairs),
        "empty k sequence": any(lk == 0 < lq for lq, lk in varlen_pairs),
        "empty sequence": (0, 0) in varlen_pairs,
        "window narrower than a tile": any(0 <= min(w) <= 17 for w in windows),
        "window wider than the sequences": any(max(w) >= 1000 for w in windows),
        "one-sided window": any(-1 in w for w in windows),
        "causal with a left window": any(c.causal for c in cases if c.mask == "local"),
        "causal spelled (-1, 0)": any(not c.causal for c in cases if c.mask == "causal"),
        "MQA": any(c.nheads_kv == 1 < c.nheads for c in cases),
        "custom scale": any(c.softmax_scale is not None for c in cases),
        "deterministic": any(c.deterministic for c in cases),
        "packed GQA": any(not k.endswith("pack1") for k, _ in map(compile_keys, cases)),
    }
    assert all(seen_features.values()), [k for k, ok in seen_features.items() if not ok]
    assert {c.nheads // c.nheads_kv for c in cases} == {1, 2, 4, 8}
    assert {c.softcap for c in cases} == {0.0, *fuzz.SOFTCAPS}
    assert {c.layout for c in cases} == set(fuzz.LAYOUTS)


def test_drawn_cases_pass_every_api_check(big_draw):
    """Nothing drawn is something the API rejects (no case is skipped, so none may be
    invalid): on CPU tensors, mha / mha_varlen get through every check to the last one, the
    device, and the varlen offsets are right."""
    for case in big_draw[:2 * len(COMBOS)]:  # every combination twice (inputs take time)
        q, k, v, _, cu = fuzz.inputs(case, "cpu")
        p = case.problem()
        kwargs = dict(causal=case.causal, window_size=case.window_size, softcap=case.softcap,
                      softmax_scale=case.softmax_scale, deterministic=case.deterministic)
        with pytest.raises(ValueError, match="cute_attn needs CUDA tensors"):
            if case.varlen:
                cute_attn.mha_varlen(q, k, v, *cu, max(p.lens_q), max(p.lens_k), **kwargs)
            else:
                cute_attn.mha(q, k, v, **kwargs)
        if case.varlen:
            check_cu_seqlens_values(q, k, *cu, max(p.lens_q), max(p.lens_k))


def test_default_run_fits_in_two_minutes():
    """The compile budget behind fuzz.DEFAULT_N (its comment has the arithmetic)."""
    cases = draw_cases(fuzz.DEFAULT_SEED, fuzz.DEFAULT_N)
    assert len({spec_key(c) for c in cases}) == fuzz.DEFAULT_N <= 20
    fwd, bwd = zip(*map(compile_keys, cases))
    # ~2.5 s per forward or backward specialisation on an H100
    assert 2.5 * (len(set(fwd)) + len(set(bwd))) <= 85


# ---------------------------------------------------------------- the checker's teeth on CPU

def reference_kernel(**wrong):
    """A stand-in for the kernel with cute_attn.mha's interface: the fp32 reference, its out
    rounded to the input dtype as the kernel's is; `wrong` overrides the case's causal /
    window_size / softcap / softmax_scale."""
    def kernel(case, q, k, v, cu, return_lse=False, deterministic=False):
        out, lse = reference(case, q.float(), k.float(), v.float(), cu, upcast=True, **wrong)
        out = out.to(q.dtype)
        return (out, lse) if return_lse else out
    return kernel


def wrong_backward_kernel(**wrong):
    """The right forward values with the gradients of a wrong one."""
    right, bad = reference_kernel(), reference_kernel(**wrong)

    def kernel(case, q, k, v, cu, return_lse=False, deterministic=False):
        out, lse = right(case, q, k, v, cu, return_lse=True)
        out_bad = bad(case, q, k, v, cu)
        out = out.detach() + (out_bad - out_bad.detach())
        return (out, lse) if return_lse else out
    return kernel


def unwritten_rows_kernel(case, q, k, v, cu, return_lse=False, deterministic=False):
    """The reference, but rows that see no key left as poisoned memory would leave them."""
    out, lse = reference_kernel()(case, q, k, v, cu, return_lse=True)
    rows, _ = seen(case, q.device)
    out = out.clone()
    out.movedim(-3, 0)[~rows] = math.nan
    return (out, lse) if return_lse else out


def _cost(case):
    pairs = case.lens if case.varlen else [(case.seqlen_q, case.seqlen_k)] * case.batch
    return sum(lq * lk for lq, lk in pairs) * case.nheads * case.head_dim


CHEAP = [c for c in draw_cases(fuzz.DEFAULT_SEED, len(COMBOS)) if _cost(c) <= 2e7]


@pytest.mark.parametrize("case", CHEAP, ids=[c.test_id(i) for i, c in enumerate(CHEAP)])
def test_checker_passes_the_reference_standing_in_for_the_kernel(case):
    """Drawn cases, their layouts and inputs as the GPU test builds them, on the CPU."""
    check_case(case.problem(), *fuzz.inputs(case, "cpu"), kernel=reference_kernel())


# 129 queries, 61 keys: with causal, the first 68 rows see no key
CAUSAL = FuzzCase("bf16", 64, nheads=4, nheads_kv=2, batch=2, seqlen_q=129, seqlen_k=61,
                  causal=True, layout="bhsd", seed=5)
CAPPED = FuzzCase("fp16", 96, nheads=2, nheads_kv=1, lens=((17, 40), (0, 3), (100, 61)),
                  window_size=(5, 7), softcap=5.0, layout="slice", seed=6)
WRONG = [
    pytest.param(CAUSAL, reference_kernel(softmax_scale=1.0), "out: kernel error", id="scale-missing"),
    # top-left causal is the bottom-right window (-1, seqlen_q - seqlen_k)
    pytest.param(CAUSAL, reference_kernel(causal=False, window_size=(-1, 68)), "out: kernel error",
                 id="causal-top-left"),
    pytest.param(CAUSAL, unwritten_rows_kernel, "out has NaN", id="rows-unwritten"),
    pytest.param(CAPPED, reference_kernel(softcap=0.0), "out: kernel error", id="softcap-omitted"),
    pytest.param(CAPPED, reference_kernel(window_size=(4, 7)), "out: kernel error",
                 id="window-left-off-by-one"),
    pytest.param(CAUSAL, wrong_backward_kernel(softmax_scale=1.0), r"d[qkv]: kernel error",
                 id="backward-scale-missing"),
    pytest.param(CAPPED, wrong_backward_kernel(softcap=0.0), r"d[qkv]: kernel error",
                 id="backward-softcap-omitted"),
]


@pytest.mark.parametrize("case, kernel, failure", WRONG)
def test_checker_fails_a_wrong_stand_in(case, kernel, failure):
    inputs = fuzz.inputs(case, "cpu")
    check_case(case.problem(), *inputs, kernel=reference_kernel())
    with pytest.raises(AssertionError, match=failure):
        check_case(case.problem(), *inputs, kernel=kernel)


def test_softcap_inputs_make_the_cap_bite():
    """With a custom scale too: about 5% of the scaled scores lie beyond the cap."""
    for scale in (None, *fuzz.SCALES):
        case = FuzzCase("bf16", 128, 2, 2, batch=1, seqlen_q=500, seqlen_k=500, softcap=30.0,
                        softmax_scale=scale, seed=7)
        q, k, *_ = fuzz.inputs(case, "cpu")
        assert_cap_bites(case.problem(), q, k)


def test_layouts_are_views_of_the_same_values():
    t = torch.randn(3, 5, 4, 64).to(torch.bfloat16)
    for layout in fuzz.LAYOUTS:
        view = fuzz.relayout(t, layout)
        assert torch.equal(view, t) and view.stride()[-1] == 1
        assert all(s % 8 == 0 for s in view.stride()[:-1]) and view.data_ptr() % 16 == 0
    assert fuzz.relayout(t, "bhsd").transpose(1, 2).is_contiguous()
    assert fuzz.relayout(t, "slice").untyped_storage().nbytes() > t.nbytes
