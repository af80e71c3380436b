"""``benchmarks/residency.py``: a file's share in the page cache held from outside the
processes that read it, mapped pages included."""

from __future__ import annotations

import errno
import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest
import residency
from vllm_probes import evict

MIB = 1 << 20
CHUNK = 2 * MIB
CHUNKS = 32

_TOUCHER = """
import mmap, sys, time
f = open(sys.argv[1], "rb")
m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
s = 0
for i in range(0, len(m), mmap.PAGESIZE):
    s += m[i]
print("mapped", flush=True)
sys.stdin.readline()
"""


def _resident_chunks(path: Path) -> set[int]:
    vec = residency.resident_pages(path)
    per = CHUNK // mmap.PAGESIZE
    return {c for c in range(CHUNKS) if any(b & 1 for b in vec[c * per : (c + 1) * per])}


@pytest.fixture
def table(tmp_path: Path) -> Path:
    path = tmp_path / "table.bin"
    path.write_bytes(os.urandom(CHUNKS * CHUNK))
    evict([path])
    if _resident_chunks(path):
        pytest.skip(f"{tmp_path}'s file system keeps its pages (tmpfs?): nothing to hold")
    path.read_bytes()  # all of it resident again
    return path


def test_a_share_is_held_for_pages_another_process_maps(table: Path) -> None:
    """A quarter of the chunks stay, exactly the kept ones, though another process maps
    and has touched every page (``POSIX_FADV_DONTNEED`` alone cannot drop those)."""
    with subprocess.Popen(
        [sys.executable, "-c", _TOUCHER, str(table)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as child:
        try:
            _hold_a_quarter(table, child)
        finally:
            child.kill()


def _hold_a_quarter(table: Path, child: subprocess.Popen[str]) -> None:
    assert child.stdout is not None and child.stdout.readline().strip() == "mapped"
    assert [m.pid for m in residency.mappers(table)] == [child.pid]
    evict([table])  # fadvise alone leaves the mapped pages where they are
    assert len(_resident_chunks(table)) == CHUNKS

    holder = residency.ResidencyHolder([table], 0.25, CHUNK, seed=3)
    try:
        got = holder.tick()
    except residency.HoldError as exc:
        if exc.errno not in (errno.EPERM, errno.EACCES, errno.ENOSYS):
            raise  # not the machine's refusal: the holder's own fault
        pytest.skip(f"this machine refuses process_madvise: {exc}")
    assert got["before"] == 1.0 and got["after"] == 0.25
    assert got["paged_out_pids"] == [child.pid]
    assert got["dropped_bytes"] == (CHUNKS - 8) * CHUNK
    assert _resident_chunks(table) == set(holder.files[0].keep)
    assert len(holder.files[0].keep) == 8

    # A reader brings chunks back; the next tick drops them again, and reports how far
    # above the share they were.
    table.read_bytes()
    again = holder.tick()
    assert again["before"] == 1.0 and again["after"] == 0.25
    assert _resident_chunks(table) == set(holder.files[0].keep)


def test_the_kept_chunks_are_the_seeds_and_the_shares_ends_hold(table: Path) -> None:
    a = residency.ResidencyHolder([table], 0.5, CHUNK, seed=1)
    assert a.files[0].keep == residency.ResidencyHolder([table], 0.5, CHUNK, seed=1).files[0].keep
    assert a.files[0].keep != residency.ResidencyHolder([table], 0.5, CHUNK, seed=2).files[0].keep
    everything = residency.ResidencyHolder([table], 1.0, CHUNK).tick()
    assert everything["dropped_bytes"] == 0 and everything["after"] == 1.0
    nothing = residency.ResidencyHolder([table], 0.0, CHUNK).tick()
    assert nothing["after"] == 0.0 and not _resident_chunks(table)


def test_the_kept_share_is_read_in_first(table: Path) -> None:
    """A run at a share starts with that share resident whatever ran before it: ``fill``
    reads in every kept chunk, and the tick then drops the rest."""
    residency.ResidencyHolder([table], 0.0, CHUNK).tick()
    assert not _resident_chunks(table)
    holder = residency.ResidencyHolder([table], 0.5, CHUNK, seed=4)
    assert holder.fill() == len(holder.files[0].keep) * CHUNK
    assert _resident_chunks(table) >= set(holder.files[0].keep)
    holder.tick()
    assert _resident_chunks(table) == set(holder.files[0].keep)
    assert holder.fill() == 0  # all there: nothing read


def test_bad_arguments_are_refused(table: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="share"):
        residency.ResidencyHolder([table], 1.5)
    with pytest.raises(ValueError, match="chunk_bytes"):
        residency.ResidencyHolder([table], 0.5, chunk_bytes=1000)
    assert residency.main(["--share", "2", str(table)]) == 2
    assert "share must be within [0, 1]" in capsys.readouterr().err
    assert residency.main(["--share", "0.5", str(table.parent / "missing")]) == 2


def test_the_vllm_bench_holds_its_table_files_for_the_run(table: Path, tmp_path: Path) -> None:
    """``bench_vllm.py --residency S`` runs the holder over the table files for the whole
    run (its lines in residency.log), returning once the kept share is resident (from a
    table with nothing cached), and refuses a share outside [0, 1]."""
    import bench_vllm

    evict([table])
    args = bench_vllm.parse_args(["--residency", "0.25", "--log-dir", str(tmp_path / "logs")])
    holder = bench_vllm._hold_residency(args, [table])
    assert holder is not None
    try:
        kept = residency.ResidencyHolder([table], 0.25).files[0].keep  # its chunks, its seed
        assert _resident_chunks(table) == set(kept) and len(kept) == CHUNKS // 4
    finally:
        holder.terminate()
        holder.wait(timeout=10)
    assert (
        "residency: share 0.25: the kept chunks read in, 16 MiB"
        in (tmp_path / "logs" / "residency.log").read_text()
    )
    assert bench_vllm._hold_residency(bench_vllm.parse_args([]), [table]) is None
    with pytest.raises(SystemExit, match="a share from 0 to 1"):
        bench_vllm._hold_residency(bench_vllm.parse_args(["--residency", "1.5"]), [table])


def _doc(share: float | None, servers: list[str], tok: dict[tuple[str, str], float],
         mem: tuple[float, ...] | None = None) -> dict[str, object]:  # fmt: skip
    """``mem``: host memory in use and page cache added by the servers, and shared memory."""
    meta: dict[str, object] = {"residency": share}
    if mem is not None:
        shm = mem[2] if len(mem) > 2 else 0.0
        meta["host_memory_before"] = {"used": 10.0, "cached": 2.0, "shmem": 0.1}
        meta["host_memory_all_servers"] = {"used": 10.0 + mem[0], "cached": 2.0 + mem[1],
                                           "shmem": 0.1 + shm}  # fmt: skip
    runs = [{"ok": True, "backend": b, "load": load, "tok_s": t * f, "itl_p50_ms": 1000 / t / f}
            for (b, load), t in tok.items() for f in (0.99, 1.0, 1.01)]  # fmt: skip
    for r in runs:  # the engine's wait a step, and the storage's reads below a full share
        if r["backend"] == "disk":
            r["disk"] = {"stage_p50_us": 5000.0, "reads_p50_us": 4000.0}
        else:
            r["graphs"] = {"results_p50_us": 700.0}
        if share is not None and share < 1.0:
            r |= {"disk_read_mib_s": 150.0, "disk_read_iops": 2400.0, "disk_read_kib": 64.0}
    return {"meta": meta, "servers": {s: {} for s in servers}, "runs": runs}


def test_the_disk_offload_report_draws_the_residency_curve_and_the_servers_memory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The residency table has a column per share (medians over the repeats), the plot is
    written, and a run of one backend's replicas gives its memory against one server."""
    import json

    import disk_offload_report as rep

    docs = [
        _doc(1.0, ["disk", "mmap"], {("disk", "c64"): 900.0, ("mmap", "c64"): 1000.0}),
        _doc(0.1, ["disk", "mmap"], {("disk", "c64"): 300.0, ("mmap", "c64"): 800.0}),
        _doc(None, ["mmap"], {("mmap", "c1"): 100.0}, mem=(0.5, 4.0)),
        _doc(None, ["mmap", "mmap.2", "mmap.3", "mmap.4"], {("mmap", "c1"): 100.0}, mem=(2.0, 4.0)),
        _doc(None, ["uva"], {("uva", "c1"): 100.0}, mem=(4.5, 0.0)),
        _doc(None, ["uva", "uva.2"], {("uva", "c1"): 100.0}, mem=(9.0, 0.0, 16.0)),
    ]
    table = rep.residency_table(docs)
    assert "| 100% resident: tok/s, ITL p50 ms | 10% resident: tok/s, ITL p50 ms |" in table
    assert "| disk | c64 | 900, 1.11 | 300, 3.33 |" in table
    assert "| mmap | c64 | 1,000, 1.00 | 800, 1.25 |" in table
    io = rep.residency_io_table(docs)
    assert "| disk | c64 | 10% | 300 | 3.33 | 5,000 (reads 4,000) | 150.0 | 2,400 | 64 |" in io
    assert "| mmap | c64 | 10% | 800 | 1.25 | 700 | 150.0 | 2,400 | 64 |" in io
    assert "| mmap | c64 | 100% | 1,000 | 1.00 | 700 | - | - | - |" in io
    pairs = rep.residency_pairs_table(docs)
    assert "| load | resident | mmap vs disk: ITL, tok/s |" in pairs
    assert "| c64 | 100% | -10.0%, +11.1% |" in pairs and "| c64 | 10% | -62.5%, +166.7% |" in pairs
    assert "A/A" not in pairs  # no replica in these runs
    twin = _doc(
        0.1,
        ["disk", "mmap", "mmap.2"],
        {("disk", "c64"): 300.0, ("mmap", "c64"): 800.0, ("mmap.2", "c64"): 820.0},
    )
    pairs = rep.residency_pairs_table([docs[0], twin])
    assert "| A/A mmap.2 vs mmap: ITL, tok/s |" in pairs
    assert "| c64 | 10% | -62.5%, +166.7% | -2.4%, +2.5% |" in pairs
    assert "| c64 | 100% | -10.0%, +11.1% | - |" in pairs  # no replica at that share
    assert rep.residency_pairs_table([docs[2]]) == ""  # no residency run
    # other pairs, asked for: one column each, in the order asked; a backend no run has:
    # left out
    three = _doc(
        0.0,
        ["disk", "mmap", "mmap-unordered"],
        {("disk", "c1"): 100.0, ("mmap", "c1"): 125.0, ("mmap-unordered", "c1"): 110.0},
    )
    asked = [("mmap", "mmap-unordered"), ("mmap", "disk"), ("mmap-lead", "disk")]
    pairs = rep.residency_pairs_table([three], asked)
    assert (
        "| load | resident | mmap vs mmap-unordered: ITL, tok/s | mmap vs disk: ITL, tok/s |"
        in (pairs)
    )
    assert "| c1 | 0% | -12.0%, +13.6% | -20.0%, +25.0% |" in pairs
    # a load that did not finish: its requests that failed are named beside its figures
    late = _doc(0.0, ["disk", "mmap"], {("disk", "c64"): 200.0, ("mmap", "c64"): 250.0})
    for r in late["runs"]:  # type: ignore[union-attr]
        r["ok"], r["failed"] = (100, 28) if r["backend"] == "disk" else (128, 0)
    assert "| disk | c64 | 200, 5.00 (84 of 384 requests failed) |" in rep.residency_table([late])
    assert "| mmap | c64 | 250, 4.00 |" in rep.residency_table([late])
    assert "| disk | c64 | 0% | 200 (84 of 384 requests failed) | 5.00 |" in (
        rep.residency_io_table([late])
    )
    # shares measured on two lent hosts are named as such; one host (or none known): nothing
    assert rep.residency_hosts(docs) == ""
    twin["meta"]["gpu_uuid"] = "GPU-b"  # type: ignore[index]
    assert rep.residency_hosts([docs[0], twin]) == (
        "The shares come from 2 GPUs (hosts), to compare within one only: "
        "100% on unknown; 10% on GPU-b"
    )
    docs[0]["meta"]["gpu_uuid"] = "GPU-b"  # type: ignore[index]
    assert rep.residency_hosts([docs[0], twin]) == ""
    docs[0]["meta"]["gpu_uuid"] = "GPU-a"  # type: ignore[index]
    # each server's view of the table files' resident pages
    for i in (3, 5):
        for name in docs[i]["servers"]:
            docs[i]["servers"][name] = {"page_cache_gib": 4.0}
    # one server of two data-parallel ranks: its own row, not one server's reference
    docs.append(_doc(None, ["mmap"], {("mmap", "c1"): 100.0}, mem=(1.0, 4.0)))
    docs[-1]["meta"]["data_parallel_size"] = 2  # type: ignore[index]
    servers = rep.servers_table(docs)
    assert "| mmap | 1 (2) | +1.00 GiB | +4.00 GiB | +0.00 GiB | 1.11x | - | - |" in servers
    assert "| mmap | 1 | +0.50 GiB | +4.00 GiB | +0.00 GiB | 1.00x | - | - |" in servers
    assert "| mmap | 4 | +2.00 GiB | +4.00 GiB | +0.00 GiB | 1.33x | 4.00 GiB | 1.00 |" in servers
    assert "| uva | 2 | +9.00 GiB | +0.00 GiB | +16.00 GiB | 2.00x | 4.00 GiB | 5.00 |" in servers

    paths = []
    for i, doc in enumerate(docs):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(doc))
    png = tmp_path / "res.png"
    assert rep.main([*map(str, paths), "-o", str(png)]) == 0
    out = capsys.readouterr().out
    assert png.stat().st_size > 10_000 and "Several servers" in out
    assert "100% on GPU-a; 10% on unknown" in out  # docs[1], the 10% run, says no card
    assert rep.main([str(paths[2])]) == 0  # no residency run: the servers table only
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert rep.main([str(bad)]) == 2
    assert rep.main([str(paths[1]), "--pair", "mmap"]) == 2  # not OURS:THEIRS
    capsys.readouterr()
    assert rep.main([str(paths[1]), "--pair", "disk:mmap", "--pair", "mmap:disk"]) == 0
    out = capsys.readouterr().out
    assert "| load | resident | disk vs mmap: ITL, tok/s | mmap vs disk: ITL, tok/s |" in out


def test_the_cold_benchmark_writes_its_table_into_a_folder_it_makes(tmp_path: Path) -> None:
    """``bench_cold.py host --dir DIR`` on a fresh host: DIR need not exist yet; the table
    is written there by the safetensors package and reused when present."""
    import bench_cold

    where = tmp_path / "not" / "yet"
    path = bench_cold.make_table(where, 0.001)
    rows = int(0.001 * 2**30) // bench_cold.ROW_BYTES
    assert path.parent == where and path.stat().st_size >= rows * bench_cold.ROW_BYTES
    assert bench_cold.make_table(where, 0.001) == path


def test_the_storage_reads_under_a_file_are_counted(table: Path) -> None:
    """``disk_reads`` counts the whole disks under a file (a partition is not counted twice)
    and rises when the file is read cold; ``disk_read_rate`` turns two readings into rates."""
    from vllm_probes import disk_read_rate, disk_reads

    before = disk_reads([table])
    if before is None or not before["disks"]:
        pytest.skip("no /proc/diskstats or no block device here")
    assert all(not d.startswith(("loop", "ram", "zram")) for d in before["disks"])
    assert all(Path("/sys/block", d).exists() for d in before["disks"])
    evict([table])
    if residency.resident_bytes(table):
        pytest.skip("the file's pages cannot be dropped here (tmpfs?): no read reaches a disk")
    before = disk_reads([table])
    assert before is not None
    fd = os.open(table, os.O_RDONLY)
    try:
        os.pread(fd, table.stat().st_size, 0)
    finally:
        os.close(fd)
    after = disk_reads([table])
    assert after is not None and after["ios"] > before["ios"]
    assert after["bytes"] - before["bytes"] >= table.stat().st_size // 2
    rate = disk_read_rate({"disks": ["x"], "ios": 10, "bytes": 0},
                          {"disks": ["x"], "ios": 30, "bytes": 40 << 20}, 2.0)  # fmt: skip
    assert rate == {"disk_read_mib_s": 20.0, "disk_read_iops": 10.0, "disk_read_kib": 2048.0,
                    "disk_read_mib": 40.0, "disks": ["x"]}  # fmt: skip
    assert disk_read_rate(None, after, 1.0) == {}


def test_the_evicted_table_benchmark_gathers_under_a_hold(tmp_path: Path) -> None:
    """``bench_evicted.py``: a table read whole, then held at 0% by ``residency.py`` from
    outside, gathers rows (reading them cold, as the copy found its pages gone), beside
    one opened afresh; each case and size reported."""
    import json

    out = tmp_path / "evicted.json"
    cmd = [sys.executable, str(Path(residency.__file__).with_name("bench_evicted.py")),
           "--dir", str(tmp_path / "t"), "--gib", "0.03", "--shares", "1.0,0.0",
           "--rows", "256", "--trials", "3", "--json", str(out)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    if "may not page out" in r.stderr:
        pytest.skip("the holder may not page out this process's mapping here")
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    cases = {(x["share"], x["table"]): x for x in doc["results"]}
    assert set(cases) == {(s, t) for s in (1.0, 0.0)
                          for t in ("known, then dropped", "opened afresh")}  # fmt: skip
    assert cases[(1.0, "known, then dropped")]["rows_cold"] == 0  # all known, all cached
    assert cases[(0.0, "opened afresh")]["rows_cold"] >= 256  # nothing known at first
    if cases[(0.0, "known, then dropped")]["resident_at_start"] > 0.02:
        pytest.skip("the hold did not drop the table's pages here")
    # Known but dropped: the copy stopped and the rows were read cold.
    dropped = cases[(0.0, "known, then dropped")]
    assert dropped["slow_copies"] >= 1 and dropped["rows_cold"] > 0, dropped


def test_the_disk_offload_report_reads_the_storage_floor_beside_the_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--floor`` takes bench_cold.py host's output, as text or inside a run's logs .tgz,
    and gives each load's reads/s as a share of the floor's QD64 IOPS; a file without a
    floor line is refused."""
    import json
    import tarfile

    import disk_offload_report as rep

    line = "probe (io_uring, O_DIRECT): 1 read 30.0 us; sustained QD16 1800 IOPS, QD64 4800 IOPS\n"
    text = tmp_path / "storage_floor.txt"
    text.write_text("wrote the table\n" + line)
    logs = tmp_path / "logs.tgz"
    with tarfile.open(logs, "w:gz") as tar:
        tar.add(text, arcname="out/storage_floor.txt")
    assert rep.read_floor(text) == rep.read_floor(logs) == {16: 1800.0, 64: 4800.0}
    empty = tmp_path / "empty.tgz"
    with tarfile.open(empty, "w:gz") as tar:
        tar.add(tmp_path / "storage_floor.txt", arcname="other.txt")
    (tmp_path / "bench.log").write_text("no floor here\n")
    for bad in (empty, tmp_path / "bench.log"):
        with pytest.raises(ValueError, match=r"storage_floor\.txt|QD64 \.\. IOPS"):
            rep.read_floor(bad)

    doc = _doc(0.1, ["disk", "mmap"], {("disk", "c64"): 300.0, ("mmap", "c64"): 800.0})
    io = rep.residency_io_table([doc], rep.read_floor(text))
    assert "| KiB a read | of the QD64 floor |" in io
    assert "| mmap | c64 | 10% | 800 | 1.25 | 700 | 150.0 | 2,400 | 64 | 50% |" in io
    assert "of the QD64 floor" not in rep.residency_io_table([doc])
    path = tmp_path / "r.json"
    path.write_text(json.dumps(doc))
    assert rep.main([str(path), "--floor", str(logs)]) == 0
    out = capsys.readouterr().out
    assert "The storage floor: QD16 1,800 IOPS, QD64 4,800 IOPS" in out and "| 50% |" in out
    assert rep.main([str(path), "--floor", str(empty)]) == 2
    assert "no storage_floor.txt" in capsys.readouterr().err
