#!/usr/bin/env bash
# Issue 6's GPU measurements in one go, for a GPU lent for a few minutes: the CUDA tests, training
# speed and MFU against Hugging Face (transformer_big and _base, bf16), decoding speed against
# Hugging Face (batch 32 and 256), each also with cuDNN attention on, a Multi30k run timed to its
# BLEU, and torch.compile.
#
#   scripts/bench_gpu.sh OUT_DIR [SECONDS]
#
# Steps run in order of value, each under its own time limit and never past SECONDS (default 540)
# from the start, so a short lease still brings back the first ones. Every step's output goes to
# OUT_DIR/log.txt; the JSON reports, the run's metrics and logs to OUT_DIR/results.tgz, rebuilt
# after every step. mt runs from this checkout, uninstalled. The variables below shrink it for a
# dry run on a CPU (DEVICE=cpu BIG=transformer_tiny BASE=transformer_tiny TOKENS=512 STEPS=2
# M30K_MINUTES=0.2 SENTENCES=8 scripts/bench_gpu.sh /tmp/out 300); ONLY="m30k train_base" runs
# those steps alone.
set -u
out=${1:?usage: scripts/bench_gpu.sh OUT_DIR [SECONDS]}
budget=${2:-540}
device=${DEVICE:-cuda}
big=${BIG:-transformer_big}
base=${BASE:-transformer_base}
tokens=${TOKENS:-25000}
steps=${STEPS:-20}
m30k_minutes=${M30K_MINUTES:-3}
sentences=${SENTENCES:-256}
data=${M30K_DIR:-.data/multi30k}

repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo" || exit 1
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
work=$(mktemp -d)
mkdir -p "$out"
log="$out/log.txt"
start=$SECONDS

step() {  # step NAME LIMIT COMMAND...: COMMAND under min(LIMIT, time left), output to the log
    local name=$1 limit=$2 left=$((budget - (SECONDS - start))) began=$SECONDS rc
    shift 2
    [[ -z $only || " $only " == *" $name "* ]] || return 0
    ((left < limit)) && limit=$left
    if ((limit < 20)); then
        echo "== $name: left out, $left s of the budget left" | tee -a "$log"
        return
    fi
    echo "== $name (limit $limit s, at $((SECONDS - start)) s): $*" >>"$log"
    timeout -k 5 "$limit" "$@" >>"$log" 2>&1
    rc=$?
    echo "== $name: rc $rc in $((SECONDS - began)) s" | tee -a "$log"
    tar czf "$out/results.tgz" -C "$work" . 2>/dev/null
}

summary() {  # the lines worth reading in the reply, from the log
    grep -E "^(hf|mt|ct2)[-_].*(tok/s|tokens/s)|^target |MFU|passed|failed|BLEU|bleu|Error|translated [0-9]|profiled|^host:" \
        "$log" | grep -v "^== " | tail -n 60
}

only=${ONLY:-}  # a space-separated subset of the step names, for a dry run
step env 30 bash -c 'nvidia-smi -L; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit,temperature.gpu --format=csv; python3 -c "
import torch, transformers, pyarrow, fsspec, datasets, hydra
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name())
print(\"transformers\", transformers.__version__, \"datasets\", datasets.__version__, \"pyarrow\", pyarrow.__version__, \"fsspec\", fsspec.__version__)
import time
def per(fn, n):
    start = time.perf_counter(); fn(n); return (time.perf_counter() - start) / n * 1e6
def loop(n):
    s = 0
    for i in range(n): s += i
print(f\"host: {per(loop, 10**7):.3f} us per Python loop iteration\")
if torch.cuda.is_available():
    x = torch.zeros(1, device=\"cuda\")
    def launches(n):
        for _ in range(n): x.add_(1)
        torch.cuda.synchronize()
    launches(1000)
    print(f\"host: {per(launches, 20000):.1f} us per tiny CUDA kernel, launched in a loop\")"'
if [ "$device" = cuda ]; then
    step tests 90 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py
fi
step train_big 120 python3 scripts/bench_train.py --model "$big" --device "$device" \
    --max-tokens "$tokens" --steps "$steps" --warmup 3 --systems hf_bf16,mt_bf16 --profile 12 \
    --out "$work/train_big.json"
# mt turns PyTorch's cuDNN attention off on a GPU (mt.model.avoid_cudnn_attention): the same
# benchmark with it on, for both systems, shows what that is worth
step train_big_sdpa_cudnn 90 python3 scripts/bench_train.py --model "$big" --device "$device" \
    --max-tokens "$tokens" --steps "$steps" --warmup 3 --systems hf_bf16,mt_bf16 --sdpa-cudnn \
    --out "$work/train_big_sdpa_cudnn.json"
step decode_b32 100 python3 scripts/bench_decode.py --device "$device" --batch 32 --repeat 3 \
    --sentences "$sentences" \
    --out "$work/decode_b32.json"
step decode_b32_sdpa_cudnn 90 python3 scripts/bench_decode.py --device "$device" --batch 32 \
    --repeat 3 --sentences "$sentences" --systems mt-bfloat16,hf-bfloat16 --sdpa-cudnn \
    --out "$work/decode_b32_sdpa_cudnn.json"
step m30k "$(awk "BEGIN { print int($m30k_minutes * 60 + 120) }")" python3 -m mt.train experiment=multi30k_en_de_cpu \
    data.dir="$data" trainer.device="$device" trainer.max_minutes="$m30k_minutes" \
    hydra.run.dir="$work/m30k"
for dtype in float32 bfloat16; do
    step "translate_$dtype" 60 bash -c "time python3 -m mt.translate -m $work/m30k --beam 5 \
        --device $device --dtype $dtype -i $data/test2016.en -o $work/m30k/test2016.$dtype.hyp \
        && python3 -m mt.evaluate --hyp $work/m30k/test2016.$dtype.hyp --ref $data/test2016.de"
done
rm -rf "$work/m30k/checkpoints"  # large; the metrics, logs and test.json come back
step train_base 90 python3 scripts/bench_train.py --model "$base" --device "$device" \
    --max-tokens "$tokens" --steps "$steps" --warmup 3 --systems hf_bf16,mt_bf16 \
    --out "$work/train_base.json"
step train_big_compile 180 python3 scripts/bench_train.py --model "$big" --device "$device" \
    --max-tokens "$tokens" --steps "$steps" --warmup 5 --systems mt_bf16,mt_bf16_compile \
    --out "$work/train_big_compile.json"
step decode_b256 600 python3 scripts/bench_decode.py --device "$device" --batch 256 \
    --sentences $((sentences * 4)) --repeat 2 --systems mt-float32,mt-bfloat16,hf-float32,hf-bfloat16 \
    --out "$work/decode_b256.json"
summary
