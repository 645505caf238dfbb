"""Cluster serving: several vLLM instances behind a router (``routers.py``), prefill/decode
disaggregation with a modelled KV link (``disagg.py``), the CPU KV-offload tier
(``offload.py``), and the cluster run (``runner.py``). Config: ``config.py``."""
