#!/usr/bin/env bash
# README command 1: install, then the default SFT job with Ulysses SP=2 on 2 CPU processes, a single-process
# run of the same steps without SP, and the comparison of both loss curves (line + PNG in the output folder).
# Offline: tiny random-init Llama, GPT-2 tokenizer and public-domain texts shipped in the package.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

OUT="${OUT:-outputs/main_job}"
RECIPE=recipes/tiny_llama_4k_sp2.yaml
rm -rf "$OUT"
mkdir -p "$OUT"

echo "== installing hf_longctx and its trl/plot extras (pip output: $OUT/install.log) =="
start=$SECONDS
if ! bash scripts/install.sh "${HF_LONGCTX_EXTRAS:-trl,plot}" > "$OUT/install.log" 2>&1; then
    tail -n 30 "$OUT/install.log"
    echo "main_job: install failed; full log in $OUT/install.log" >&2
    exit 1
fi
install_s=$((SECONDS - start))
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

echo "== reference: the same recipe without SP, 1 process =="
start=$SECONDS
python recipes/sft.py --config "$RECIPE" --sp_size 1 --output_dir "$OUT/sp1" --save_strategy no
sp1_s=$((SECONDS - start))

echo "== hf_longctx: Ulysses SP=2 over 2 processes (gloo) =="
start=$SECONDS
accelerate launch --config_file configs/cpu_sp2.yaml recipes/sft.py --config "$RECIPE" \
    --output_dir "$OUT/sp2" --compare_to "$OUT/sp1"
sp2_s=$((SECONDS - start))

echo "== summary =="
echo "install ${install_s} s; no SP (1 process) ${sp1_s} s; SP=2 (2 processes) ${sp2_s} s"
echo "outputs: $OUT/sp2 (model, checkpoint-10, trainer_state.json), reference run in $OUT/sp1"
echo "plot: $OUT/sp2/loss_curves.png"
