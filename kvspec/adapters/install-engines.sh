#!/usr/bin/env bash
# Install the real engines beside kvspec, on a CPU-only machine, into the active virtualenv.
#
#   python -m venv /tmp/engines && . /tmp/engines/bin/activate && pip install -e .
#   kvspec/adapters/install-engines.sh            # both engines; or: ... vllm  /  ... sglang
#
# torch first, pinned to the release whose CPU wheel the machine has (an unpinned torch pulls a CUDA
# build of several GB); then each engine with --no-deps and its pinned list of pure-Python packages
# (the engines' own requirements name GPU-only packages that have no CPU build).  Keep kvspec's core
# environment apart: the engines and torch take about 3.5 GB.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
if [ "$#" -eq 0 ]; then set -- vllm sglang; fi
pip install torch==2.13.0
for engine in "$@"; do
    pip install --no-deps -r "$here/requirements-$engine.txt"
done
python - "$@" <<'PY'
import sys
for engine in sys.argv[1:]:
    module = {"vllm": "kvspec.adapters.vllm", "sglang": "kvspec.adapters.sglang"}[engine]
    implementation = __import__(module, fromlist=["factory"]).factory()
    print(f"ok: {implementation.name}")
PY
