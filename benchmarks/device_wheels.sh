#!/usr/bin/env bash
# Fetch into .whl/ the wheels a bare GPU image (torch, triton, numpy, pandas, pyarrow, pillow, PyYAML, requests, jinja2
# present; no Hugging Face stack) needs to run the benchmarks, at the versions of this checkout's venv, for CPython 3.12
# on x86-64. Run here (with the venv built by `make setup`), then carry .whl/ and `source benchmarks/device_env.sh`
# there. Packages published only as source (deepspeed, docopt) are built into wheels locally.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
mkdir -p .whl
PACKAGES="transformers trl accelerate peft datasets tokenizers huggingface_hub safetensors dill multiprocess xxhash fsspec
  pydantic pydantic_core annotated-types typing-inspection hjson msgpack py-cpuinfo regex httpx httpx2 httpcore2 anyio
  h11 idna sniffio truststore typer shellingham rich click tenacity cachetools num2words"
platforms=()
for p in manylinux_2_17_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64 manylinux_2_31_x86_64 \
  manylinux_2_34_x86_64 manylinux_2_35_x86_64 manylinux2014_x86_64 manylinux1_x86_64 any; do
  platforms+=(--platform "$p")
done
for name in $PACKAGES; do
  version=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    -d .whl "$name==$version"
done
for name in deepspeed docopt; do
  version=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
  DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl "$name==$version"
done
ls .whl | wc -l
