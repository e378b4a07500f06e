"""The payload widths the Triton kernels pack (:data:`TRITON_WIDTHS`; int6/int5 run on the torch reference).

Read both by :func:`kvcal.kernels.triton_supports` (which must not import triton) and by the kernels of
:mod:`kvcal.kernels.triton_quant` (which the package imports lazily): it lives below both, so that
``triton_quant`` does not import the package that imports it — the circle issue 41 cut. ``kvcal.kernels`` re-exports
it.
"""

from __future__ import annotations

#: Payload widths the Triton kernels pack (int6/int5 run on the torch reference).
TRITON_WIDTHS = (8, 4, 3, 2)

__all__ = ["TRITON_WIDTHS"]
