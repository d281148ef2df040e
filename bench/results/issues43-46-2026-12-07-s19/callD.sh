#!/usr/bin/env bash
# Session #19 call D (H200, warm after B/C): where verify(4)'s time goes on qwen3-4b (1.51x) against
# qwen3-8b (1.12x): `bench profile` decode_b1, decode_b1_graph and verify_b1 (k = 4) of
# qwen3-4b-v5-default and qwen3-8b-v5; then qwen3-4b against qwen3-4b-lora8r16 (one adapter) at
# decode_b1_graph, where call A's batch-1 TPOT was +16 %.
source tests/gpu/run.sh --preamble "$1"
A=.cache/artifacts; C=.cache/gpu/configs
pr() {
  say "profile $1 ($2)"
  timeout 150 python3 -m infc.cli bench profile --artifact $A/$1 --model-path $C/$2 --load-format dummy --no-bandwidth \
    --out /tmp/pr-$1 "${@:3}" 2>&1 | grep -vE "it/s\]" | tail -60 | tee -a $OUT/log.txt
}
pr qwen3-4b-v5-default qwen3-4b --steps decode_b1,decode_b1_graph,verify_b1 --verify-drafts 4 --top 14
pr qwen3-8b-v5 qwen3-8b --steps decode_b1,decode_b1_graph,verify_b1 --verify-drafts 4 --top 8
ls $A
[ -d $A/qwen3-4b-lora8r16 ] && pr qwen3-4b-lora8r16 qwen3-4b --steps decode_b1,decode_b1_graph --loras 1 --top 20
[ -d $A/qwen3-4b ] && pr qwen3-4b qwen3-4b --steps decode_b1,decode_b1_graph --top 14
(cd /tmp && tar czf $OUT/profiles.tgz pr-* 2>/dev/null)
say done
