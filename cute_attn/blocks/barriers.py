"""Named hardware barriers (bar.sync ids) used by the kernels. Id 0 is __syncthreads."""

import enum


class NamedBarrier(enum.IntEnum):
    # all consumer threads: an smem tile may be (re)written once every warpgroup is done
    # reading it (forward: sO over sQ; backward: dK, dV over sK, sV)
    EPILOGUE = 1
    # forward ping-pong: warpgroup i waits on WG_TURN_0 + i before issuing its WGMMAs
    WG_TURN_0 = 2
    WG_TURN_1 = 3
    WG_TURN_2 = 4
    # backward dQ hand-off between the consumers and the dQ writer warp (see bwd_sm90.py)
    DQ_FULL = 5
    DQ_EMPTY = 6
    # backward: every consumer warpgroup has written its rows of dS to shared memory
    DS_READY = 7
    # backward with dQ atomics (no dQ writer): every consumer warpgroup is done reading the
    # previous step's sdS (and sP), so they may be rewritten
    DS_FREE = 8
    # forward, persistent with a tile queue: the producer warp has written the CTA's next
    # tile index to shared memory (two slots, alternating by tile, so the producer may
    # be one tile ahead of the consumers)
    NEXT_TILE_0 = 9
    NEXT_TILE_1 = 10
    # ... and every consumer thread has read slot <parity>, which the producer may then
    # overwrite (the consumers arrive, the producer waits)
    TILE_SLOT_FREE_0 = 11
    TILE_SLOT_FREE_1 = 12
    # backward with BwdConfig.dq_handoff_per_wg: warpgroup 1's own DQ_FULL / DQ_EMPTY
    # (warpgroup 0 takes DQ_FULL / DQ_EMPTY themselves, with 128 + 32 threads each)
    DQ_FULL_WG1 = 13
    DQ_EMPTY_WG1 = 14
