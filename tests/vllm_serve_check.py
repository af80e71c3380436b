"""``vllm serve`` with ``PLE_MEMOPS_TABLE_BACKEND=mmap`` on a GPU host, asked over HTTP on
localhost (``python3 tests/vllm_serve_check.py [qwen4exp|gemma4] [mmap|default] [sizes] [CONFIG]``;
``scripts/gpu/vllm_engine.sh`` and ``scripts/gpu/vllm_gemma4.sh`` run it). ``default``
serves the same checkpoint with the plugin off (stock vLLM with FULL decode graphs, as the
mmap engine has them), to tell the plugin's failures from vLLM's own on a host; the
engine's sizes are the in-process engine tests' (``tests/vllm_harness.py``), or with ``sizes``
``serve`` the ones ``vllm serve`` picks itself (the model's context length and, on a card of
70 GiB or more, 8,192 tokens a step). ``CONFIG``, a JSON object, overrides keys of the tiny
Qwen4Exp's config (``tests/vllm_harness.py``), e.g. ``'{"linear_key_head_dim": 64}'``.

Writes the tiny Qwen4Exp (or Gemma 4) checkpoint, starts the server (its engine core is a separate
process, which loads ple-memops's plugin by itself), waits for it to be healthy, sends
completions, and checks that they come back and that the engine core said it serves the
PLE tables from the checkpoint with deferred rows. The server is stopped in every case;
every wait is bounded. The bundle of ``scripts/vllm-h200`` leaves CuTe DSL out, so a
test-only plugin (``tests/vllm_harness.py``, written to a temporary folder on
``PYTHONPATH``) makes the model take its unfused path in every process, as the in-process
tests do by hand.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from vllm_harness import write_test_plugin  # noqa: E402

__all__ = ["write_test_plugin"]  # vllm_tp2_check.py imports it from here

GRAPHS = {"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2, 4, 8]}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, timeout: float = 5) -> int:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return int(r.status)


def main(
    model: str = "qwen4exp", backend: str = "mmap", sizes: str = "tests", config: str = "{}"
) -> int:
    import vllm_checkpoints as ckpts

    try:
        overrides = json.loads(config)
    except json.JSONDecodeError:
        overrides = None
    if not isinstance(overrides, dict) or (overrides and model != "qwen4exp"):
        print(f"CONFIG must be a JSON object, for qwen4exp only (got {config!r})")
        return 2

    work = Path(tempfile.mkdtemp(prefix="ple-serve-"))
    if model == "gemma4":
        ckpt = ckpts.write_gemma4_checkpoint(work / "ckpt")
        extra, skipped = "{}", "Skipped 1/2 safetensors shard(s)"
    elif model == "qwen4exp":
        ckpt = ckpts.write_checkpoint(
            work / "ckpt", fp8=False, **({"max_position_embeddings": 8192} | overrides)
        )
        extra, skipped = '{"gdn_prefill_backend": "triton"}', "Skipped 2/3 safetensors shard(s)"
    else:
        print(f"unknown model {model!r} (qwen4exp or gemma4)")
        return 2
    if backend not in ("mmap", "default"):
        print(f"unknown backend {backend!r} (mmap or default)")
        return 2
    if sizes not in ("tests", "serve"):
        print(f"unknown sizes {sizes!r} (tests or serve)")
        return 2
    plugin_dir = write_test_plugin(work / "plugins")
    port = _port()
    env = dict(os.environ, PLE_MEMOPS_TABLE_BACKEND=backend, VLLM_USE_FLASHINFER_SAMPLER="0")
    # FULL decode graphs in both (the plugin sets this for an mmap engine itself; vLLM would
    # turn breakable graphs on for a stock Qwen4Exp, a different engine to compare with).
    env["VLLM_USE_BREAKABLE_CUDAGRAPH"] = "0"
    env["PYTHONPATH"] = f"{plugin_dir}:{env.get('PYTHONPATH', '')}"
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(ckpt),
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny",
        "--skip-tokenizer-init", "--dtype", "bfloat16", "--max-num-seqs", "8",
        "--gpu-memory-utilization", "0.15",
        "--compilation-config", json.dumps(GRAPHS),
        "--additional-config", extra,
    ]  # fmt: skip
    if sizes == "tests":
        cmd += ["--max-model-len", "4096", "--max-num-batched-tokens", "1024"]
    log_path = work / "server.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    ok = False
    try:
        deadline = time.monotonic() + 300  # a fresh host compiles Triton kernels first
        while time.monotonic() < deadline:
            if server.poll() is not None:
                break
            try:
                if _get(f"http://127.0.0.1:{port}/health") == 200:
                    ok = True
                    break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(2)
        if not ok:
            print(log_path.read_text()[-12000:])
            print("FAIL: the server did not become healthy")
            return 1
        done = 0
        for n in (1, 3, 8):
            body = json.dumps(
                {
                    "model": "tiny",
                    "prompt": [[8 + (i * 13 + k) % 110 for k in range(6 + i)] for i in range(n)],
                    "max_tokens": 12,
                    "temperature": 0,
                    "ignore_eos": True,
                }
            ).encode()
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions",
                data=body,
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=60) as r:
                reply = json.loads(r.read())
            assert len(reply["choices"]) == n, reply
            assert reply["usage"]["completion_tokens"] == 12 * n, reply["usage"]
            done += n
        text = log_path.read_text()
        # vLLM's own loader says it skipped the files that hold only table rows: only the
        # plugin's model tells it that they hold nothing it loads.
        needle = f"{skipped} holding no weights the model loads"
        served = needle in text
        print(
            f"{model}: {done} requests served over HTTP on port {port} ({backend}, {sizes} sizes)"
        )
        if backend == "default":
            print("PASS: vllm serve with the plugin off serves")
            return 0
        print("engine core says:", [ln for ln in text.splitlines() if skipped in ln][:1])
        deferred = [ln for ln in text.splitlines() if "FULL CUDA graphs defer their rows" in ln]
        print("and:", deferred[:1])
        if not served:
            print("FAIL: the engine core read the table files (the plugin was not active there)")
            return 1
        if not deferred:
            print("FAIL: the engine core does not say its graphs defer their rows")
            return 1
        print("PASS: vllm serve with PLE_MEMOPS_TABLE_BACKEND=mmap serves")
        return 0
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))
