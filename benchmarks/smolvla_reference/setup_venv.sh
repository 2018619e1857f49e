#!/usr/bin/env bash
# Creates the side venv that runs LeRobot v0.4.4's SmolVLA code (reference.py).
# Idempotent: an existing venv whose stamp matches the pins below is kept.
# Usage: bash benchmarks/smolvla_reference/setup_venv.sh [PYTHON]   (default python3.11)
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="$ROOT/.cache/smolvla-ref-venv"
PYTHON="${1:-python3.11}"

# The pins, in one place. lerobot goes in with --no-deps (its own pins want torch<2.11,
# and its full dependency list drags in robot/sim/video stacks); everything below is what
# importing lerobot.policies.smolvla.modeling_smolvla actually needs, resolved together.
# torchvision is deliberately absent: the only wheels reachable for torch 2.13 are CUDA builds
# that fail to load on the CPU torch; reference.py serves a stand-in (see README).
LEROBOT="lerobot==0.4.4"
PINS=(
  "torch==2.13.0"            # the CPU wheel kilovla uses; v0.4.4 code runs on it
  "transformers==4.57.6"     # v0.4.4 pins >=4.57.1,<5
  "huggingface-hub==0.35.3"  # v0.4.4 pins <0.36; transformers 4.57 needs <1.0
  "tokenizers==0.22.2"
  "safetensors==0.8.0"
  "numpy==2.4.6"
  "draccus==0.10.0"          # lerobot.configs
  "datasets==4.8.5"          # lerobot.optim -> lerobot.datasets.utils
  "accelerate==1.16.0"       # lerobot.utils.utils, smolvla extra
  "num2words==0.5.14"        # smolvla extra
  "pillow==13.0.0"           # lerobot.datasets.utils
  "imageio==2.38.2"          # lerobot.utils.io_utils
  "einops==0.8.2"            # lerobot.processor.observation_processor
  "pyserial==3.5"            # lerobot.configs.train -> envs -> robots -> motors
  "deepdiff==8.6.2"          # lerobot.processor; v0.4.4 pins <9
  "av==15.1.0"               # lerobot.datasets.video_utils; v0.4.4 pins <16
  "packaging==25.0"          # v0.4.4 pins <26
)
STAMP="$VENV/.pins"
WANT="$(printf '%s\n' "$LEROBOT" "${PINS[@]}")"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
  echo "smolvla-ref venv up to date: $VENV"
else
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check "${PINS[@]}"
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps "$LEROBOT"
  printf '%s\n' "$WANT" > "$STAMP"
  echo "smolvla-ref venv created: $VENV"
fi
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
for name in ("lerobot", "torch", "transformers", "huggingface-hub", "tokenizers",
             "safetensors", "numpy", "draccus", "datasets", "accelerate", "num2words"):
    print(f"  {name}=={md.version(name)}")
EOF
