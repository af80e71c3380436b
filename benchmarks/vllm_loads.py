"""The loads ``bench_vllm.py`` runs against a server and the client that times them:
``Req`` and ``Load`` (``make_loads``: the decode loads ``c1``, ``c8``, ... and ``mixed``),
``Client`` (vLLM's own ``vllm bench serve`` client where vLLM is importable, a stdlib one
with the same timing elsewhere), ``run_load`` (one load at its concurrency) and ``metrics``
(tok/s, TPOT, ITL and TTFT percentiles of one load's requests).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import vllm_bench_model as vbm
from vllm_servers import SERVED

# -- loads ------------------------------------------------------------------------------------


@dataclass
class Req:
    prompt: list[int]
    output_len: int
    at: float = 0.0  # arrival offset (s); requests at 0 wait for the concurrency limit
    kind: str = "short"
    # Close the connection after this many streamed tokens (0: read to the end): a client
    # that goes away mid-stream, whose request vLLM aborts inside the running batch.
    disconnect_after: int = 0


@dataclass
class Load:
    name: str
    concurrency: int
    requests: list[Req]


def make_loads(args: argparse.Namespace, vocab: int, repeat: int) -> list[Load]:
    """The loads of one repeat; prompts are random token ids (the specials excluded), the
    same for every backend, different per repeat (no prefix-cache hit across repeats)."""
    lo = len(vbm.SPECIALS)

    def ids(rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(lo, vocab) for _ in range(n)]

    loads = []
    for c in args.concurrency:
        rng = random.Random(f"c{c}-{repeat}")
        n = max(8, 6 * c) if args.requests is None else args.requests
        reqs = [Req(ids(rng, args.input_len), args.output_len) for _ in range(n)]
        loads.append(Load(f"c{c}", c, reqs))
    if args.mixed_long > 0:
        rng = random.Random(f"mixed-{repeat}")
        reqs = [
            Req(ids(rng, args.input_len), args.mixed_output_len) for _ in range(args.mixed_decoders)
        ]
        for k in range(args.mixed_long):
            n = rng.randint(args.long_min, args.long_max)
            reqs.append(Req(ids(rng, n), args.long_output_len, 0.25 + k * args.mixed_gap, "long"))
        loads.append(Load("mixed", args.mixed_decoders + args.mixed_long, reqs))
    return loads


# -- the client -------------------------------------------------------------------------------


@dataclass
class Out:
    ok: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    start: float = 0.0
    error: str = ""
    kind: str = "short"
    prompt_len: int = 0
    text: str = ""  # the streamed completion
    disconnected: bool = False  # closed by the client as its Req asked


class Client:
    """vLLM's own completions client (aiohttp) where vLLM is importable, else a stdlib one
    with the same timing (first streamed chunk = TTFT, each later chunk one ITL)."""

    def __init__(self, timeout: float, stdlib: bool = False) -> None:
        self.timeout = timeout
        self.session: Any = None
        try:
            if stdlib:  # a client that can go away mid-stream (Req.disconnect_after)
                raise ImportError("asked for")
            import aiohttp
            from vllm.benchmarks.lib import endpoint_request_func as erf

            self.kind = "vllm.benchmarks"
            self._erf: Any = erf
            self._aiohttp: Any = aiohttp
        except Exception as exc:  # the dry run outside vLLM's environment
            self.kind = f"stdlib ({type(exc).__name__}: {exc})"
            self._erf = None

    async def __aenter__(self) -> Client:
        if self._erf is not None:
            # Idle connections are dropped after 1 s, well before the server's keep-alive
            # (vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s) closes them: a load reusing one the
            # server has just closed fails with a disconnect (seen on the H200 when a c64
            # load followed a 5 s c1 load).
            self.session = self._aiohttp.ClientSession(
                connector=self._aiohttp.TCPConnector(
                    limit=0, force_close=False, keepalive_timeout=1.0
                ),
                timeout=self._aiohttp.ClientTimeout(total=self.timeout),
            )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.session is not None:
            await self.session.close()

    async def request(self, port: int, req: Req, timeout: float | None = None) -> Out:
        """One streamed completion; ``timeout`` (default the client's) bounds it."""
        limit = self.timeout if timeout is None else min(self.timeout, max(timeout, 1.0))
        url = f"http://127.0.0.1:{port}/v1/completions"
        if self._erf is not None:
            inp = self._erf.RequestFuncInput(
                prompt=req.prompt,
                api_url=url,
                prompt_len=len(req.prompt),
                output_len=req.output_len,
                model=SERVED,
                model_name=SERVED,
                ignore_eos=True,
                extra_body={"temperature": 0.0},
            )
            try:
                o = await asyncio.wait_for(
                    self._erf.async_request_openai_completions(inp, self.session), limit
                )
            except TimeoutError:
                return Out(error=f"timed out after {limit:.0f} s", kind=req.kind)
            tokens = int(o.output_tokens or 0) or (len(o.itl) + 1 if o.success else 0)
            return Out(
                o.success, o.ttft, o.latency, list(o.itl), tokens, o.start_time,
                (o.error or "")[-500:], req.kind, len(req.prompt), o.generated_text or "",
            )  # fmt: skip
        try:
            return await asyncio.wait_for(self._stdlib(port, req), limit)
        except TimeoutError:
            return Out(error=f"timed out after {limit:.0f} s", kind=req.kind)
        except Exception as exc:
            return Out(error=f"{type(exc).__name__}: {exc}", kind=req.kind)

    async def _stdlib(self, port: int, req: Req) -> Out:
        body = json.dumps(
            {
                "model": SERVED, "prompt": req.prompt, "max_tokens": req.output_len,
                "stream": True, "stream_options": {"include_usage": True},
                "ignore_eos": True, "temperature": 0.0,
            }
        ).encode()  # fmt: skip
        out = Out(kind=req.kind, prompt_len=len(req.prompt))
        st = time.perf_counter()
        out.start = st
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(
                f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
            status = (await reader.readline()).decode()
            headers = {}
            while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                k, _, v = line.decode().partition(":")
                headers[k.strip().lower()] = v.strip().lower()
            if " 200 " not in status:
                out.error = status.strip()
                return out
            chunked = headers.get("transfer-encoding") == "chunked"
            buf, last, done, usage = b"", st, False, None
            while True:
                if chunked:
                    line = await reader.readline()
                    if not line:
                        break  # cut off between chunks: no terminating chunk
                    size = int(line.strip() or b"0", 16)
                    if size == 0:
                        break
                    data = await reader.readexactly(size + 2)
                    buf += data[:-2]
                else:
                    data = await reader.read(65536)
                    if not data:
                        break
                    buf += data
                while b"\n\n" in buf:
                    msg, buf = buf.split(b"\n\n", 1)
                    text = msg.decode().strip().removeprefix("data: ")
                    if text == "[DONE]":
                        done = True
                        continue
                    if not text or text.startswith(":"):
                        continue
                    d = json.loads(text)
                    now = time.perf_counter()
                    if d.get("error"):
                        # vLLM reports a failure inside a stream as an error event (then
                        # [DONE]): the request failed, whatever it streamed before.
                        out.error = f"error event: {json.dumps(d['error'])[:400]}"
                        out.latency = now - st
                        return out
                    if d.get("choices"):
                        if out.ttft == 0.0:
                            out.ttft = now - st
                        else:
                            out.itl.append(now - last)
                        last = now
                        out.text += d["choices"][0].get("text") or ""
                        if req.disconnect_after and len(out.itl) + 1 >= req.disconnect_after:
                            out.latency, out.ok, out.disconnected = last - st, True, True
                            out.tokens = len(out.itl) + 1
                            return out  # the finally closes the connection mid-stream
                    elif d.get("usage"):
                        usage = int(d["usage"].get("completion_tokens") or 0)
                        out.tokens = usage
            out.latency = last - st
            # Whole: the stream's end marker came, and as many tokens as asked (the
            # requests ignore EOS) where the server counted them.
            if not done:
                out.error = f"the stream ended without [DONE] after {len(out.itl) + 1} chunks"
            elif usage is not None and usage != req.output_len:
                out.error = f"{usage} tokens of {req.output_len}"
            out.ok = out.ttft > 0 and not out.error
            return out
        finally:
            writer.close()


async def run_load(
    client: Client, port: int, load: Load, timeout: float
) -> tuple[list[Out], float]:
    sem = asyncio.Semaphore(load.concurrency)
    t0 = time.perf_counter()

    async def one(r: Req) -> Out:
        if r.at > 0:
            await asyncio.sleep(max(0.0, t0 + r.at - time.perf_counter()))
            return await client.request(port, r)
        async with sem:
            return await client.request(port, r)

    tasks = [asyncio.ensure_future(one(r)) for r in load.requests]
    done, pending = await asyncio.wait(tasks, timeout=timeout)
    for t in pending:
        t.cancel()
    outs = [
        t.result() if t in done and not t.cancelled() else Out(error="load timed out")
        for t in tasks
    ]
    return outs, time.perf_counter() - t0


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    f = int(k)
    return s[f] + (s[min(f + 1, len(s) - 1)] - s[f]) * (k - f)


def metrics(outs: list[Out], wall: float) -> dict[str, Any]:
    ok = [o for o in outs if o.ok]
    if not ok:
        return {"ok": 0, "failed": len(outs), "errors": sorted({o.error[:300] for o in outs})[:3]}
    start = min(o.start for o in ok)
    end = max(o.start + o.latency for o in ok)
    dur = max(end - start, 1e-9)
    short = [o for o in ok if o.kind == "short"] or ok
    long_ = [o for o in ok if o.kind == "long"]
    tpot = [(o.latency - o.ttft) / (o.tokens - 1) for o in short if o.tokens > 1]
    itl = [x for o in short for x in o.itl]
    ttft = [o.ttft for o in (long_ or ok)]
    ms = 1000.0
    return {
        "ok": len(ok),
        "failed": len(outs) - len(ok),
        "errors": sorted({o.error[:300] for o in outs if not o.ok})[:3],
        "duration_s": dur,
        "wall_s": wall,
        "output_tokens": sum(o.tokens for o in ok),
        "tok_s": sum(o.tokens for o in ok) / dur,
        "tpot_p50_ms": (_pct(tpot, 50) or 0) * ms,
        "tpot_p99_ms": (_pct(tpot, 99) or 0) * ms,
        "itl_p50_ms": (_pct(itl, 50) or 0) * ms,
        "itl_p99_ms": (_pct(itl, 99) or 0) * ms,
        "ttft_p50_ms": (_pct(ttft, 50) or 0) * ms,
        "ttft_p99_ms": (_pct(ttft, 99) or 0) * ms,
        "ttft_of": "long prompts" if long_ else "all",
        "short_ttft_p50_ms": (_pct([o.ttft for o in short], 50) or 0) * ms,
    }
