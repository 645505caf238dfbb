"""Triton kernels, torch references and the GPU calibration harness (``simulate calibrate``).

Modules (torch/triton are imported by the kernel modules only, never by ``cli``):

- ``paged_attention``   paged decode attention with GQA and split-KV (+ exact merge kernel)
- ``prefill_attention`` varlen chunked-prefill attention over paged KV (V1 mixed batches)
- ``gemm``              autotuned bf16/fp16/fp8 GEMM (skinny split-K and tiled paths)
- ``reference``         plain torch references of all three
- ``calibrate``         plan from the model catalog, duration estimate, file writer, report
- ``bench``             CUDA-event benchmarks of the kernels and the vendor path
- ``cli``               ``simulate calibrate [--gpu NAME] [--dry-run] [--quick]``, ``... report``
"""
