"""The tables (and the plot) of ``scripts/gpu/disk_offload.sh``'s runs, from their
``bench_vllm.py --json`` results:

* the residency curve: each run made with ``--residency S`` gives, per backend and load,
  output tok/s and ITL p50 at that share of the table files in the page cache; the table
  has a row per backend and load, a column per share, and the PNG (``-o``) draws tok/s
  against the share, a panel per load;
* which GPU (and so which lent host) measured which shares, where they come from more
  than one (``meta["gpu_uuid"]``): shares then compare only within a host;
* the pairs at each share and load: ``mmap`` against ``disk`` (or the ``--pair``s asked
  for, e.g. ``mmap:mmap-unordered``; ITL p50 and tok/s, %) and
  each backend against its replica (``mmap.2``: the A/A pair, what the run resolves);
* where each step's time goes at each share: the engine's wait a step (``disk``: vLLM's
  staging call, its reads in it; ``mmap``: the wait for a step's results) and what the
  storage under the table files read during the load (MiB/s, reads/s, KiB a read);
* with ``--floor`` (the storage floor ``bench_cold.py host`` printed on the same host, as a
  text file or inside a run's logs ``.tgz``), each load's reads/s as a share of the floor's
  sustained QD64 random-read IOPS;
* several servers of one checkpoint: each run whose servers are one backend and its
  replicas (``mmap``, ``mmap.2``, ...), or one server of several data-parallel ranks,
  gives the host memory in use before the servers and with all of them healthy, and the
  page cache, per backend and server count.

    python3 benchmarks/disk_offload_report.py OUT/bench_vllm_disk_res*.json \\
        OUT/bench_vllm_servers_*.json -o benchmarks/vllm_residency.png
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tarfile
from pathlib import Path
from typing import Any

from vllm_servers import base_backend

__all__ = [
    "main",
    "read_floor",
    "residency_hosts",
    "residency_io_table",
    "residency_pairs_table",
    "residency_table",
    "servers_table",
]


def _load_key(load: str) -> tuple[int, str]:
    """Loads in their natural order: c1, c8, c64 (then mixed)."""
    return (len(load), load)


def _ok_runs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in doc.get("runs", []) if r.get("ok")]


def residency_points(
    docs: list[dict[str, Any]],
) -> dict[tuple[str, str], dict[float, dict[str, float]]]:
    """``(backend, load) -> share -> {"tok_s", "itl_p50_ms"}`` (medians over the repeats),
    with ``"failed"`` of ``"requests"`` (sums over them), of every run made with
    ``--residency``."""
    points: dict[tuple[str, str], dict[float, dict[str, float]]] = {}
    for doc in docs:
        share = doc.get("meta", {}).get("residency")
        if share is None:
            continue
        by: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for r in _ok_runs(doc):
            by.setdefault((r["backend"], r["load"]), []).append(r)
        for key, runs in by.items():
            points.setdefault(key, {})[float(share)] = {
                "tok_s": statistics.median(float(r["tok_s"]) for r in runs),
                "itl_p50_ms": statistics.median(float(r["itl_p50_ms"]) for r in runs),
                **_requests(runs),
            }
    return points


def _requests(runs: list[dict[str, Any]]) -> dict[str, float]:
    """``{"failed", "requests"}``: a load's requests that failed, of all, over its repeats."""
    failed = sum(int(r.get("failed") or 0) for r in runs)
    return {"failed": failed, "requests": failed + sum(int(r["ok"]) for r in runs)}


def _failed(counts: dict[str, float]) -> str:
    """What a load's figures leave out: requests that failed (timed out) are not in its
    tok/s and ITL, so a backend that could not finish its load reads better than it ran."""
    failed, requests = counts["failed"], counts["requests"]
    return f" ({failed:,.0f} of {requests:,.0f} requests failed)" if failed else ""


def residency_hosts(docs: list[dict[str, Any]]) -> str:
    """One line naming which GPU (and so which lent host, its disk and CPUs) measured which
    shares, where the residency runs come from more than one: their shares then compare
    only within a host. A run made before the bench recorded the card's UUID counts as
    "unknown"; "" when every run is from one card (or none says)."""
    by: dict[str, list[float]] = {}
    for doc in docs:
        meta = doc.get("meta", {})
        if meta.get("residency") is None:
            continue
        by.setdefault(meta.get("gpu_uuid") or "unknown", []).append(float(meta["residency"]))
    if len(by) < 2:
        return ""
    groups = sorted(by.items(), key=lambda kv: -max(kv[1]))
    where = "; ".join(
        ", ".join(f"{s:.0%}" for s in sorted(shares, reverse=True)) + f" on {uuid}"
        for uuid, shares in groups
    )
    return f"The shares come from {len(by)} GPUs (hosts), to compare within one only: {where}"


def residency_table(docs: list[dict[str, Any]]) -> str:
    points = residency_points(docs)
    if not points:
        return ""
    shares = sorted({s for per in points.values() for s in per}, reverse=True)
    lines = [
        "| backend | load | "
        + " | ".join(f"{s:.0%} resident: tok/s, ITL p50 ms" for s in shares)
        + " |",
        "|---|---|" + "---|" * len(shares),
    ]
    for (backend, load), per in sorted(points.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        cells = [
            f"{per[s]['tok_s']:,.0f}, {per[s]['itl_p50_ms']:.2f}" + _failed(per[s])
            if s in per
            else "-"
            for s in shares
        ]
        lines.append(f"| {backend} | {load} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _pct(a: float, b: float) -> str:
    return f"{(a / b - 1) * 100:+.1f}%"


def residency_pairs_table(
    docs: list[dict[str, Any]], pairs: list[tuple[str, str]] | None = None
) -> str:
    """A row per load and share: each of ``pairs`` (default ``mmap`` against ``disk``;
    ITL p50 and tok/s, %), and the A/A pair (every backend that has a replica, ``mmap.2``
    against ``mmap``): what the run resolves. A pair a run lacks is ``-``; a pair whose
    first backend no run has is left out."""
    points = residency_points(docs)
    keys = sorted({(load, share) for (_, load), per in points.items() for share in per},
                  key=lambda k: (_load_key(k[0]), -k[1]))  # fmt: skip
    replicas = sorted({b for b, _ in points if base_backend(b) != b})
    ran = {b for b, _ in points}
    pairs = [(a, b) for a, b in (pairs or [("mmap", "disk")]) if a in ran]
    if not keys or (not pairs and not replicas):
        return ""

    def pair(a: str, b: str, load: str, share: float) -> str:
        pa, pb = points.get((a, load), {}).get(share), points.get((b, load), {}).get(share)
        if pa is None or pb is None:
            return "-"
        itl = _pct(pa["itl_p50_ms"], pb["itl_p50_ms"])
        return f"{itl}, {_pct(pa['tok_s'], pb['tok_s'])}"

    head = "| load | resident |" + "".join(f" {a} vs {b}: ITL, tok/s |" for a, b in pairs)
    head += "".join(f" A/A {r} vs {base_backend(r)}: ITL, tok/s |" for r in replicas)
    lines = [head, "|---|---|" + "---|" * (len(pairs) + len(replicas))]
    for load, share in keys:
        cells = [pair(a, b, load, share) for a, b in pairs]
        cells += [pair(r, base_backend(r), load, share) for r in replicas]
        lines.append(f"| {load} | {share:.0%} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _median(runs: list[dict[str, Any]], get: Any) -> float | None:
    vals = [v for r in runs if (v := get(r)) is not None]
    return statistics.median(vals) if vals else None


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _gib(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} GiB"


_FLOOR = re.compile(r"sustained QD16 (\d+) IOPS, QD64 (\d+) IOPS")


def read_floor(path: Path) -> dict[int, float]:
    """The storage floor's sustained random-read IOPS by queue depth (``{16: .., 64: ..}``)
    from ``bench_cold.py host``'s output: a text file, or the ``storage_floor.txt`` inside a
    run's logs ``.tgz``. Raises ``ValueError`` when there is no floor line in it."""
    if path.name.endswith((".tgz", ".tar.gz")):
        with tarfile.open(path) as tar:
            floors = [m for m in tar.getmembers() if m.isfile()
                      and m.name.endswith("storage_floor.txt")]  # fmt: skip
            member = floors[0] if floors else None
            handle = tar.extractfile(member) if member is not None else None
            if handle is None:
                raise ValueError(f"{path}: no storage_floor.txt in it")
            text = handle.read().decode(errors="replace")
    else:
        text = path.read_text(errors="replace")
    m = _FLOOR.search(text)
    if m is None:
        raise ValueError(f"{path}: no 'sustained QD16 .. IOPS, QD64 .. IOPS' line")
    return {16: float(m.group(1)), 64: float(m.group(2))}


def residency_io_table(docs: list[dict[str, Any]], floor: dict[int, float] | None = None) -> str:
    """A row per backend, load and share: tok/s, ITL p50, the engine's wait a step (p50 us;
    ``disk``: its staging call / the reads in it; ``mmap``: its wait for a step's results)
    and the storage's reads during the load (medians over the repeats); with ``floor``
    (:func:`read_floor`), the reads/s as a share of its QD64 IOPS too."""
    by: dict[tuple[str, str, float], list[dict[str, Any]]] = {}
    for doc in docs:
        share = doc.get("meta", {}).get("residency")
        if share is None:
            continue
        for r in _ok_runs(doc):
            by.setdefault((r["backend"], r["load"], float(share)), []).append(r)
    if not by:
        return ""
    qd64 = floor.get(64) if floor else None
    lines = [
        "| backend | load | resident | tok/s | ITL p50 ms | engine's wait p50 us | "
        "storage MiB/s | reads/s | KiB a read |" + (" of the QD64 floor |" if qd64 else ""),
        "|---|---|---|---|---|---|---|---|---|" + ("---|" if qd64 else ""),
    ]
    order = sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0], -kv[0][2]))
    for (backend, load, share), runs in order:
        stage = _median(runs, lambda r: (r.get("disk") or {}).get("stage_p50_us"))
        reads = _median(runs, lambda r: (r.get("disk") or {}).get("reads_p50_us"))
        results = _median(runs, lambda r: (r.get("graphs") or {}).get("results_p50_us"))
        wait = (f"{stage:,.0f} (reads {_fmt(reads, ',.0f')})" if stage is not None
                else _fmt(results, ",.0f"))  # fmt: skip
        failed = _failed(_requests(runs))
        lines.append(
            f"| {backend} | {load} | {share:.0%} "
            f"| {_fmt(_median(runs, lambda r: r.get('tok_s')), ',.0f')}{failed} "
            f"| {_fmt(_median(runs, lambda r: r.get('itl_p50_ms')), '.2f')} | {wait} "
            f"| {_fmt(_median(runs, lambda r: r.get('disk_read_mib_s')), ',.1f')} "
            f"| {_fmt(_median(runs, lambda r: r.get('disk_read_iops')), ',.0f')} "
            f"| {_fmt(_median(runs, lambda r: r.get('disk_read_kib')), '.0f')} |"
        )
        if qd64:
            iops = _median(runs, lambda r: r.get("disk_read_iops"))
            lines[-1] += f" {'-' if iops is None else format(iops / qd64, '.0%')} |"
    return "\n".join(lines)


def servers_rows(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A row per run whose servers are one backend and its replicas."""
    rows = []
    for doc in docs:
        meta = doc.get("meta", {})
        before, after = meta.get("host_memory_before"), meta.get("host_memory_all_servers")
        names = list(doc.get("servers", {}))
        bases = {base_backend(n) for n in names}
        if not (before and after and names and len(bases) == 1):
            continue
        table = [s["page_cache_gib"] for s in doc["servers"].values() if s.get("page_cache_gib")]
        rows.append({
            "backend": bases.pop(), "servers": len(names),
            "ranks": int(meta.get("data_parallel_size") or 1),
            "used_gib": after["used"] - before["used"],
            "page_cache_gib": after["cached"] - before["cached"],
            "shmem_gib": after["shmem"] - before["shmem"],
            # the table files' resident pages: one set, whoever maps them
            "table_cache_gib": max(table) if table else None,
        })  # fmt: skip
    return sorted(rows, key=lambda r: (r["backend"], r["servers"], r["ranks"]))


def servers_table(docs: list[dict[str, Any]]) -> str:
    rows = servers_rows(docs)
    if not rows:
        return ""
    one = {r["backend"]: r for r in rows if r["servers"] == 1 and r["ranks"] == 1}
    lines = [
        "| backend | servers (data-parallel ranks each) | host memory in use, added | page "
        "cache, added | shared memory (pinned), added | memory added against one server | "
        "table files in the page cache | the tables' host memory, in copies |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        base = one.get(r["backend"])
        total = r["used_gib"] + r["page_cache_gib"]
        ratio = (
            f"{total / (base['used_gib'] + base['page_cache_gib']):.2f}x"
            if base and base["used_gib"] + base["page_cache_gib"] > 0
            else "-"
        )
        cache = r["table_cache_gib"]
        ranks = f" ({r['ranks']})" if r["ranks"] > 1 else ""
        # Warm runs: the files' resident pages are one whole copy of the tables; the host's
        # shared memory counts each pinned page once (UVA's tables, mmap's staging), where
        # the servers' RSS would count a page its data-parallel ranks share in each.
        copies = f"{(cache + max(r['shmem_gib'], 0.0)) / cache:.2f}" if cache else "-"
        lines.append(
            f"| {r['backend']} | {r['servers']}{ranks} | {r['used_gib']:+.2f} GiB | "
            f"{r['page_cache_gib']:+.2f} GiB | {r['shmem_gib']:+.2f} GiB | {ratio} | "
            f"{_gib(cache)} | {copies} |"
        )
    return "\n".join(lines)


def plot(docs: list[dict[str, Any]], out: Path, title: str) -> bool:
    """tok/s against the resident share, a line per backend, a panel per load."""
    points = residency_points(docs)
    if not points:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = sorted({load for _, load in points}, key=_load_key)
    bases = sorted({base_backend(b) for b, _ in points})
    color = {b: f"C{i}" for i, b in enumerate(bases)}  # a replica in its backend's colour
    fig, axes = plt.subplots(1, len(loads), figsize=(4.2 * len(loads), 3.6), squeeze=False)
    for ax, load in zip(axes[0], loads, strict=True):
        for (backend, ld), per in sorted(points.items()):
            if ld != load:
                continue
            xs = sorted(per)
            twin = base_backend(backend) != backend
            ax.plot([x * 100 for x in xs], [per[x]["tok_s"] for x in xs],
                    marker="x" if twin else "o", linestyle="--" if twin else "-",
                    color=color[base_backend(backend)],
                    label=f"{backend} (A/A)" if twin else backend)  # fmt: skip
        ax.set_title(load)
        ax.set_xlabel("table resident in the page cache (%)")
        ax.set_ylabel("output tok/s")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="The residency curve and the several-servers memory table of "
        "scripts/gpu/disk_offload.sh's runs (see the module).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("results", nargs="+", type=Path, help="bench_vllm.py --json outputs")
    p.add_argument("-o", "--png", type=Path, default=None, help="the residency plot")
    p.add_argument("--title", default="Qwen4Exp, tok/s against the table's resident share")
    p.add_argument("--floor", type=Path, default=None,
                   help="bench_cold.py host's output on the runs' host (a text file, or a "
                        "run's logs .tgz holding storage_floor.txt): reads/s against its "
                        "QD64 IOPS")  # fmt: skip
    p.add_argument("--pair", action="append", default=None, metavar="OURS:THEIRS",
                   help="a pair of backends to set side by side at each share and load "
                        "(repeatable; default mmap:disk), e.g. mmap:mmap-unordered")  # fmt: skip
    args = p.parse_args(argv)
    pairs = []
    for text in args.pair or ["mmap:disk"]:
        a, sep, b = text.partition(":")
        if not (a and sep and b):
            print(f"disk_offload_report: --pair {text!r}: OURS:THEIRS", file=sys.stderr)
            return 2
        pairs.append((a, b))
    floor = None
    if args.floor is not None:
        try:
            floor = read_floor(args.floor)
        except (OSError, ValueError, tarfile.TarError) as exc:
            print(f"disk_offload_report: --floor {exc}", file=sys.stderr)
            return 2
    docs = []
    for path in args.results:
        try:
            docs.append(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            print(f"disk_offload_report: {path}: {exc}", file=sys.stderr)
            return 2
    res, srv = residency_table(docs), servers_table(docs)
    if not res and not srv:
        print("disk_offload_report: no --residency run and no run of one backend's replicas")
        return 1
    if res:
        print("Residency\n\n" + res + "\n")
        if hosts := residency_hosts(docs):
            print(hosts + "\n")
        if table := residency_pairs_table(docs, pairs):
            print("Pairs (the A/A: what the run resolves)\n\n" + table + "\n")
        if floor:
            print(f"The storage floor: QD16 {floor[16]:,.0f} IOPS, QD64 {floor[64]:,.0f} IOPS\n")
        io = residency_io_table(docs, floor)
        print("Where a step waits, and what the storage read\n\n" + io + "\n")
    if srv:
        print("Several servers of one checkpoint\n\n" + srv + "\n")
    if args.png is not None and plot(docs, args.png, args.title):
        print(f"plot: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
