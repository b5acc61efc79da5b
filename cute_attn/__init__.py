"""cute_attn: FlashAttention (forward and backward) for Hopper (sm_90) in the CUTLASS CuTe DSL.

Importing the package does not import the DSL; the launcher loads it on first call. Every
compile names its target, sm_90a, to the DSL (launcher._compile), so compiling on a
machine without a GPU needs no CUTE_DSL_ARCH and works whatever imported cutlass first.
"""

from cute_attn import reference
from cute_attn.api import mha, mha_varlen

__version__ = "0.1.0"
__all__ = ["mha", "mha_varlen", "reference", "__version__"]
