#!/usr/bin/env bash
# Run HERE, before a lent GPU machine's first call: what the GPU image lacks, as one archive
# (.gpu-bundle/site.tar.xz, ignored by git) that the call carries (`carry: [".gpu-bundle"]`) and
# tests/gpu/device_check.sh unpacks onto PYTHONPATH.
#
# The image (tests/gpu/README.md) is Python 3.12 with torch, transformers, pyarrow, safetensors,
# tokenizers and tensorboard, but no ray, crc32c, isal or jsonschema (Ray's one missing dependency).
# Ray's wheel alone (79 MB) is over the device tool's 64 MiB for the whole carried tree, so the
# parts a training rank never imports are left out (Java jars, RLlib, Serve, LLM, the dashboard's
# web client) and the rest is xz-compressed: about 29 MB. Checked with Python 3.12 and core Ray's
# other declared dependencies installed as the image has them (click, filelock, msgpack,
# packaging, protobuf, pyyaml, requests, attrs): ray.init, an actor and a placement group work.
# peft (with accelerate and psutil, which it imports) is bench/lora.py's anchor: transformers + peft.
set -euo pipefail
cd "$(dirname "$0")/../.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$tag")
done
# --target with another Python's tags: pip unpacks the wheels as that Python would install them
# (executable bits of Ray's gcs_server and raylet kept), without needing that Python here.
python3 -m pip install --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" --target "$work/site" \
  ray==2.60.0 crc32c isal jsonschema jsonschema-specifications referencing rpds-py peft accelerate psutil
rm -rf "$work/site/ray/jars" "$work/site/ray/rllib" "$work/site/ray/serve" "$work/site/ray/llm" \
  "$work/site/ray/dashboard/client/build" "$work/site/bin"
find "$work/site" -name __pycache__ -prune -exec rm -rf {} +
mkdir -p .gpu-bundle
XZ_OPT="-T0" tar -C "$work/site" -cJf .gpu-bundle/site.tar.xz .
ls -l .gpu-bundle/site.tar.xz
