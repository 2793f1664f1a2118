#!/usr/bin/env bash
# Profile a running process (e.g. `nanollmserve serve`) for SECONDS (default 10):
#   scripts/profile.sh PID [SECONDS] [extra args for `nanollmserve profile`, e.g. --csv FILE]
# Always: `nanollmserve profile` (/proc sampling: RSS, VmPeak, threads, context switches,
# CPU time; JSON summary on stdout). Where `perf` exists, `perf stat -p PID` runs over the
# same window and its counters follow; where it does not (or the kernel refuses counters,
# as in many containers), this script says so and the /proc summary is all there is.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if (($# < 1)); then
  echo "usage: scripts/profile.sh PID [SECONDS] [nanollmserve profile args...]" >&2
  exit 2
fi
pid="$1"
seconds="${2:-10}"
shift $(($# >= 2 ? 2 : 1))
cli=(.venv/bin/nanollmserve)
[[ -x "${cli[0]}" ]] || cli=(nanollmserve)

perf_log=""
if command -v perf >/dev/null 2>&1; then
  perf_log="$(mktemp)"
  trap 'rm -f "$perf_log"' EXIT
  perf stat -p "$pid" -- sleep "$seconds" 2>"$perf_log" &
  perf_pid=$!
else
  echo "profile.sh: perf not found (Debian: apt-get install linux-perf); /proc sampling only" >&2
fi

"${cli[@]}" profile --pid "$pid" --duration "$seconds" "$@"

if [[ -n "$perf_log" ]]; then
  wait "$perf_pid" || true
  if grep -qE "<not (supported|counted)>|Permission|Access to performance monitoring" \
    "$perf_log"; then
    echo "profile.sh: perf exists but the kernel gave it no (or only some) counters" \
      "(perf_event_paranoid=$(cat /proc/sys/kernel/perf_event_paranoid 2>/dev/null || echo ?)," \
      "or a container without perf events); its output follows:" >&2
  fi
  echo "--- perf stat -p $pid ($seconds s) ---" >&2
  cat "$perf_log" >&2
fi
