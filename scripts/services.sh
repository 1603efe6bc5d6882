#!/usr/bin/env bash
# The Debian services the CeleryExecutor test runs against: Redis (Celery broker) and PostgreSQL (Airflow
# metadata DB and Celery result backend). The test starts its own throwaway instances on 127.0.0.1 (see
# tests/airflow_services.py); this script only makes sure the binaries are there.
#
#   scripts/services.sh ensure   # apt-get install redis-server / postgresql when missing (root, idempotent)
#   scripts/services.sh check    # exit 0 when both are installed, 1 otherwise; installs nothing
#   scripts/services.sh browser  # apt-get install chromium (/usr/bin/chromium) when missing, for the UI test
#                                # (tests/system/test_ui_browser.py drives it with Playwright; no browser download)
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

case "${1:-ensure}" in
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
    apt-get update -qq
    # shellcheck disable=SC2086
    apt-get install -y -qq --no-install-recommends $want >/dev/null
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
      apt-get update -qq
    fi
    echo "services: installing chromium"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null
    [ -x /usr/bin/chromium ] || { echo "services: /usr/bin/chromium still missing after install" >&2; exit 1; }
    echo "services: installed $(/usr/bin/chromium --version 2>/dev/null)"
    ;;
  check)
    [ -z "$(missing)" ]
    ;;
  *)
    echo "usage: $0 ensure|check|browser" >&2
    exit 2
    ;;
esac
