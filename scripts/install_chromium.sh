#!/usr/bin/env bash
# Debian's chromium + chromedriver for the live viewer's browser test (tests/serve). Idempotent: returns at once
# when both are installed. Used by .ci/run and, when they are missing, by the test itself.
set -euo pipefail
if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
  exit 0
fi
if ! command -v apt-get > /dev/null; then
  echo "install_chromium: no apt-get on this machine; install Debian's chromium and chromium-driver" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo -n"; fi
export DEBIAN_FRONTEND=noninteractive
echo "[setup] installing chromium + chromium-driver (apt) for the browser test"
$SUDO apt-get update -qq > /dev/null
$SUDO apt-get install -y -qq --no-install-recommends chromium chromium-driver > /dev/null
