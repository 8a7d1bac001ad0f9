#!/usr/bin/env bash
# Run a command; if it is still running after N seconds, make every Python process it started
# (workers included) print all its threads' stacks (PYTHONFAULTHANDLER=1, then SIGABRT), to
# see where a start-up or step hangs:
#   bash scripts/stack_dump.sh 90 python3 -m pagebatch.cli bench latency ... --tensor-parallel-size 2
set -uo pipefail
limit=$1; shift
export PYTHONFAULTHANDLER=1
setsid "$@" &
pid=$!
for _ in $(seq "$limit"); do
    kill -0 "$pid" 2>/dev/null || { wait "$pid"; exit $?; }
    sleep 1
done
echo "stack_dump: still running after ${limit}s; SIGABRT to its processes:" >&2
pgid=$(ps -o pgid= "$pid" | tr -d ' ')
ps -o pid,etimes,args -g "$pgid" >&2
kill -ABRT -- "-$pgid"
sleep 5
kill -KILL -- "-$pgid" 2>/dev/null
wait "$pid"
exit 124
