#!/usr/bin/env bash
# The GPU checks in ONE device call, most important first, within a time budget.
#
# A lent machine gives a session 15 minutes of device time in all, its start (a minute or two)
# included, and one command at most 10. So this runs as one command and spends its budget in the
# order issue 20 needs the answers: the throughput bench (ours/HF and MFU, 1b preset, bf16 +
# compile + selective AC), then the bf16 GPU checks (compile + AC on the GPU, the async save
# through pinned host memory, the bf16 checkpoint resumed on CPU ranks with its float32 master
# state), then the rest of tests/gpu. A part that would not finish in what is left is skipped
# and says so; one that runs out of time is interrupted (pytest still prints what passed).
# Everything goes to $OUT: summary.txt, versions.txt and one log per part.
#
# Here first: bash tests/gpu/bundle.sh   (Ray and the rest the image lacks, .gpu-bundle/)
# Then the device tool's run, with carry [".gpu-bundle"] and timeout_s 600:
#   bash tests/gpu/device_check.sh          (budget 540 s; `... 300` for a shorter second call,
#                                            `PARTS="rest" bash ...` for chosen parts;
#                                            `PARTS="lora"`: bench/lora.py, named only;
#                                            `PARTS="api snapshot"`: issues 38 and 41, named only)
set -uo pipefail
cd "$(dirname "$0")/../.."
budget=${1:-540}
deadline=$((SECONDS + budget))
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
parts=${PARTS:-"bench bf16 rest"}

site=/tmp/rayshard-site
if [ ! -d "$site/ray" ]; then
  mkdir -p "$site" && tar -C "$site" -xJf .gpu-bundle/site.tar.xz \
    || { echo "no .gpu-bundle/site.tar.xz: run tests/gpu/bundle.sh here and carry .gpu-bundle" | tee "$out/summary.txt"; exit 2; }
fi
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 RAY_AUTH_MODE=token RAY_USAGE_STATS_ENABLED=0
{
  python3 -c "import sys, torch, transformers, ray; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0), 'transformers', transformers.__version__, 'ray', ray.__version__)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nproc
} > "$out/versions.txt" 2>&1
cat "$out/versions.txt"

# part NAME NEEDED CAP COMMAND...: runs COMMAND if about NEEDED seconds are left, for at most CAP
# seconds and never past the deadline, so a part that hangs cannot take the later parts' time;
# its output goes to $out/NAME.log and its last lines to the console. A part stopped by its time
# may leave Ray and its ranks behind: they are stopped before the next part.
part() {
  local name=$1 need=$2 cap=$3 left
  shift 3
  case " $parts " in *" $name "*) ;; *) return 0 ;; esac
  left=$((deadline - SECONDS))
  if ((left < need)); then
    echo "$name: skipped, $left s left of the budget, it needs about $need" | tee -a "$out/summary.txt"
    return 0
  fi
  ((left < cap)) || left=$cap
  local start=$SECONDS
  timeout -s INT -k 20 "$left" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "$name: rc $rc in $((SECONDS - start)) s ($*)" | tee -a "$out/summary.txt"
  tail -n 15 "$out/$name.log"
  if ((rc == 124 || rc == 137)); then
    python3 -m ray.scripts.scripts stop --force > /dev/null 2>&1 || true
  fi
}

# Issue 38's GPU part: rayshard.checkpoint against torch DCP from CUDA tensors (named: PARTS="api").
part api 60 150 python3 bench/api_device.py --device cuda --gib 4 --repeats 3
# Issue 41's GPU part: the snapshot's blocked time from CUDA tensors (named: PARTS="snapshot").
part snapshot 60 150 python3 bench/snapshot_device.py --model small --steps 20 --global-batch 8 --seq-len 512
part bench 150 300 python3 bench/throughput.py --device cuda --precision bf16 --compile --ac selective --steps 4
part bf16 150 300 python3 -m pytest tests/gpu -q -rA --durations=0 -k bf16
part rest 150 600 python3 -m pytest tests/gpu -q -rA --durations=0 -k "not bf16"
# Only when named (PARTS="lora"): issue 39's LoRA bench, 1b preset, bf16, one GPU.
part lora 150 300 python3 bench/lora.py --device cuda --precision bf16 --steps 4 --repeat 1
echo "budget: $((deadline - SECONDS)) s of $budget left" | tee -a "$out/summary.txt"
