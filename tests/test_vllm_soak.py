"""``bench_vllm.py --soak`` (``benchmarks/vllm_soak.py``) against a fake streaming server:
the clients that leave mid-stream, the samples, the probe and the verdict."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import bench_vllm
import pytest
import vllm_soak
from vllm_dry_run import _Fake
from vllm_loads import Client, Req
from vllm_servers import Server


@pytest.fixture(scope="module")
def fake() -> _Fake:
    f = _Fake(0.002)
    f.start()
    return f


def _args(tmp_path: Path, minutes: float) -> object:
    args = bench_vllm.parse_args(
        ["--soak", str(minutes), "--soak-sample", "0.5", "--mixed-decoders", "4",
         "--mixed-long", "2", "--mixed-output-len", "24", "--long-min", "64", "--long-max",
         "96", "--mixed-gap", "0.05", "--request-timeout", "10", "--log-dir", str(tmp_path)]
    )  # fmt: skip
    return args


def test_a_client_leaves_mid_stream_with_what_it_read(fake: _Fake) -> None:
    async def go() -> tuple[object, object]:
        async with Client(10, stdlib=True) as client:
            whole = await client.request(fake.port, Req([5] * 8, 12))
            left = await client.request(fake.port, Req([5] * 8, 12, disconnect_after=3))
        return whole, left

    whole, left = asyncio.run(go())
    assert whole.ok and not whole.disconnected and whole.tokens == 12  # type: ignore[attr-defined]
    assert whole.text == "".join(f" w{i}" for i in range(12))  # type: ignore[attr-defined]
    assert left.ok and left.disconnected and left.tokens == 3  # type: ignore[attr-defined]
    assert left.text == " w0 w1 w2"  # type: ignore[attr-defined]


def test_a_soak_runs_rounds_samples_and_passes(fake: _Fake, tmp_path: Path) -> None:
    args = _args(tmp_path, minutes=0.04)  # ~2.4 s: a few rounds, samples every 0.5 s
    log = tmp_path / "server.log"
    log.write_text("INFO before the soak: ERROR lines written before it do not count\n")
    server = Server("mmap", fake.port, log, healthy=True)
    table = tmp_path / "t.bin"
    table.write_bytes(os.urandom(1 << 16))
    res = asyncio.run(vllm_soak.soak(args, server, [table], vocab=512))  # type: ignore[arg-type]
    assert res.rounds >= 2 and res.failed == 0
    # Every fourth client of a round left (6 requests a round: the 4th).
    assert res.disconnected == res.rounds
    assert res.requests == 6 * res.rounds
    assert len(res.samples) >= 4 and res.probe[0] == res.probe[1] != ""
    assert vllm_soak.soak_verdict(res, tolerance_mib=256) == []
    text = vllm_soak.soak_markdown(res, 256, "mmap")
    assert "SOAK: passed" in text and "| at min | RSS anon" in text


def test_the_verdict_names_what_moved_or_failed(fake: _Fake, tmp_path: Path) -> None:
    args = _args(tmp_path, minutes=0.02)
    log = tmp_path / "server.log"
    log.write_text("")
    server = Server("mmap", fake.port, log, healthy=True)

    async def soak_with_an_abort() -> vllm_soak.SoakResult:
        task = asyncio.ensure_future(vllm_soak.soak(args, server, [], vocab=512))  # type: ignore[arg-type]
        await asyncio.sleep(0.3)
        with open(log, "a") as f:
            f.write("(EngineCore pid=1) ERROR ple-memops: aborting deferred PLE rows: watchdog\n")
        return await task

    res = asyncio.run(soak_with_an_abort())
    grown = vllm_soak.Sample(9.0, {"anon": 5.0, "file": 0.0, "shmem": 0.0}, 0.0, None)
    res.samples.append(grown)  # the anon RSS of a later sample 4 GiB above
    res.probe = ("a", "b")
    problems = vllm_soak.soak_verdict(res, tolerance_mib=256)
    assert any("error lines in the server's log" in p for p in problems)
    assert any(p.startswith("rss_anon_mib moved") for p in problems)
    assert any("probe's text changed" in p for p in problems)
    assert "SOAK: FAILED" in vllm_soak.soak_markdown(res, 256, "mmap")


def test_soak_serves_one_backend_under_the_mixed_load(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="one backend"):
        bench_vllm.main(["--soak", "1", "--backends", "gpu,mmap", "--log-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="mixed load"):
        bench_vllm.main(["--soak", "1", "--mixed-long", "0", "--log-dir", str(tmp_path)])
