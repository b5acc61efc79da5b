"""cute_attn: FlashAttention (forward and backward) for Hopper (sm_90) in the CUTLASS CuTe DSL.

Importing the package does not import the DSL; the launcher loads it on first call. Every
compile names its target, sm_90a, to the DSL (launcher._compile), so compiling on a
machine without a GPU needs no CUTE_DSL_ARCH and works whatever imported cutlass first.

Drop-in entry points (cute_attn.compat): flash_attn_func and flash_attn_varlen_func with
FlashAttention 2's conventions, sdpa with torch's scaled_dot_product_attention's. Compiles
are logged at INFO on the "cute_attn" logger.
"""

from cute_attn import reference
from cute_attn.api import mha, mha_varlen
from cute_attn.block_mask import BlockMask, create_block_mask, create_varlen_block_mask
from cute_attn.dropout import dropout_mask
from cute_attn.compat import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, sdpa
from cute_attn.fp8 import quantize_fp8
from cute_attn.kvcache import mha_with_kvcache

__version__ = "0.1.0"
__all__ = [
    "mha", "mha_varlen", "mha_with_kvcache", "flash_attn_func", "flash_attn_with_kvcache", "flash_attn_varlen_func", "sdpa", "reference",
    "quantize_fp8",
    "BlockMask",
    "create_block_mask",
    "create_varlen_block_mask",
    "dropout_mask",
    "__version__",
]
