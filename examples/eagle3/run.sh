#!/usr/bin/env bash
# The whole EAGLE-3 example: speculators venv, prompts, hidden states, training, benchmark.
# Run from anywhere after the main README's setup (`make setup`); every step can be tuned by
# environment variables (below). Re-running resumes the extraction and retrains the draft.
set -euo pipefail
cd "$(dirname "$0")/../.."

WORK=${WORK:-examples/eagle3/work}                    # prompts, hidden states, draft, results
SPEC_VENV=${SPEC_VENV:-examples/eagle3/.venv-speculators}
NUM_PROMPTS=${NUM_PROMPTS:-600}
MAX_TOKENS=${MAX_TOKENS:-128}                         # generated tokens kept per prompt
BATCH_SIZE=${BATCH_SIZE:-32}
MAX_MINUTES=${MAX_MINUTES:-15}                        # training time box
EPOCHS=${EPOCHS:-8}                              # the time box ends it first on 2 cores
TRAIN_ARGS=${TRAIN_ARGS:-}                            # more train.py flags
KVTIER=.venv/bin/kvtier

# (a) speculators in its own venv, with the CPU torch: torch pinned first and held by a
# constraint, because speculators' torchvision/torchaudio requirements would otherwise upgrade
# it to a CUDA build; the two are then removed (speculators never imports them, and a
# torchvision built for another torch breaks `import transformers`).
if [ ! -x "$SPEC_VENV/bin/python" ]; then
  python3 -m venv "$SPEC_VENV"
  "$SPEC_VENV/bin/pip" install -q torch==2.13.0
  echo "torch==2.13.0" > "$SPEC_VENV/torch-pin.txt"
  "$SPEC_VENV/bin/pip" install -q -c "$SPEC_VENV/torch-pin.txt" speculators==0.9.0
  "$SPEC_VENV/bin/pip" uninstall -q -y torchvision torchaudio
fi

TARGET=$(.venv/bin/python -c "from engine.demo.demo_model import ensure_demo_model; print(ensure_demo_model())")
mkdir -p "$WORK"

# (b) chat prompts from templates x topics.
.venv/bin/python examples/eagle3/make_prompts.py --out "$WORK/prompts.jsonl" -n "$NUM_PROMPTS"

# (c) hidden states: aux layers 2, 15, 27 (EAGLE-3's defaults for 30 layers) and 30, the last
# layer's output, whose logits are the targets; the greedy answers are part of the data.
time "$KVTIER" extract --input "$WORK/prompts.jsonl" --output "$WORK/hidden_states" \
  --layers 2,15,27,30 --max-tokens "$MAX_TOKENS" --batch-size "$BATCH_SIZE" --no-progress

# (d) train the draft.
# shellcheck disable=SC2086
time "$SPEC_VENV/bin/python" examples/eagle3/train.py --data "$WORK/hidden_states" --target "$TARGET" \
  --out "$WORK/draft" --verifier-name HuggingFaceTB/SmolLM2-135M-Instruct \
  --epochs "$EPOCHS" --max-minutes "$MAX_MINUTES" $TRAIN_ARGS

# (e) speculation off vs the draft on benchmarks/spec_decode.py's chat prompts.
SPEC="{\"method\": \"eagle3\", \"model\": \"$WORK/draft\", \"num_speculative_tokens\": 3, \"adaptive\": false}"
time .venv/bin/python benchmarks/spec_decode.py --workloads chat --runs 1 --spec "eagle3=$SPEC" \
  --out "$WORK/spec_decode.json"
echo "serve it: $KVTIER serve -sc '{\"method\": \"eagle3\", \"model\": \"$WORK/draft\", \"num_speculative_tokens\": 3}'"
