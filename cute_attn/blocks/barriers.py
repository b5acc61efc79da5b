"""Named hardware barriers (bar.sync ids) used by the kernels. Id 0 is __syncthreads."""

import enum


class NamedBarrier(enum.IntEnum):
    # all consumer threads: sO (aliasing sQ) may be written once every warpgroup is done with Q
    EPILOGUE = 1
    # ping-pong: warpgroup i waits on WG_TURN_0 + i before issuing its WGMMAs
    WG_TURN_0 = 2
    WG_TURN_1 = 3
    WG_TURN_2 = 4
