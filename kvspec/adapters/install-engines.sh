#!/usr/bin/env bash
# Install the real engines beside kvspec, on a CPU-only machine, into the active virtualenv.
#
#   python -m venv /tmp/engines && . /tmp/engines/bin/activate && pip install -e .
#   kvspec/adapters/install-engines.sh            # every engine; or any subset:
#   kvspec/adapters/install-engines.sh vllm sglang transformers lmcache mooncake lmdeploy
#
# torch first, pinned, from PyTorch's CPU index (https://download.pytorch.org/whl/cpu): on Linux, PyPI's
# torch is the CUDA build, several GB with its nvidia-* wheels.  On a GPU machine, name another index:
#   TORCH_INDEX_URL=https://pypi.org/simple kvspec/adapters/install-engines.sh   # PyPI's CUDA build
# (or the index of your CUDA version that pytorch.org's install selector gives).
# Then each engine with --no-deps and its pinned list requirements-<engine>.txt of pure-Python packages
# (the engines' own requirements name GPU-only packages that have no CPU build, and cap numpy, torch,
# triton and prometheus_client below what the others need; the pins, shared packages at one version in
# every list, are what all six import and run together with).  So `pip check` afterwards lists the
# requirements left out on purpose (see README, "Real engines"): expected, not a broken install.  Mooncake
# also needs three Debian libraries: installed with apt-get when running as root and missing, else the
# apt line is printed for you.  Keep kvspec's core environment apart: torch and all six engines take
# about 4.2 GB (vLLM and SGLang alone 3.5 GB); a fresh venv takes about 4 minutes on 2 cores.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
all=(vllm sglang transformers lmcache mooncake lmdeploy)
if [ "$#" -eq 0 ]; then set -- "${all[@]}"; fi
for engine in "$@"; do
    if [ ! -f "$here/requirements-$engine.txt" ]; then
        echo "install-engines.sh: unknown engine '$engine' (known: ${all[*]})" >&2
        exit 2
    fi
done

for engine in "$@"; do
    if [ "$engine" = mooncake ]; then
        debs=(libibverbs1 librdmacm1 libnuma1)  # mooncake's store.so, engine.so and mooncake_master link them
        echo "mooncake needs Debian's: apt-get install -y ${debs[*]}"
        missing=()
        if command -v dpkg-query >/dev/null; then
            for deb in "${debs[@]}"; do
                dpkg-query -W -f='${Status}' "$deb" 2>/dev/null | grep -q "install ok installed" || missing+=("$deb")
            done
        fi
        if [ "${#missing[@]}" -gt 0 ]; then
            if [ "$(id -u)" -eq 0 ]; then
                apt-get update -qq
                DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
            else
                echo "install-engines.sh: missing ${missing[*]}: run the apt line above as root" >&2
            fi
        fi
    fi
done

python -m pip install --index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}" torch==2.13.0
for engine in "$@"; do
    python -m pip install --no-deps -r "$here/requirements-$engine.txt"
done

# What each engine's check imports: an adapter's factory (module:factory) where kvspec has one, else the
# engine's core module the probes drive.
python - "$@" <<'PY'
import importlib
import importlib.metadata
import sys

CHECKS = {
    "vllm": "kvspec.adapters.vllm:factory",
    "sglang": "kvspec.adapters.sglang:factory",
    "transformers": "transformers.generation.continuous_batching.cache",
    "lmcache": "lmcache.v1.storage_backend.local_cpu_backend",
    "mooncake": "mooncake.store",
    "lmdeploy": "lmdeploy.pytorch.paging.scheduler",
}
DISTRIBUTIONS = {"mooncake": "mooncake-transfer-engine-non-cuda"}
for engine in sys.argv[1:]:
    module, _, factory = CHECKS[engine].partition(":")
    imported = importlib.import_module(module)
    if factory:
        print(f"ok: {getattr(imported, factory)().name}")
    else:
        version = importlib.metadata.version(DISTRIBUTIONS.get(engine, engine))
        print(f"ok: {engine} {version} ({module})")
PY
