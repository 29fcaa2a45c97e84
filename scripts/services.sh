#!/usr/bin/env bash
# Make sure PostgreSQL and Redis answer on 127.0.0.1: start them when installed but stopped,
# install them with apt-get when missing. Idempotent; the tests need both.
set -euo pipefail

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
apt_updated=0
apt_install() {
  if [ "$apt_updated" = 0 ]; then as_root apt-get update -qq; apt_updated=1; fi
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

wait_for() {  # wait_for NAME COMMAND...
  local name=$1; shift
  for _ in $(seq 1 60); do "$@" >/dev/null 2>&1 && return 0; sleep 0.5; done
  echo "services: $name did not come up" >&2
  return 1
}

# --- PostgreSQL ---------------------------------------------------------------------------
pg_up() { pg_isready -q -h 127.0.0.1 -p 5432; }
if ! command -v pg_ctlcluster >/dev/null 2>&1; then
  echo "services: installing postgresql"
  apt_install postgresql
fi
if ! pg_up; then
  version=$(ls /etc/postgresql | sort -V | tail -n 1)
  if [ -z "$version" ]; then
    version=$(ls /usr/lib/postgresql | sort -V | tail -n 1)
    as_root pg_createcluster "$version" main
  fi
  echo "services: starting postgresql $version"
  as_root pg_ctlcluster --skip-systemctl-redirect "$version" main start
  wait_for postgresql pg_up
fi
# Trust auth on 127.0.0.1 for the tests' user, as on the CI machines.
if ! psql -h 127.0.0.1 -U postgres -d postgres -tAc 'select 1' >/dev/null 2>&1; then
  hba=$(as_root su postgres -c "psql -tAc 'show hba_file'")
  as_root sed -i -E 's/^(host\s+all\s+all\s+127\.0\.0\.1\/32\s+)\S+/\1trust/' "$hba"
  as_root su postgres -c "psql -tAc 'select pg_reload_conf()'" >/dev/null
fi
if ! psql -h 127.0.0.1 -U postgres -d postgres -tAc "select 1 from pg_database where datname='test'" | grep -q 1; then
  psql -h 127.0.0.1 -U postgres -d postgres -qc 'create database test'
fi

# --- Redis --------------------------------------------------------------------------------
redis_up() { redis-cli -h 127.0.0.1 -p 6379 ping | grep -q PONG; }
if ! command -v redis-server >/dev/null 2>&1; then
  echo "services: installing redis"
  apt_install redis-server
fi
if ! redis_up; then
  echo "services: starting redis"
  as_root mkdir -p /var/lib/redis /var/log/redis
  as_root redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" \
    --appendonly no --dir /var/lib/redis --logfile /var/log/redis/ci.log
  wait_for redis redis_up
fi
echo "services: postgresql and redis are up"
