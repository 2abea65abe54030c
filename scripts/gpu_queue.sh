#!/usr/bin/env bash
# Runs gpu_checks.sh stages in the background on a lent GPU while later calls carry the SmolLM2 GGUF's
# parts (a call carries one ~31 MiB part beside the working tree), so the GPU works from the first call.
#
#   bash scripts/gpu_queue.sh start OUT_DIR "STAGES" ["MODEL STAGES"]   call 1 (carries part0, py, book.txt)
#   bash scripts/gpu_queue.sh add                                      calls 2 and 3 (one part each)
#   bash scripts/gpu_queue.sh wait SECONDS                             then: tar OUT_DIR into $OUT
#
# `start` copies this checkout to /tmp/qrepo (later calls re-send the working tree; the queue must not read
# it while it is being written), then runs STAGES there at once and MODEL STAGES (smollm2, heads) once all
# three parts have arrived, in a new process session that outlives the call. `add` copies the parts
# carried so far into the copy. `wait` returns when the queue is done or after SECONDS. The machine goes
# back after 30 s idle and a bare one has no queue: `add` and `wait` then stop at once (exit 3) instead of
# waiting on nothing, so fire the calls back to back.
set -uo pipefail
cd "$(dirname "$0")/.."
QUEUE=${GPU_QUEUE_DIR:-/tmp/qrepo}  # the copy the queue runs from
require_queue() {  # a bare machine (the last one went back) has no queue: stop at once
    [ -f "$QUEUE/.queue_out" ] || { echo "no queue here: this machine is bare (the last went back)"; exit 3; }
}
case ${1:-} in
start)
    out=${2:?usage: gpu_queue.sh start OUT_DIR STAGES [MODEL_STAGES]}
    rm -rf "$QUEUE" && mkdir -p "$QUEUE" "$out" || exit 1
    tar --exclude=./.git --exclude=./.venv --exclude=./models/smollm2-135m -cf - . | tar -xf - -C "$QUEUE" || exit 1
    echo "$out" >"$QUEUE/.queue_out"
    GPU_QUEUE_DIR=$QUEUE setsid nohup bash "$QUEUE/scripts/gpu_queue.sh" run "$out" "${3:-}" "${4:-}" >"$out/queue.log" 2>&1 </dev/null &
    sleep 2
    cat "$out/queue.log"
    ;;
run)  # the queue itself (started by `start`, inside the copy)
    out=$2
    echo "start $(date +%T)"
    [ -n "$3" ] && bash scripts/gpu_checks.sh "$out" $3
    if [ -n "$4" ]; then
        for _ in $(seq 1 300); do [ -f .gpu_carry/parts_ready ] && break; sleep 2; done
        echo "parts $(date +%T)"
        bash scripts/gpu_checks.sh "$out" $4
    fi
    echo "done $(date +%T)"
    touch "$out/DONE"
    ;;
add)
    require_queue
    mkdir -p "$QUEUE/.gpu_carry"
    for part in .gpu_carry/smol.part* .gpu_carry/books; do
        [ -e "$part" ] && cp -r "$part" "$QUEUE/.gpu_carry/"
    done
    [ "$(ls "$QUEUE"/.gpu_carry/smol.part* 2>/dev/null | wc -l)" -ge 3 ] && touch "$QUEUE/.gpu_carry/parts_ready"
    ls "$QUEUE/.gpu_carry"
    cat "$(cat "$QUEUE/.queue_out")/queue.log"
    ;;
wait)
    require_queue
    out=$(cat "$QUEUE/.queue_out")
    timeout "${2:?usage: gpu_queue.sh wait SECONDS}" bash -c "until [ -f $out/DONE ]; do sleep 5; done"
    cat "$out/queue.log"
    if [ -n "${OUT:-}" ]; then tar czf "$OUT/queue.tgz" -C "$out" .; fi
    ;;
*)
    echo "usage: gpu_queue.sh start OUT_DIR STAGES [MODEL_STAGES] | add | wait SECONDS"
    exit 2
    ;;
esac
