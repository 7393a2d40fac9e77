#!/usr/bin/env bash
# Back-translation, plain and tagged (Caswell et al., 2019), simulated on Multi30k: the first half
# of the training pairs stays parallel (A), the second half's German is taken as monolingual text
# (B). A reverse model (de->en) trained on A back-translates B with beam search (in bfloat16 on a
# CPU with AVX512-BF16 or AMX, else in float32, where bfloat16 is emulated and slower); then three
# en->de runs of the same number of steps: A alone, A + back-translated B, and A + tagged
# back-translated B (data.tagged=[bt]). Each is scored on test2016 (best.pt and averaged.pt).
# docs/benchmarks.md ("Back-translation, plain and tagged") has the figures this printed.
#
#   scripts/simulate_back_translation.sh                    # runs/bt, 3,600 steps a model
#   STEPS=8000 scripts/simulate_back_translation.sh runs/bt8k
#
# Run from the repository root with mt installed (README.md). The same command resumes: the data
# split and the back-translation are kept, and each run resumes from its last.pt.
set -euo pipefail
if [[ ${1:-} == -h || ${1:-} == --help ]]; then  # the comment above is the usage
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
  exit 0
fi
out=${1:-runs/bt}
steps=${STEPS:-3600}
src=${DATA:-../shared/data/multi30k}
data=$out/data
mkdir -p "$data"

say() { printf '\n+ %s\n' "$*" >&2; }

half=$(( $(wc -l < "$src/train.en") / 2 ))
if [[ ! -s $data/mono.de ]]; then
  head -n "$half" "$src/train.en" > "$data/train.en"
  head -n "$half" "$src/train.de" > "$data/train.de"
  for f in valid.en valid.de test2016.en test2016.de; do cp "$src/$f" "$data/$f"; done
  # mono.de last: it marks the split as done, so an interrupted copy is made again on resume
  tail -n +"$((half + 1))" "$src/train.de" > "$data/mono.de.tmp" && mv "$data/mono.de.tmp" "$data/mono.de"
fi

common=(experiment=multi30k_en_de_cpu "data.dir=$data" trainer.max_minutes=0
        "trainer.max_steps=$steps")
train() {  # run directory, then overrides; a run that stopped resumes, a finished one only re-tests
  local dir=$1; shift
  say mt-train "${common[@]}" "$@" "hydra.run.dir=$dir"
  mt-train "${common[@]}" "$@" "hydra.run.dir=$dir"
}
model() {  # averaged.pt where mt-train wrote one (trainer.average_last), else best.pt
  if [[ -f $1/checkpoints/averaged.pt ]]; then echo "$1/checkpoints/averaged.pt"
  else echo "$1/checkpoints/best.pt"; fi
}

train "$out/reverse" data.src_lang=de data.tgt_lang=en
if [[ ! -s $data/bt.en || ! -s $data/bt.de ]]; then  # both: an interrupt may fall between
  dtype=$(python -c "from mt.optim import cpu_has_fast_bf16
print('bfloat16' if cpu_has_fast_bf16() else 'float32')")
  say translate -m "$(model "$out/reverse")" -i "$data/mono.de" -o "$data/bt.en" --beam 5 \
    --dtype "$dtype"
  translate -m "$(model "$out/reverse")" -i "$data/mono.de" -o "$data/bt.en" --beam 5 \
    --dtype "$dtype"
  cp "$data/mono.de" "$data/bt.de"
fi
say mt-eval "reverse de->en: $(model "$out/reverse")"
mt-eval -m "$(model "$out/reverse")" --src "$data/test2016.de" --ref "$data/test2016.en" -q

train "$out/base"
train "$out/bt" data.train=train+bt
train "$out/tagged" data.train=train+bt 'data.tagged=[bt]'
for name in base bt tagged; do
  say mt-eval "$name: best.pt, $(model "$out/$name")"
  mt-eval -m "$out/$name/checkpoints/best.pt" -m "$(model "$out/$name")" \
    --src "$data/test2016.en" --ref "$data/test2016.de" -q
done
