"""Kernel tests run on the CPU through Triton's interpreter.

``TRITON_INTERPRET=1`` must be set before triton is imported (``triton.jit`` reads it when a
kernel is decorated), so it is set here, at collection time, before any test module imports
``servesim.kernels``.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"
