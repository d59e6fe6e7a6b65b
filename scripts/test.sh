#!/usr/bin/env bash
# The test command: set up both environments and run both suites.
#   .venv     (Python 3.11): everything, incl. real vLLM 0.33.0 and HF transformers references
#   .venv-tt  (Python 3.12): the real ttnn 0.81.1 wheel in mock-cluster mode (tests/tt)
# Extra arguments go to the main pytest run (e.g. -m "not slow").
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
bash scripts/setup.sh
bash scripts/setup_tt.sh
# The demo model's readability test rebuilds the KJV word lists from Debian's public-domain text
# (optional: without it that one assertion is skipped).
if [ ! -e /usr/lib/bible.data ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && apt-get install -y -qq bible-kjv-text) >/dev/null 2>&1 \
    || echo "[test] bible-kjv-text not installed; the demo readability check will be skipped"
fi
echo "[test] main suite (Python 3.11)"
.venv/bin/python -m pytest -q "$@"
echo "[test] ttnn suite (Python 3.12, mock cluster)"
.venv-tt/bin/python -m pytest -q tests/tt
