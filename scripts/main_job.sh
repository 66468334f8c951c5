#!/usr/bin/env bash
# README command 1: install, then the default SFT job with Ulysses SP=2 on 2 CPU processes, a single-process
# run of the same steps without SP, and the comparison of both loss curves (line + PNG in the output folder).
# Offline: tiny random-init Llama, GPT-2 tokenizer and public-domain texts shipped in the package.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/install.sh "${HF_LONGCTX_EXTRAS:-trl,plot}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

OUT="${OUT:-outputs/main_job}"
RECIPE=recipes/tiny_llama_4k_sp2.yaml
rm -rf "$OUT"

echo "== reference: the same recipe without SP, 1 process =="
python recipes/sft.py --config "$RECIPE" --sp_size 1 --output_dir "$OUT/sp1" --save_strategy no

echo "== hf_longctx: Ulysses SP=2 over 2 processes (gloo) =="
accelerate launch --config_file configs/cpu_sp2.yaml recipes/sft.py --config "$RECIPE" \
    --output_dir "$OUT/sp2" --compare_to "$OUT/sp1"
