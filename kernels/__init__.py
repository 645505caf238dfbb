"""Triton kernels, torch references and the GPU calibration harness (``simulate calibrate``).

Modules (torch/triton are imported by the kernel modules and ``bench`` only, never by ``cli``
or the ``calibrat*`` modules at import time):

- ``paged_attention``        paged decode attention with GQA and split-KV (+ exact merge kernel)
- ``prefill_attention``      varlen chunked-prefill attention over paged KV (V1 mixed batches)
- ``gemm``                   autotuned bf16/fp16/fp8 GEMM (skinny split-K and tiled paths)
- ``gemm_configs``           GEMM autotuning configs as plain tuples (no triton import)
- ``reference``              plain torch references of all three
- ``util``                   small helpers shared by the kernels
- ``calibrate``              ``simulate calibrate``'s GPU run (time the plan, write the file)
                             and the harness API
- ``calibration_plan``       shapes to time, from the model catalog, and their FLOPs/bytes
- ``calibration_estimate``   benchmark-loop settings and the plan's duration (``--dry-run``)
- ``calibration_file``       calibration file schema check, reading, atomic YAML/JSON writing
- ``calibration_report``     ``simulate calibrate report`` and ``check`` text
- ``import_aiconfigurator``  NVIDIA's measured vLLM kernel tables → a calibration file
- ``bench``                  CUDA-event benchmarks of the kernels and the vendor path
- ``cli``                    ``simulate calibrate [--gpu NAME] [--dry-run] [--quick]``,
                             ``report``, ``check``, ``import aiconfigurator``
"""
