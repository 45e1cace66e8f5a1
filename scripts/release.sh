#!/usr/bin/env bash
# Run `quantize release` on a CI runner: settings come in as environment variables, the report goes out as
# artifacts, and the exit code is the release's own (0 released, 1 gate failed, 2 error).
#
#   SRC          source checkpoint: Hub repo id (org/name[@revision]) or a folder          (required)
#   RECIPE       recipe YAML                                                                (required)
#   REPO_ID      Hub repo to publish to, org/name                                           (required)
#   GATE         gate thresholds YAML                                  [eval/gate.yaml]
#   TASKS        comma-separated lm-eval tasks                         [gsm8k,mmlu,arc_challenge]
#   BACKEND      hf | vllm | sglang                                    [vllm]
#   EVAL_TP      tensor parallel size of the eval                      [8]
#   GPUS, GPU    target deployment for the card's capacity table      [8, h200]
#   TAG          tag for the release commit                            [none]
#   PRIVATE      1: create the repo private                            [0]
#   DRY_RUN      1: everything but the upload                          [0]
#   LIMIT        samples per task (smoke runs only)                    [all]
#   DATA_DIR     local copies of the eval data instead of the Hub datasets [the Hub]
#   WORK_DIR     conversion, card and report; keep it between runs to resume   [release-work/<org--name>]
#   ARTIFACTS    where the report is copied for the CI to keep         [artifacts]
#   HF_TOKEN     write token (never printed); HF_HOME keeps the Hub cache between runs
set -uo pipefail
: "${SRC:?set SRC}" "${RECIPE:?set RECIPE}" "${REPO_ID:?set REPO_ID}"
WORK_DIR="${WORK_DIR:-release-work/${REPO_ID//\//--}}"
ARTIFACTS="${ARTIFACTS:-artifacts}"
args=(release "$SRC" --recipe "$RECIPE" --repo-id "$REPO_ID" --work-dir "$WORK_DIR"
      --tasks "${TASKS:-gsm8k,mmlu,arc_challenge}" --backend "${BACKEND:-vllm}" --eval-tp "${EVAL_TP:-8}"
      --gpus "${GPUS:-8}" --gpu "${GPU:-h200}")
[[ -n "${GATE:-}" ]] && args+=(--gate "$GATE")
[[ -n "${TAG:-}" ]] && args+=(--revision-tag "$TAG")
[[ -n "${LIMIT:-}" ]] && args+=(--limit "$LIMIT")
[[ -n "${DATA_DIR:-}" ]] && args+=(--data-dir "$DATA_DIR")
[[ "${PRIVATE:-0}" == 1 ]] && args+=(--private)
[[ "${DRY_RUN:-0}" == 1 ]] && args+=(--dry-run)

read -ra quantize <<< "${QUANTIZE:-quantize}"   # e.g. ".venv/bin/quantize" or "python -m quantize"
"${quantize[@]}" "${args[@]}"
code=$?
mkdir -p "$ARTIFACTS"
for f in release-report.json release-report.md; do
  [[ -f "$WORK_DIR/$f" ]] && cp "$WORK_DIR/$f" "$ARTIFACTS/"
done
[[ -f "$WORK_DIR/card/README.md" ]] && cp "$WORK_DIR/card/README.md" "$ARTIFACTS/model-card.md"
case $code in
  0) echo "release: done (${DRY_RUN:+dry run }$REPO_ID)";;
  1) echo "release: the accuracy gate failed; nothing was uploaded (see $ARTIFACTS/release-report.md)";;
  *) echo "release: error (exit $code); rerun to resume from $WORK_DIR";;
esac
exit $code
