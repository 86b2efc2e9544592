#!/usr/bin/env bash
# Make sure a redis-server binary exists (tests start their own servers on free ports).
# Installs Debian's package when running as root; otherwise just reports.
set -u
command -v redis-server >/dev/null 2>&1 && exit 0
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) >/dev/null 2>&1
fi
command -v redis-server >/dev/null 2>&1
