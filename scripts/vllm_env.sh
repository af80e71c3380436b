#!/usr/bin/env bash
# Installs a released vLLM into the environment of PYTHON, as a user would:
#   bash scripts/vllm_env.sh PYTHON VERSION
# 0.33.0 installs from PyPI as it is. 0.34.0 pins flashinfer-python==0.7.3, which PyPI does
# not have (0.7.2.post1 and 0.7.4 are there): its requirements are installed with 0.7.4 in
# that pin's place, then vLLM itself without dependencies. pip's own lines show progress.
set -euo pipefail
PY=$1
VERSION=$2
PIP=("$PY" -m pip install --progress-bar off --disable-pip-version-check)
progress() { grep --line-buffered -E "^(Collecting|Installing|Successfully)" || true; }
case "$VERSION" in
0.34.0)
    "${PIP[@]}" --no-deps "vllm==$VERSION" | progress
    reqs=$(mktemp)
    # vLLM's own requirements for this platform, as its metadata states them.
    "$PY" - "$reqs" <<'PYEOF'
import sys
from importlib.metadata import requires

from pip._vendor.packaging.requirements import Requirement

out = []
for text in requires("vllm") or []:
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    spec = str(req.specifier)
    if req.name == "flashinfer-python" and spec == "==0.7.3":
        spec = "==0.7.4"  # the pin is not on PyPI
    extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
    out.append(f"{req.name}{extras}{spec}")
open(sys.argv[1], "w").write("\n".join(out) + "\n")
PYEOF
    "${PIP[@]}" -r "$reqs" | progress
    rm -f "$reqs"
    ;;
*)
    "${PIP[@]}" "vllm==$VERSION" | progress
    ;;
esac
