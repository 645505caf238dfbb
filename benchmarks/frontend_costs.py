"""Microbenchmark of the CPU work a vLLM API-server process does per request and per output
token: the source of the frontend priors in ``simulator/frontend.py`` (``FrontendParams``).

Each term times the same kind of work, with the same libraries where they are installable
here, that vLLM 0.22's OpenAI server does on its asyncio thread or its tokenizer thread:

- ``request_s``: parse the JSON body of a ``/v1/completions`` request (a ~1,000-token text
  prompt), validate it into a pydantic model of the request's fields, build the sampling
  parameters, serialise the engine request (1,024 token ids) for the engine-core socket, and
  format the final usage and ``[DONE]`` SSE events.
- ``tokenize_per_token_s``: HF ``tokenizers`` (Rust; what vLLM's fast tokenizers are) byte-level
  BPE encode of the prompt, per token (vLLM runs it on the renderer's tokenizer thread).
- ``detokenize_per_token_s``: incremental detokenization (``tokenizers.decoders.DecodeStream``,
  vLLM's ``FastIncrementalDetokenizer``) plus one SSE chunk per token (a pydantic stream
  response model dumped to JSON, ``data: ...`` framing), per token.
- ``ipc_s``: one-way latency of a message between two processes over a Unix socket
  (half the round trip of a 1,024-id payload, serialise + send + receive + deserialise).

These are lower bounds of the real costs (no uvicorn/ASGI routing, middleware, logging or
asyncio task switching is timed): they are priors, and ``simulate fit`` replaces them with
values fitted to a deployment's own ``vllm bench serve`` runs.

    pip install tokenizers           # optional: without it the tokenizer terms are skipped
    python benchmarks/frontend_costs.py [--repeats 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import time

import numpy as np
from pydantic import BaseModel, Field


class CompletionRequest(BaseModel):
    """The fields of vLLM's ``CompletionRequest`` a ``vllm bench serve`` client sends, plus
    the defaults the server validates."""

    model: str
    prompt: str
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    n: int = 1
    stream: bool = False
    stream_options: dict | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    echo: bool = False
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    request_id: str | None = None


class Choice(BaseModel):
    index: int
    text: str
    logprobs: dict | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionStreamResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[Choice]
    usage: dict | None = None


def _words(rng: np.random.Generator, n: int) -> list[str]:
    """Pseudo-English: a Zipf-distributed vocabulary of random lowercase words."""
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    p = 1.0 / np.arange(1, 27) ** 0.9
    vocab = ["".join(rng.choice(letters, size=int(rng.integers(1, 10)), p=p / p.sum()))
             for _ in range(20_000)]
    ranks = rng.zipf(1.2, size=n) % len(vocab)
    return [vocab[r] for r in ranks]


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_request(prompt: str, ids: list[int], repeats: int) -> float:
    body = json.dumps({"model": "meta-llama/Llama-3.1-8B", "prompt": prompt, "max_tokens": 128,
                       "temperature": 0.0, "stream": True, "ignore_eos": True,
                       "stream_options": {"include_usage": True}})

    def once():
        req = CompletionRequest.model_validate(json.loads(body))
        params = {k: getattr(req, k) for k in ("max_tokens", "temperature", "top_p", "top_k",
                                               "min_p", "seed", "stop", "ignore_eos")}
        wire = json.dumps({"request_id": "cmpl-0", "prompt_token_ids": ids, "params": params,
                           "arrival_time": time.time()}).encode()
        json.loads(wire)  # the engine core's input thread decodes it (off the API server;
        # counted here as it is part of the hop's CPU)
        usage = CompletionStreamResponse(id="cmpl-0", created=0, model=req.model, choices=[],
                                         usage={"prompt_tokens": len(ids),
                                                "completion_tokens": 128,
                                                "total_tokens": len(ids) + 128})
        (f"data: {usage.model_dump_json(exclude_unset=True)}\n\n" + "data: [DONE]\n\n").encode()

    return _median_time(once, repeats)


def bench_sse_per_token(texts: list[str], repeats: int) -> float:
    def once():
        for t in texts:
            chunk = CompletionStreamResponse(id="cmpl-0", created=0, model="m",
                                             choices=[Choice(index=0, text=t)])
            f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n".encode()

    return _median_time(once, max(1, repeats // 50)) / len(texts)


def bench_tokenizer(text_words: list[str], repeats: int) -> tuple[float, float, int, str]:
    """(encode s/token, DecodeStream s/token, prompt tokens, tokenizers version)."""
    import tokenizers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from tokenizers.decoders import DecodeStream

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [" ".join(text_words[i:i + 200]) for i in range(0, len(text_words), 200)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=32_000, show_progress=False))
    prompt_ids = tok.encode(" ".join(text_words[:1400])).ids[:1024]
    prompt = tok.decode(prompt_ids)
    n = len(tok.encode(prompt).ids)
    enc = _median_time(lambda: tok.encode(prompt), max(1, repeats // 20)) / n
    out_ids = prompt_ids[:128]

    def stream():
        ds = DecodeStream(skip_special_tokens=True)
        for i in out_ids:
            ds.step(tok, i)

    dec = _median_time(stream, max(1, repeats // 20)) / len(out_ids)
    return enc, dec, n, tokenizers.__version__


def _echo(sock: socket.socket, n: int) -> None:
    for _ in range(n):
        size = int.from_bytes(sock.recv(4), "little")
        buf = b""
        while len(buf) < size:
            buf += sock.recv(size - len(buf))
        data = json.dumps(json.loads(buf)).encode()
        sock.sendall(len(data).to_bytes(4, "little") + data)


def bench_ipc(ids: list[int], repeats: int) -> float:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:  # child: echo server
        a.close()
        _echo(b, repeats)
        os._exit(0)
    b.close()
    payload = json.dumps({"prompt_token_ids": ids}).encode()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a.sendall(len(payload).to_bytes(4, "little") + payload)
        size = int.from_bytes(a.recv(4), "little")
        buf = b""
        while len(buf) < size:
            buf += a.recv(size - len(buf))
        json.loads(buf)
        times.append(time.perf_counter() - t0)
    os.waitpid(pid, 0)
    return statistics.median(times) / 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2000)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    words = _words(rng, 200_000)
    prompt = " ".join(words[:900])
    ids = [int(x) for x in rng.integers(0, 128_000, size=1024)]
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                       cpu)
    except OSError:
        pass
    print(f"# {cpu}, Python {platform.python_version()}")
    req = bench_request(prompt, ids, a.repeats)
    print(f"request_s               {req * 1e6:8.1f} us  (parse + validate + params + "
          "engine request + final SSE events)")
    sse = bench_sse_per_token([w + " " for w in words[:128]], a.repeats)
    try:
        enc, dec, n, ver = bench_tokenizer(words, a.repeats)
        print(f"tokenize_per_token_s    {enc * 1e6:8.3f} us  (tokenizers {ver}, byte-level BPE "
              f"32k, {n}-token prompt)")
        print(f"detokenize_per_token_s  {(dec + sse) * 1e6:8.1f} us  (DecodeStream "
              f"{dec * 1e6:.2f} + SSE chunk {sse * 1e6:.1f})")
    except ImportError:
        print(f"(tokenizers not installed) SSE chunk per token {sse * 1e6:.1f} us")
    ipc = bench_ipc(ids, max(100, a.repeats // 4))
    print(f"ipc_s                   {ipc * 1e6:8.1f} us  (one way, 1024-id payload, Unix "
          "socket)")


if __name__ == "__main__":
    main()
