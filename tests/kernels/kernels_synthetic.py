"""Builder of the SYNTHETIC calibration fixture (made-up numbers, never measurements).

Times are spec rooflines divided by fixed fake efficiencies, so the report's numbers are known:
GEMM Triton/vendor = 1.10 (M <= 16), 1.20 (16 < M < 256), 1.05 (M >= 256); decode at 75 % of
HBM bandwidth for batch >= 16 and context >= 4k, 40 % otherwise; prefill at 50 % of bf16 peak.
Regenerate: ``python tests/kernels/kernels_synthetic.py`` (writes fixtures/synthetic-h100-sxm.yaml).
"""

from pathlib import Path

from servesim.kernels import calibrate as C

FIXTURE = Path(__file__).parent / "fixtures" / "synthetic-h100-sxm.yaml"
PEAKS = {"bf16_tflops": 989.4, "fp8_tflops": 1978.9, "mem_bw_gbps": 3350.0}
GEMM_RATIO = {"small": 1.10, "mid": 1.20, "large": 1.05}


def synthetic_doc() -> dict:
    fp = {"device_name": "SYNTHETIC (no GPU)", "sm_count": 132, "driver": None, "cuda": None,
          "torch": None, "triton": None, "date": "2026-01-01T00:00:00Z",
          "servesim_version": "synthetic", "mode": "quick"}
    doc = C.new_document("h100-sxm", fp, dict(PEAKS))
    doc = {"version": 2, "synthetic": True,
           "note": "SYNTHETIC test fixture: made-up numbers from rooflines, not measurements",
           **{k: v for k, v in doc.items() if k != "version"}}
    bw, fl = PEAKS["mem_bw_gbps"] * 1e9, PEAKS["bf16_tflops"] * 1e12
    doc["memcpy"].append({"bytes": 2**30, "seconds": 2 * 2**30 / (0.9 * bw),
                          "traffic_bytes": 2**31})
    for m in (1, 8, 64, 128, 512, 4096):
        flops, nbytes = C.gemm_flops_bytes(m, 6144, 4096, "bfloat16")
        vendor = max(flops / (0.8 * fl), nbytes / (0.8 * bw))
        ratio = GEMM_RATIO["small" if m <= 16 else "mid" if m < 256 else "large"]
        r = {"triton_s": vendor * ratio, "vendor_s": vendor, "vendor_impl": "torch.matmul"}
        doc["gemm"].append({"m": m, "n": 6144, "k": 4096, "dtype": "bfloat16", "flops": flops,
                            "bytes": nbytes, **r, **C._timed(r), "ops": "qkv"})
    for b, c in ((16, 4096), (64, 16384), (1, 1024)):
        d = C.DecodeShape(b, c, c, 32, 8, 128, "bfloat16", "bfloat16")
        flops, nbytes = C.decode_flops_bytes(d)
        eff = 0.75 if b >= 16 and c >= 4096 else 0.40
        r = {"triton_s": nbytes / (eff * bw), "vendor_s": None}
        doc["decode_attention"].append({
            "batch": b, "context": c, "context_max": c, "num_heads": 32, "num_kv_heads": 8,
            "head_dim": 128, "block_size": 16, "dtype": "bfloat16", "flops": flops,
            "bytes": nbytes, **r, **C._timed(r)})
    for ch, c in ((2048, 0), (512, 4096)):
        p = C.PrefillShape(1, ch, c, 32, 8, 128, "bfloat16")
        flops, nbytes = C.prefill_flops_bytes(p)
        r = {"triton_s": flops / (0.5 * fl), "vendor_s": flops / (0.6 * fl),
             "vendor_impl": "sdpa"}
        doc["prefill_attention"].append({
            "batch": 1, "chunk": ch, "context": c, "num_heads": 32, "num_kv_heads": 8,
            "head_dim": 128, "dtype": "bfloat16", "flops": flops, "bytes": nbytes, **r,
            **C._timed(r)})
    link = 450e9 * 0.8  # all-reduce at 80% of the NVLink spec, + 5 us
    for nbytes in (2**16, 2**22):
        for mode, lat in (("graph", 5e-6), ("eager", 20e-6)):
            doc["allreduce"].append({"mode": mode, "dtype": "bfloat16", "tp": 2,
                                     "bytes": nbytes, "seconds": lat + nbytes / link,
                                     "kernel": f"torch.distributed nccl ({mode})"})
    for t in (1, 64):
        shape = C.MoeShape(t, 4096, 14336, 2, 8, 2)
        flops, nbytes = C.moe_flops_bytes(shape)
        doc["moe"].append({"dtype": "bfloat16", "distribution": "balanced", "hidden": 4096,
                           "inter": 14336, "topk": 2, "experts": 8, "tp": 2, "ep": 1,
                           "tokens": t, "flops": flops, "bytes": nbytes,
                           "seconds": nbytes / (0.7 * bw), "kernel": "torch reference"})
    return doc


if __name__ == "__main__":
    print(C.write_calibration(synthetic_doc(), FIXTURE))
