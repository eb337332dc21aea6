"""The Triton implementations of the entry points, under the same names as kvshare_kernels.reference.

Importing this module imports Triton and decorates the kernels; set TRITON_INTERPRET=1 before
importing it to run them on CPU tensors (tests).
"""

from .page_copy import copy_page_tensors, copy_pages
from .decode_attention import paged_decode_attention
from .prefill_attention import paged_prefill_attention
from .kv_write import write_kv
from .cascade_decode import cascade_decode_attention

__all__ = ["write_kv", "paged_decode_attention", "paged_prefill_attention", "copy_pages", "copy_page_tensors",
           "cascade_decode_attention"]
