#!/usr/bin/env bash
# The front end's cost per wire protocol (#12, #13): the server on the fake engine (bench/frontend_server.py) carries
# the same load in each protocol, repeated, and the table compares the server's CPU per second of audio.
#
#   bench/frontend_protocols.sh OUTDIR
#
# Environment (defaults in brackets):
#   STREAMS     stream counts to run                                      ["20 40"]
#   PROTOCOLS   PROTOCOL[:OPTION][@CHUNK_MS]: native, openai, deepgram, twilio                    [see below]
#               twilio:both gives a call the agent's track too; native:RATE[-ENCODING] sends that audio (native:24000
#               is what the OpenAI and Deepgram clients send, native:8000-mulaw a Twilio call's; default 16000 s16le);
#               @N sends N ms of audio per message (default 100; Twilio's frames are always 20 ms, @N paces them: @20
#               sends each as it is due, as Twilio does). Default: each adapter beside native on the same audio in the
#               same messages, and native as most clients send it:
#               "native native:24000 openai deepgram native:8000-mulaw@20 twilio@20"
#   DURATION    seconds each stream sends, real time                      [20]
#   REPEATS     runs of each protocol and count, interleaved              [3]
#   STAGGER_S   client starts spread over this long                       [2]
#   SETTLE_S    pause between runs                                        [2]
#   BENCH_ARGS  more qasr-bench stream options, e.g. "--processes 4" for hundreds of streams   [""]
#   PYTHON      the interpreter with qasr installed                       [python]
# Writes OUTDIR/PROTOCOL-STREAMS-RUN.json and .txt per run, server.log, and table.md (also printed).
set -euo pipefail

OUTDIR=${1:?usage: bench/frontend_protocols.sh OUTDIR}
STREAMS=${STREAMS:-"20 40"}
PROTOCOLS=${PROTOCOLS:-"native native:24000 openai deepgram native:8000-mulaw@20 twilio@20"}
DURATION=${DURATION:-20}
REPEATS=${REPEATS:-3}
STAGGER_S=${STAGGER_S:-2}
SETTLE_S=${SETTLE_S:-2}
BENCH_ARGS=${BENCH_ARGS:-}
PYTHON=${PYTHON:-python}
mkdir -p "$OUTDIR"

"$PYTHON" -m qasr.bench.frontend_server --port 0 > "$OUTDIR/server.out" 2> "$OUTDIR/server.log" &
SERVER=$!
trap 'kill $SERVER 2> /dev/null || true; wait $SERVER 2> /dev/null || true' EXIT
for _ in $(seq 600); do  # up to 60 s for "ready PID PORT"
    grep -q '^ready ' "$OUTDIR/server.out" 2> /dev/null && break
    kill -0 $SERVER 2> /dev/null || { echo "the front-end server exited; see $OUTDIR/server.log" >&2; exit 1; }
    sleep 0.1
done
read -r _ PID PORT < "$OUTDIR/server.out"
echo "front-end server: pid $PID, port $PORT; $(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg)" >&2

for run in $(seq "$REPEATS"); do
    for streams in $STREAMS; do
        for entry in $PROTOCOLS; do  # interleaved, so drifting machine load reaches every protocol alike
            protocol=${entry%%[:@]*}
            options=()
            if [[ $entry == *:* ]]; then
                option=${entry#*:}
                option=${option%%@*}
                if [[ $option == both ]]; then
                    options+=(--tracks both)
                else  # RATE[-ENCODING] of native audio
                    options+=(--sample-rate "${option%%-*}")
                    [[ $option == *-* ]] && options+=(--encoding "${option#*-}")
                fi
            fi
            [[ $entry == *@* ]] && options+=(--chunk-ms "${entry##*@}")
            name=${entry//:/-}
            name="${name//@/-c}-$streams-$run"  # twilio:both@20 -> twilio-both-c20-40-1, native:8000-mulaw@20 ->
                                                 # native-8000-mulaw-c20-40-1
            echo "$name" >&2
            # shellcheck disable=SC2086  # BENCH_ARGS is a list of options
            "$PYTHON" -m qasr.bench.stream --protocol "$protocol" "${options[@]}" --url "ws://127.0.0.1:$PORT" \
                --clients "$streams" --duration "$DURATION" --stagger-s "$STAGGER_S" --server-pid "$PID" \
                --no-progress --out "$OUTDIR/$name.json" $BENCH_ARGS > "$OUTDIR/$name.txt"
            sleep "$SETTLE_S"  # the server settles (closing sockets, ended calls) before the next run's first CPU sample
        done
    done
done

"$PYTHON" -m qasr.bench.frontend_table "$OUTDIR" | tee "$OUTDIR/table.md"
