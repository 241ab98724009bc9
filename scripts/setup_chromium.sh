#!/usr/bin/env bash
# Install Chromium from the Debian/Ubuntu package when it is missing: the status page's tests load the
# page in headless Chromium, driven by Playwright (the `playwright` package of the dev extra) through
# this binary; nothing is downloaded at run time.
set -euo pipefail
for name in chromium chromium-browser; do
  if command -v "$name" >/dev/null 2>&1; then
    exit 0
  fi
done
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
command -v chromium >/dev/null
