#!/usr/bin/env bash
# Reproduces a Multi30k figure of docs/benchmarks.md, printing every step: the tokenizer, training,
# checkpoint averaging (both inside mt-train), then mt-eval of best.pt and averaged.pt on the valid
# split (where choices are made) and on test2016 (what is reported). With SEEDS="1 2 3" it trains
# one run per seed (RUN/seed1, RUN/seed2, ...) and also scores the ensemble of their averaged.pt.
#
#   scripts/reproduce_multi30k.sh                                   # en-de on a CPU, 60 minutes
#   SEEDS="1 2" scripts/reproduce_multi30k.sh                       # two runs and their ensemble
#   scripts/reproduce_multi30k.sh multi30k_en_fr_cpu runs/m30k_fr
#   scripts/reproduce_multi30k.sh multi30k_en_de runs/m30k_gpu trainer.device=cuda
#
# Arguments: experiment (conf/experiment/), run directory, then any mt-train overrides. Run from
# the repository root with mt installed (README.md); an existing run directory resumes.
set -euo pipefail
if [[ ${1:-} == -h || ${1:-} == --help ]]; then  # the comment above is the usage
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
  exit 0
fi
experiment=${1:-multi30k_en_de_cpu}
run=${2:-runs/$experiment}
shift $(( $# < 2 ? $# : 2 ))
read -r -a seeds <<< "${SEEDS:-1}"

say() { printf '\n+ %s\n' "$*" >&2; }

runs=()
shared=()  # later seeds take the first run's tokenizer: an ensemble needs one vocabulary
for seed in "${seeds[@]}"; do
  dir=$run
  (( ${#seeds[@]} > 1 )) && dir=$run/seed$seed
  say mt-train "experiment=$experiment" "hydra.run.dir=$dir" "trainer.seed=$seed" "${shared[@]}" "$@"
  start=$(date +%s)
  mt-train "experiment=$experiment" "hydra.run.dir=$dir" "trainer.seed=$seed" "${shared[@]}" "$@"
  echo "training, averaging and the test decode took $(( ($(date +%s) - start) / 60 )) minutes" >&2
  runs+=("$dir")
  shared=("data.tokenizer.path=${runs[0]}/tokenizer")
done

say "tokenizer: ${runs[0]}/tokenizer"
cat "${runs[0]}/tokenizer/tokenizer.json"

# The language pair, the search and the device of the run, from its composed config.
read -r pair beam_size lenpen device <<< "$(python -c "
import sys, torch, yaml
cfg = yaml.safe_load(open(sys.argv[1]))
d, t = cfg['data'], cfg['trainer']
dev = str(t['device'])  # cuda:1 evaluates on cuda:1 (it read as the CPU)
dev = dev if dev.startswith('cuda') else 'cuda' if dev == 'auto' and torch.cuda.is_available() else 'cpu'
print(d['src_lang'] + '-' + d['tgt_lang'], t['beam_size'], t['lenpen'], dev)" "${runs[0]}/.hydra/config.yaml")"

systems=()
for dir in "${runs[@]}"; do
  for ckpt in best averaged; do
    [[ -f "$dir/checkpoints/$ckpt.pt" ]] && systems+=("$dir/checkpoints/$ckpt.pt")
  done
done
if (( ${#runs[@]} > 1 )); then  # the ensemble of every run's averaged.pt (or best.pt)
  members=()
  for dir in "${runs[@]}"; do
    ckpt=$dir/checkpoints/averaged.pt
    [[ -f "$ckpt" ]] || ckpt=$dir/checkpoints/best.pt
    members+=("$ckpt")
  done
  systems+=("$(IFS=,; echo "${members[*]}")")
fi

for split in multi30k_valid multi30k_test2016; do
  for system in "${systems[@]}"; do
    say mt-eval -m "$system" --test "$split" --langpair "$pair" \
      --beam "$beam_size" --lenpen "$lenpen" --device "$device" --quiet
    mt-eval -m "$system" --test "$split" --langpair "$pair" \
      --beam "$beam_size" --lenpen "$lenpen" --device "$device" --quiet
  done
done
