"""Attention dropout: which (query, key) pairs a call drops, as plain torch (issue 14).

The kernels draw their dropout mask from Philox4x32 (Salmon et al., "Parallel random
numbers: as easy as 1, 2, 3", SC 2011; cuRAND's and torch's counter-based generator) at 7
rounds (Philox4x32-7, which the paper reports passing TestU01's BigCrush; 10 is the
default with a safety margin, and costs the forward 43% more integer work), keyed by a
per-call seed, so the forward and the backward regenerate the same mask from the
element's coordinates alone, at any tile shape. This module computes that same mask with
torch integer arithmetic: the tests compare the kernels against a reference that applies
it, and a user can see which pairs a call dropped (`dropout_mask`).

The counter layout (blocks/dropout.py follows it). Positions are within the sequence:

- a *unit* is 4 elements, queries {q0, q0 + 8} x keys {k0, k0 + 8} with q0 % 16 < 8 and
  k0 % 16 < 8: exactly what one thread holds of a WGMMA accumulator, in the forward's S
  (queries on rows) and in the backward's S^T (keys on rows) alike;
- a *group* is the 4 units of one q0 and the keys k0 in {g, g + 1, g + 16, g + 17},
  g = k0 with bits 0 and 4 cleared: 16 elements, one Philox call (counter (q0, g, query
  head, batch entry), key the seed), one byte each: word (k0 >> 4 & 1) * 2 + (k0 & 1),
  byte (q // 8 % 2) * 2 + (k // 8 % 2). A forward thread holds whole groups (its row pair
  runs along the keys), so it draws one call per 16 elements; a backward thread holds one
  unit per group (its row pair runs along the queries) and uses one word per call;
- an element is kept iff its byte is >= threshold = round(p * 256): p is taken to 1/256,
  and kept probabilities are scaled by 1 / (1 - threshold / 256), so the expectation is
  exact. The row sums and the LSE are those of the undropped softmax (dropout acts on the
  normalised P, as torch's dropout(softmax) does).
"""

import torch

PHILOX_ROUNDS = 7  # the kernels' (philox4x32 defaults to the standard 10 for its known answers)
PHILOX_M = (0xD2511F53, 0xCD9E8D57)  # the round multipliers
PHILOX_W = (0x9E3779B9, 0xBB67AE85)  # the key schedule's increments (golden ratio, sqrt(3) - 1)
_MASK32 = 0xFFFFFFFF


def _mulhilo(a: torch.Tensor, m: int):
    """(hi, lo) 32-bit halves of a * m for 32-bit a held in int64 (no 64-bit overflow:
    a is split into 16-bit halves)."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    upper = a_hi * m  # < 2^48
    low = ((upper & 0xFFFF) << 16) + a_lo * m  # < 2^49
    return ((upper >> 16) + (low >> 32)) & _MASK32, low & _MASK32


def philox4x32(counter, key, rounds: int = 10):
    """Philox4x32 on broadcasting int64 tensors holding 32-bit values: counter (c0, c1,
    c2, c3), key (k0, k1) -> 4 words."""
    c0, c1, c2, c3 = (torch.as_tensor(c, dtype=torch.int64) & _MASK32 for c in counter)
    k0, k1 = (torch.as_tensor(k, dtype=torch.int64) & _MASK32 for k in key)
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + PHILOX_W[0]) & _MASK32, (k1 + PHILOX_W[1]) & _MASK32
        hi0, lo0 = _mulhilo(c0, PHILOX_M[0])
        hi1, lo1 = _mulhilo(c2, PHILOX_M[1])
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def threshold(p: float) -> int:
    """The 8-bit threshold of drop probability p (a byte below it drops)."""
    return min(round(p * 256), 255)


def keep_scale(p: float) -> float:
    """1 / (1 - P(drop)) for the threshold's drop probability threshold(p) / 256."""
    return 1.0 / (1.0 - threshold(p) / 256)


def dropout_mask(seed: torch.Tensor, batch: int, heads: int, seqlen_q: int, seqlen_k: int,
                 dropout_p: float) -> torch.Tensor:
    """The keep mask, bool (batch, heads, seqlen_q, seqlen_k), that mha(...,
    dropout_p=dropout_p, dropout_seed=seed) applied: seed the call's int32 (2,) tensor."""
    if seed.dtype != torch.int32 or seed.shape != (2,):
        raise ValueError(f"seed must be an int32 tensor of shape (2,), got {seed.dtype} {tuple(seed.shape)}")
    device = seed.device
    key = tuple((seed.to(torch.int64) & _MASK32).unbind())
    q = torch.arange(seqlen_q, device=device).view(1, 1, -1, 1)
    k = torch.arange(seqlen_k, device=device).view(1, 1, 1, -1)
    q_hi, k_hi = q // 8 % 2, k // 8 % 2
    q0, k0 = q - 8 * q_hi, k - 8 * k_hi
    group = k0 & ~17
    h = torch.arange(heads, device=device).view(1, -1, 1, 1)
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    words = philox4x32((q0, group, h, b), key, PHILOX_ROUNDS)
    shape = (batch, heads, seqlen_q, seqlen_k)
    word_index = ((k0 >> 4 & 1) * 2 + (k0 & 1)).expand(shape)
    word = torch.zeros(shape, dtype=torch.int64, device=device)
    for i, w in enumerate(words):
        word = torch.where(word_index == i, w.expand(shape), word)
    byte = (word >> (8 * (q_hi * 2 + k_hi))) & 0xFF
    return byte >= threshold(dropout_p)


def new_seed(device) -> torch.Tensor:
    """A call's Philox key, int32 (2,), drawn on the device from torch's generator: no host
    sync, and under CUDA-graph capture torch advances the generator per replay.

    Drawn by rand_like, not randint: torch.compile's partitioner never recomputes rand_like
    in the backward graph under aot_eager, while under activation_memory_budget or
    aggressive_recomputation it recomputed randint there, so the backward regenerated
    another key's mask (silently wrong gradients; session 32's review). Inductor decomposes
    rand_like into rand, which those settings may recompute too: compiled calls under them
    must pass dropout_seed (refuse_recomputed_draw). The uniform's bits (53 in eager, 24
    where inductor draws float32) give the key's words."""
    uniform = torch.rand_like(torch.empty(2, dtype=torch.float64, device=device))
    return uniform.mul_(2.0 ** 32).sub_(2.0 ** 31).floor_().to(torch.int32)


def refuse_recomputed_draw():
    """While torch.compile traces a call that would draw its own dropout key: refuse when the
    partitioner is set to recompute forward ops in the backward (aggressive_recomputation,
    activation_memory_budget < 1), where the draw itself may be recomputed and the backward
    would regenerate another mask. An explicit dropout_seed (a graph input) is recomputed
    to the same key."""
    import torch._functorch.config as functorch_config

    if functorch_config.aggressive_recomputation or functorch_config.activation_memory_budget < 1.0:
        raise NotImplementedError(
            "dropout without a dropout_seed under torch.compile with aggressive_recomputation or "
            "activation_memory_budget < 1: the backward could redraw the key (another mask); pass "
            "dropout_seed (an int32 (2,) tensor, e.g. torch.randint(-2**31, 2**31, (2,), dtype=torch.int32, "
            "device='cuda'), drawn outside the compiled function)")
