"""``bench_vllm.py --soak`` (``benchmarks/vllm_soak.py``) against a fake streaming server:
the clients that leave mid-stream, the samples, the probe and the verdict."""

from __future__ import annotations

import asyncio
import json
import os
import time
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


@pytest.mark.parametrize("fault", ["cut", "error"])
def test_a_stream_cut_short_or_ending_in_an_error_event_is_a_failure(fault: str) -> None:
    f = _Fake(0.001)
    f.stream_fault = fault
    f.start()

    async def go() -> object:
        async with Client(10, stdlib=True) as client:
            return await client.request(f.port, Req([5] * 8, 12))

    out = asyncio.run(go())
    assert not out.ok  # type: ignore[attr-defined]
    want = "without [DONE]" if fault == "cut" else "EngineCore died"
    assert want in out.error  # type: ignore[attr-defined]


def test_the_soak_fits_the_deadline_and_an_interrupted_one_is_written(
    fake: _Fake, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vllm_clock

    args = _args(tmp_path, minutes=5)
    args.json, args.markdown = tmp_path / "soak.json", tmp_path / "soak.md"  # type: ignore[attr-defined]
    log = tmp_path / "server.log"
    log.write_text("")
    server = Server("mmap", fake.port, log, healthy=True)
    # Five minutes asked, ~2 s left before the deadline's margin: the soak plans ~2 s.
    monkeypatch.setattr(vllm_clock, "DEADLINE", time.monotonic() + vllm_soak.MARGIN_S + 2)
    res = asyncio.run(vllm_soak.soak(args, server, [], vocab=512))  # type: ignore[arg-type]
    assert res.planned_min < 0.1 and res.elapsed_s < 30 and res.rounds >= 1
    assert res.finished and all(res.probe_ok)

    # Interrupted (the `timeout` in front of the bench sends SIGTERM): what was measured
    # is written, marked cut short, and the verdict fails.
    async def interrupted(a, srv, tables, vocab, res, progress):  # type: ignore[no-untyped-def]
        res.rounds, res.requests = 2, 12
        res.samples.append(
            vllm_soak.Sample(0.0, {"anon": 1.0, "file": 0.0, "shmem": 0.0}, 0.0, None)
        )
        progress(res)
        assert json.loads(args.json.read_text())["final"] is False  # type: ignore[attr-defined]
        raise KeyboardInterrupt("signal 15")

    monkeypatch.setattr(bench_vllm, "soak", interrupted)
    meta = {"model": "a model", "command": "bench_vllm.py --soak 5"}
    assert bench_vllm._soak(args, server, [], 512, meta) == 1  # type: ignore[arg-type]
    doc = json.loads(args.json.read_text())  # type: ignore[attr-defined]
    assert doc["final"] is True and doc["soak"]["rounds"] == 2
    assert doc["soak"]["cut_short"].startswith("an interrupt")
    assert "SOAK: FAILED: cut short by an interrupt" in args.markdown.read_text()  # type: ignore[attr-defined]


def test_a_failed_probe_fails_the_soak_even_if_both_failed_alike() -> None:
    res = vllm_soak.SoakResult(1.0, rounds=3, requests=18, disconnected=3)
    res.samples = [vllm_soak.Sample(t, {"anon": 1.0, "file": 0.0, "shmem": 0.0}, 0.0, 10.0)
                   for t in (0.0, 30.0, 60.0)]  # fmt: skip
    res.probe, res.probe_ok = ("(failed: timed out)", "(failed: timed out)"), (False, False)
    problems = vllm_soak.soak_verdict(res, tolerance_mib=256)
    assert any(p.startswith("the probe failed") for p in problems)
    res.probe_ok = (True, True)
    res.probe = ("x", "x")
    assert vllm_soak.soak_verdict(res, tolerance_mib=256) == []


def test_soak_runs_alone(tmp_path: Path) -> None:
    for extra in (["--solo"], ["--profile-steps", "4"], ["--cold"]):
        with pytest.raises(SystemExit, match="--soak runs alone"):
            bench_vllm.main(["--soak", "1", *extra, "--log-dir", str(tmp_path)])
