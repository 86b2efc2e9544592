#!/usr/bin/env bash
# Make sure Debian's chromium and chromium-driver exist (the playground's browser test drives them with selenium;
# nothing is downloaded by selenium itself). Installs the packages when running as root; otherwise just reports.
set -u
have() { command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; }
have && exit 0
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver) >/dev/null 2>&1
fi
have
