#!/usr/bin/env bash
# Creates the side venv that runs NVIDIA's GR00T N1.7 code (reference.py) and lays NVIDIA's model files
# into it, read from an Isaac-GR00T git directory at the commit below (never from an installed package).
# Idempotent: an existing venv whose stamp matches the pins and the commit is kept.
# Usage: bash benchmarks/groot_n17_reference/setup_venv.sh ISAAC_GR00T_GIT_DIR [VENV] [PYTHON]
#        (defaults: VENV=/work/venvs/groot-n17-ref, PYTHON=python3.11)
set -euo pipefail

GIT_DIR="${1:?usage: setup_venv.sh ISAAC_GR00T_GIT_DIR [VENV] [PYTHON]}"
VENV="${2:-/work/venvs/groot-n17-ref}"
PYTHON="${3:-python3.11}"

# NVIDIA/Isaac-GR00T at "Bug fixes and expanded 1.7 metrics/benchmarks" (2026-05-26), the N1.7 release line.
COMMIT="626af89d3e914ec92eab5323e23b9ed44a7b26c8"
FILES=(
  gr00t/model/gr00t_n1d7/gr00t_n1d7.py
  gr00t/model/modules/dit.py
  gr00t/model/modules/embodiment_conditioned_mlp.py
  gr00t/model/modules/qwen3_backbone.py
  gr00t/configs/model/gr00t_n1d7.py
)
# The pins. gr00t pins Python 3.10 and torch 2.7.1; its model files run on the CPU torch kilovla uses,
# as the SmolVLA reference does. transformers 4.57.3 and diffusers 0.35.1 are gr00t's own pins.
PINS=(
  "torch==2.13.0"
  "transformers==4.57.3"
  "diffusers==0.35.1"
  "dm-tree"
  "safetensors"
  "numpy"
)
STAMP="$VENV/.pins"
WANT="$(printf '%s\n' "$COMMIT" "${PINS[@]}")"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
  echo "groot-n17-ref venv up to date: $VENV"
else
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check "${PINS[@]}"
  SRC="$VENV/src"
  for f in "${FILES[@]}"; do
    mkdir -p "$SRC/$(dirname "$f")"
    git -C "$GIT_DIR" show "$COMMIT:$f" > "$SRC/$f"
  done
  printf '%s\n' "$WANT" > "$STAMP"
  echo "groot-n17-ref venv created: $VENV (NVIDIA files at $COMMIT)"
fi
(cd "$VENV/src" && sha256sum "${FILES[@]}")
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
for name in ("torch", "transformers", "diffusers", "dm-tree", "safetensors", "numpy"):
    print(f"  {name}=={md.version(name)}")
PY
