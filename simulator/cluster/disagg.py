"""Prefill/decode disaggregation: vLLM 0.22's ``NixlConnector`` as the P/D proxies drive it
(``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``; llm-d's routing sidecar does
the same two calls).

1. The router picks a prefill instance; the proxy sends it the request with ``max_tokens=1``
   and ``kv_transfer_params={"do_remote_decode": true}``. The prefill instance runs the
   prompt (queueing, chunking, prefix hits as usual) and samples one token, which the proxy
   discards. Its KV blocks are *not* freed when it finishes (``NixlConnector.request_finished``
   → ``delay_free_blocks``): they wait for the decode side's read.
2. When the prefill response is back, the decode router picks a decode instance and the proxy
   sends it the request with the returned ``kv_transfer_params`` (``do_remote_prefill``).
3. On the decode instance the request waits in the queue like any other. At its turn the
   scheduler asks the connector (``get_num_new_matched_tokens``): every prompt token not hit
   in the decode instance's own prefix cache comes from remote, asynchronously. Blocks for the
   whole prompt are allocated (they must fit: ``full_sequence_must_fit``), the request leaves
   the queue (``WAITING_FOR_REMOTE_KVS``) and the NIXL READ runs over the link.
4. When the read is done, the prefill instance frees its blocks (``finished_sending``) and the
   decode instance puts the request back at the head of its queue with the prompt computed but
   its last token, which it recomputes to sample the first output token
   (``_update_waiting_for_remote_kv``). Decoding then proceeds as usual.

So the client's TTFT = prefill-side queue + prefill + proxy hop + decode-side queue + the
modelled transfer + the decode step that samples the first token; the prefill work is counted
once (the decode side never recomputes the prompt).

The link (``cluster.kv_transfer``): each instance has one NIC per GPU (``bandwidth_gbps`` per
GPU and direction); a transfer of ``n`` tokens moves ``n × KV bytes per token per GPU`` on
every rank in parallel (the larger per-rank share of the two sides when their TP differs) and
takes ``overhead_us + latency_us + bytes / bandwidth``. Transfers are FIFO on both endpoints'
NICs (a prefill instance serving two decoders sends one after the other), which is where
contention shows. Presets in :data:`~.config.LINK_PRESETS`.
"""

from __future__ import annotations

from servesim.simulator.cluster.offload import allocate_delayed, finish_load
from servesim.simulator.request import Request


class Nic:
    """An instance's network endpoint: busy until ``free_at``; utilization = busy / time."""

    def __init__(self):
        self.free_at = 0.0
        self.busy_s = 0.0
        self.bytes = 0
        self.num_transfers = 0


class KVLink:
    """The P→D fabric: per-GPU bandwidth, latency and per-transfer overhead, FIFO per NIC."""

    def __init__(self, bandwidth_gbps: float, latency_us: float, overhead_us: float,
                 kind: str = ""):
        self.kind = kind
        self.bandwidth = bandwidth_gbps * 1e9
        self.latency = latency_us * 1e-6
        self.overhead = overhead_us * 1e-6
        self.nics: dict[int, Nic] = {}

    def nic(self, inst) -> Nic:
        n = self.nics.get(inst.index)
        if n is None:
            n = self.nics[inst.index] = Nic()
        return n

    def duration(self, nbytes_per_gpu: int) -> float:
        return self.overhead + self.latency + nbytes_per_gpu / self.bandwidth

    def transfer(self, src, dst, num_tokens: int, now: float) -> tuple[float, float]:
        """Queue a read of ``num_tokens`` tokens' KV from ``src`` to ``dst`` at ``now``;
        return (start, end)."""
        per_gpu = num_tokens * max(src.kv_bytes_per_token, dst.kv_bytes_per_token)
        a, b = self.nic(src), self.nic(dst)
        start = max(now, a.free_at, b.free_at)
        end = start + self.duration(per_gpu)
        for n in (a, b):
            n.free_at = end
            n.busy_s += end - start
            n.bytes += per_gpu
            n.num_transfers += 1
        return start, end


class PDRecord:
    """One disaggregated request's path (``routing.csv``)."""

    __slots__ = ("client", "decode", "decode_req", "prefill", "prefill_end", "prefill_req",
                 "xfer_end", "xfer_start", "xfer_tokens", "xfer_wait_from")

    def __init__(self, client: Request, prefill, prefill_req: Request):
        self.client = client
        self.prefill = prefill
        self.prefill_req = prefill_req
        self.decode = None
        self.decode_req: Request | None = None
        self.prefill_end = float("nan")
        self.xfer_wait_from = float("nan")  # decode instance admitted it (blocks allocated)
        self.xfer_start = float("nan")
        self.xfer_end = float("nan")
        self.xfer_tokens = 0


class PrefillConnector:
    """``NixlConnector`` on a prefill instance (``do_remote_decode``): finished prefill
    requests keep their blocks until the decode side has read them."""

    def __init__(self, instance):
        self.inst = instance
        self.remote_decode: set[int] = set()  # request indices sent for remote decode
        self.held = 0

    def start_load(self, sched, req, hits, num_computed):
        return None

    def request_finished(self, req: Request) -> bool:
        if req.index not in self.remote_decode or not req.is_finished:
            return False
        self.held += 1
        return True

    def release(self, req: Request) -> None:
        """``finished_sending``: the decode side's read is done; free the blocks."""
        self.remote_decode.discard(req.index)
        self.held -= 1
        self.inst.kv.free(req)


class DecodeConnector:
    """``NixlConnector`` on a decode instance (``do_remote_prefill``): pull the prompt's KV
    that the local prefix cache lacks, asynchronously (module docstring, steps 3–4)."""

    def __init__(self, instance, link: KVLink):
        self.inst = instance
        self.env = instance.env
        self.link = link
        self.pending: dict[int, PDRecord] = {}  # request index -> its P/D record
        self.loading = 0

    def start_load(self, sched, req: Request, hits, num_computed: int) -> bool | None:
        rec = self.pending.get(req.index)
        if rec is None or rec.decode_req is not req:
            return None
        count = req.prompt_len - num_computed
        if count <= 0:
            return None
        if not allocate_delayed(sched, req, count, num_computed, hits):
            return False
        del self.pending[req.index]  # do_remote_prefill = False from now on
        sched.waiting.pop_request()
        req.num_computed_tokens = num_computed + count
        now = self.env.now
        src = rec.prefill
        start, end = self.link.transfer(src, self.inst, count, now)
        rec.xfer_wait_from, rec.xfer_start, rec.xfer_end = now, start, end
        rec.xfer_tokens = count
        self.loading += 1

        def done(_ev):
            self.loading -= 1
            src.connector_of(PrefillConnector).release(rec.prefill_req)
            finish_load(self.inst, sched, req)

        self.env.timeout(end - now).callbacks.append(done)
        return True

    def request_finished(self, req: Request) -> bool:
        return False


class MultiConnector:
    """vLLM ``MultiConnector``: the first connector that has external tokens loads them;
    a finished request's blocks wait if any connector asks."""

    def __init__(self, connectors: list):
        self.connectors = connectors

    def start_load(self, sched, req, hits, num_computed):
        for c in self.connectors:
            r = c.start_load(sched, req, hits, num_computed)
            if r is not None:
                return r
        return None

    def request_finished(self, req) -> bool:
        delay = False
        for c in self.connectors:
            delay = c.request_finished(req) or delay
        return delay
