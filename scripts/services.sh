#!/usr/bin/env bash
# The Debian services the CeleryExecutor test runs against: Redis (Celery broker) and PostgreSQL (Airflow
# metadata DB and Celery result backend). The test starts its own throwaway instances on 127.0.0.1 (see
# tests/airflow_services.py); this script only makes sure the binaries are there.
#
#   scripts/services.sh ensure   # apt-get install redis-server / postgresql when missing (root, idempotent)
#   scripts/services.sh check    # exit 0 when both are installed, 1 otherwise; installs nothing
#   scripts/services.sh browser  # apt-get install chromium (/usr/bin/chromium) when missing, for the UI test
#                                # (tests/system/test_ui_browser.py drives it with Playwright; no browser download)
#   scripts/services.sh prometheus  # Debian's prometheus and prometheus-pushgateway, unpacked (no root, no install)
#                                # into .cache/prometheus; prints the folder of their binaries
#                                # (tests/system/test_prometheus_pushgateway.py runs both on loopback)
#
# Installing does not leave a system-wide server running: Debian's postinst starts one only where an init
# system runs (not in containers / CI jobs); the test never uses a system instance either way.
set -euo pipefail

pg_bin() {  # newest /usr/lib/postgresql/<version>/bin that has initdb
  local d
  for d in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V -r); do
    [ -x "$d/initdb" ] && [ -x "$d/pg_ctl" ] && { echo "$d"; return 0; }
  done
  return 1
}

missing() {
  local pkgs=()
  command -v redis-server >/dev/null 2>&1 || [ -x /usr/bin/redis-server ] || pkgs+=(redis-server)
  pg_bin >/dev/null || pkgs+=(postgresql)
  echo "${pkgs[@]:-}"
}

# prometheus: `apt-get download` of the two packages (the apt lists refreshed first when they lack them, which
# needs root) and `dpkg -x` of each into .cache/prometheus/root: the binaries in usr/bin, the web assets in
# usr/share/prometheus. Their dependencies are web assets and init-system helpers the binaries do not need.
PROM_PKGS="prometheus prometheus-pushgateway"
PROM_DIR=$(cd "$(dirname "$0")/.." && pwd)/.cache/prometheus
prometheus_ready() { [ -x "$PROM_DIR/root/usr/bin/prometheus" ] && [ -x "$PROM_DIR/root/usr/bin/prometheus-pushgateway" ]; }

# apt-get, one at a time: the browser test installs chromium in its own pytest process while the suite beside it
# may install redis / postgresql (a CI run lost the browser test to "Could not get lock /var/lib/dpkg/lock-frontend");
# the project's own installs queue on a lock file, anyone else's apt is waited for up to 10 minutes
apt_get() { flock "${TMPDIR:-/tmp}/batch-llm-apt.lock" apt-get -o DPkg::Lock::Timeout=600 "$@"; }

case "${1:-ensure}" in
  prometheus)
    if prometheus_ready; then echo "$PROM_DIR/root/usr/bin"; exit 0; fi
    mkdir -p "$PROM_DIR/debs"
    for p in $PROM_PKGS; do
      if ! apt-cache policy "$p" 2>/dev/null | grep -q 'Candidate: [0-9]'; then
        [ "$(id -u)" = 0 ] || { echo "services: apt knows no package $p; run 'apt-get update' as root" >&2; exit 1; }
        apt_get update -qq
        break
      fi
    done
    echo "services: downloading $PROM_PKGS (apt-get download) into $PROM_DIR/debs" >&2
    # apt's sandbox user cannot write into a folder of ours: say nothing about it (the download runs as us)
    (cd "$PROM_DIR/debs" && rm -f ./*.deb && apt-get download -q=2 $PROM_PKGS 2>&1 | grep -v "unsandboxed" >&2 || true)
    rm -rf "$PROM_DIR/root.tmp"
    debs=("$PROM_DIR"/debs/*.deb)
    [ -e "${debs[0]}" ] || { echo "services: apt-get download of $PROM_PKGS failed (see above)" >&2; exit 1; }
    for deb in "${debs[@]}"; do dpkg -x "$deb" "$PROM_DIR/root.tmp"; done
    if [ ! -x "$PROM_DIR/root.tmp/usr/bin/prometheus" ] || [ ! -x "$PROM_DIR/root.tmp/usr/bin/prometheus-pushgateway" ]; then
      echo "services: apt-get download of $PROM_PKGS gave no binaries (see above)" >&2; exit 1
    fi
    rm -rf "$PROM_DIR/root" && mv "$PROM_DIR/root.tmp" "$PROM_DIR/root"
    echo "services: unpacked $(ls "$PROM_DIR/debs" | tr '\n' ' ')" >&2
    echo "$PROM_DIR/root/usr/bin"
    ;;
  ensure)
    want=$(missing)
    if [ -z "$want" ]; then
      echo "services: redis-server and postgresql present ($(pg_bin))"
      exit 0
    fi
    if [ "$(id -u)" != 0 ]; then
      echo "services: missing $want; run 'scripts/services.sh ensure' as root (apt-get)" >&2
      exit 1
    fi
    echo "services: installing $want"
    export DEBIAN_FRONTEND=noninteractive
    # policy-rc.d 101: do not start the packages' own system services during the install.
    created_policy=0
    if [ ! -e /usr/sbin/policy-rc.d ]; then
      printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && created_policy=1
    fi
    trap 'if [ "$created_policy" = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi' EXIT
    apt_get update -qq
    # shellcheck disable=SC2086
    apt_get install -y -qq --no-install-recommends $want >/dev/null
    want=$(missing)
    [ -z "$want" ] || { echo "services: still missing after install: $want" >&2; exit 1; }
    echo "services: installed; postgresql binaries in $(pg_bin)"
    ;;
  browser)
    if [ -x /usr/bin/chromium ]; then
      echo "services: chromium present ($(/usr/bin/chromium --version 2>/dev/null || echo /usr/bin/chromium))"
      exit 0
    fi
    if [ "$(id -u)" != 0 ]; then
      echo "services: chromium missing; run 'scripts/services.sh browser' as root (apt-get)" >&2
      exit 1
    fi
    if ! apt-cache policy chromium 2>/dev/null | grep -q 'Candidate: [0-9]'; then
      apt_get update -qq
    fi
    echo "services: installing chromium"
    DEBIAN_FRONTEND=noninteractive apt_get install -y -qq --no-install-recommends chromium >/dev/null
    [ -x /usr/bin/chromium ] || { echo "services: /usr/bin/chromium still missing after install" >&2; exit 1; }
    echo "services: installed $(/usr/bin/chromium --version 2>/dev/null)"
    ;;
  check)
    [ -z "$(missing)" ]
    ;;
  *)
    echo "usage: $0 ensure|check|browser|prometheus" >&2
    exit 2
    ;;
esac
