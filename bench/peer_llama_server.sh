#!/usr/bin/env bash
# Peers side by side on this CPU: llama.cpp's llama-server, Conveyor, transformers'
# static generate() and the linear-layer floor, on the same burst, one engine at a time.
#
#   bench/peer_llama_server.sh build            # build llama-server once (run under flock -s)
#   bench/peer_llama_server.sh run [--out DIR]  # the burst through every engine (flock -x)
#       [--engines llama-server,conveyor,conveyor-fp32,hf-static,roofline] [--num-prompts 64]
#       [--scale 1] [--scenario burst|single]
#
# `conveyor` runs `conveyor up` with its defaults (the GGUF's own Q4_1 blocks); `conveyor-fp32`
# the dequantized weights in fp32 (`--quantization none --dtype float32`). `--scenario single`:
# one stream instead of the burst, 8 requests one after the other, 32-token prompts, 128 output
# tokens each (decode tok/s = 1 / TPOT). Each engine's processes' CPU time per output token
# (bench/peer_cpu.py, warm-up included) goes to <engine>.cpu.txt.
#
# `make peer-bench` does both with the right locks. The build comes from the llama.cpp source
# vendored in the llama-cpp-python sdist (one pinned version), cached in .cache/peers/ (ignored);
# ggml's CPU flags are taken from /proc/cpuinfo with GGML_NATIVE=OFF (an AMX build of ggml
# crashed on one machine of this kind, so AMX stays off; AVX-512 is used where the CPU has it).
# The script takes no lock itself: a child's `flock -s` under the caller's `flock -x` on the
# same file would wait forever.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
SELF=$ROOT/bench/peer_llama_server.sh
PY=${PY:-$ROOT/.venv/bin/python}
LLAMA_CPP_PYTHON_VERSION=0.3.36
CACHE=${PEER_CACHE:-$ROOT/.cache/peers}
SRC=$CACHE/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp
BUILD=$CACHE/build-$LLAMA_CPP_PYTHON_VERSION
SERVER_BIN=$BUILD/bin/llama-server
JOBS=${PEER_BUILD_JOBS:-2}

# Workload (docs/PERFORMANCE.md §1): 64 requests at once, the mixed scenario, EOS ignored, greedy.
NUM_PROMPTS=${NUM_PROMPTS:-64}
SCALE=${SCALE:-1}
BATCH_SIZE=32
THREADS=2
OUT=${OUT:-}
ENGINES="llama-server,conveyor,conveyor-fp32,hf-static,roofline"
SCENARIO=${SCENARIO:-burst}

log() { echo "[peer-bench $(date -u +%H:%M:%S)] $*" >&2; }

# ggml's x86 options for the instructions this CPU lists (AMX deliberately never).
cpu_cmake_flags() {
    local flags
    flags=$(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2)
    has() { [[ " $flags " == *" $1 "* ]]; }
    local out="-DGGML_NATIVE=OFF"
    local pair opt feat
    for pair in SSE42:sse4_2 AVX:avx AVX2:avx2 FMA:fma F16C:f16c BMI2:bmi2 AVX_VNNI:avx_vnni \
        AVX512:avx512f AVX512_VBMI:avx512_vbmi AVX512_VNNI:avx512_vnni AVX512_BF16:avx512_bf16; do
        opt=${pair%%:*}
        feat=${pair#*:}
        if has "$feat"; then out+=" -DGGML_$opt=ON"; else out+=" -DGGML_$opt=OFF"; fi
    done
    out+=" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
    echo "$out"
}

# cmake and ninja: the machine's, else pip's wheels into the cache folder (not the runtime deps).
ensure_build_tools() {
    # pip --target puts the wheels' entry points in tools/bin; they import from tools/.
    export PATH="$CACHE/tools/bin:$PATH" PYTHONPATH="$CACHE/tools${PYTHONPATH:+:$PYTHONPATH}"
    local missing=()
    command -v cmake >/dev/null || missing+=(cmake)
    command -v ninja >/dev/null || missing+=(ninja)
    if ((${#missing[@]})); then
        log "installing ${missing[*]} from pip into $CACHE/tools"
        "$PY" -m pip install -q --target "$CACHE/tools" "${missing[@]}"
    fi
}

# Run a build step with its output in a log; on failure show the log's end and stop.
logged() {
    local logfile=$1
    shift
    if ! "$@" >"$logfile" 2>&1; then
        log "FAILED: $* (last lines of $logfile below)"
        tail -n 40 "$logfile" >&2
        exit 1
    fi
}

build_server() {
    if [[ -x $SERVER_BIN ]]; then
        log "llama-server already built: $SERVER_BIN"
        return
    fi
    mkdir -p "$CACHE"
    ensure_build_tools
    if [[ ! -d $SRC ]]; then
        local sdist=$CACHE/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz
        if [[ ! -f $sdist ]]; then
            log "downloading the llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sdist"
            "$PY" -m pip download -q --no-binary :all: --no-deps \
                "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$CACHE"
        fi
        tar -xzf "$sdist" -C "$CACHE"
    fi
    local cpu_flags
    cpu_flags=$(cpu_cmake_flags)
    log "configuring llama.cpp ($cpu_flags)"
    # No web UI (it would be fetched from the network) and no OpenSSL: a local benchmark server.
    # shellcheck disable=SC2086  # cpu_flags is a list of -D options
    logged "$CACHE/configure.log" cmake -S "$SRC" -B "$BUILD" -G Ninja \
        -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_SERVER=ON \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF \
        -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DGGML_OPENMP=ON $cpu_flags
    log "building llama-server with -j$JOBS (log: $CACHE/build.log)"
    logged "$CACHE/build.log" cmake --build "$BUILD" --target llama-server -j "$JOBS"
    log "built $SERVER_BIN"
}

free_port() {
    "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])'
}

http_ok() {  # exit status 0 when GET $1 answers 200
    "$PY" -c 'import sys, httpx
sys.exit(httpx.get(sys.argv[1], timeout=2, trust_env=False).status_code != 200)' "$1" 2>/dev/null
}

# Poll an HTTP URL until it answers 200 (or the server process died, or `limit` seconds passed).
wait_http() {
    local url=$1 pid=$2 limit=$3 start=$SECONDS
    while ((SECONDS - start < limit)); do
        kill -0 "$pid" 2>/dev/null || { log "server (pid $pid) exited before ready"; return 1; }
        http_ok "$url" && return 0
        sleep 1
    done
    log "no answer from $url within ${limit}s"
    return 1
}

SERVER_PID=""
stop_server() {
    [[ -n $SERVER_PID ]] || return 0
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
    kill -KILL "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=""
}
trap stop_server EXIT

# The burst through `conveyor bench --backend openai` (the workload --compare-batching's `mixed`
# scenario sends: same seed, lengths, one warm-up request, EOS ignored, greedy).
burst() {
    local port=$1 name=$2
    local workload=(--workload mixed --num-prompts "$NUM_PROMPTS" --scale "$SCALE")
    if [[ $SCENARIO == single ]]; then
        workload=(--workload random --num-prompts 8 --input-len 32 --output-len 128
            --range-ratio 0 --max-concurrency 1)
    fi
    local extra=0  # the warm-up's tokens (one stream: one request of 128)
    [[ $SCENARIO == single ]] && extra=128
    "$PY" bench/peer_cpu.py snapshot --pid "$SERVER_PID" --out "$OUT/$name.cpu0.json"
    "$PY" -m conveyor bench --backend openai --base-url "http://127.0.0.1:$port" --model smollm2 \
        "${workload[@]}" --seed 0 \
        --ignore-eos --temperature 0 --num-warmups 1 --no-plots --no-progress \
        --out "$OUT/$name" | tee "$OUT/$name.txt"
    "$PY" bench/peer_cpu.py snapshot --pid "$SERVER_PID" --out "$OUT/$name.cpu1.json"
    "$PY" bench/peer_cpu.py report "$OUT/$name.cpu0.json" "$OUT/$name.cpu1.json" \
        --result "$OUT/$name/result.json" --extra-tokens "$extra" | tee "$OUT/$name.cpu.txt"
}

run_llama_server() {
    local gguf port
    gguf=$("$PY" -c 'from shared.model_files import default_gguf_path; print(default_gguf_path())')
    port=$(free_port)
    # -c: 32 slots x 1,024 tokens (the burst's longest request is 512 + 256); the default (the
    # model's 8,192 split 32 ways) would cut every slot to 256 tokens.
    local cmd=("$SERVER_BIN" -m "$gguf" --host 127.0.0.1 --port "$port" --alias smollm2
        -np "$BATCH_SIZE" -cb -c $((BATCH_SIZE * 1024)) -t "$THREADS" -tb "$THREADS" --no-webui)
    log "llama-server: ${cmd[*]}"
    echo "${cmd[*]}" >"$OUT/llama-server.cmd"
    "${cmd[@]}" >"$OUT/llama-server.log" 2>&1 &
    SERVER_PID=$!
    wait_http "http://127.0.0.1:$port/health" "$SERVER_PID" 300
    burst "$port" llama-server
    stop_server
}

run_conveyor() {  # $1: the name in the results; the rest: flags after the defaults
    local name=$1 port
    shift
    port=$(free_port)
    local cmd=("$PY" -m conveyor up --http-port "$port"
        --frontend-addr "tcp://127.0.0.1:$(free_port)" --log-dir "$OUT/logs/$name" --quiet "$@")
    log "$name: ${cmd[*]} (defaults otherwise: quantization auto, dtype auto, max_num_seqs 32)"
    echo "${cmd[*]}" >"$OUT/$name.cmd"
    "${cmd[@]}" >"$OUT/$name.log" 2>&1 &
    SERVER_PID=$!
    wait_http "http://127.0.0.1:$port/health" "$SERVER_PID" 600
    burst "$port" "$name"
    stop_server
}

run_hf_static() {
    log "transformers static generate(), batches of $BATCH_SIZE, float32"
    "$PY" bench/hf_static_burst.py --num-prompts "$NUM_PROMPTS" --scale "$SCALE" \
        --batch-size "$BATCH_SIZE" --dtype float32 --out "$OUT/hf-static.json" \
        | tee "$OUT/hf-static.txt"
}

run_roofline() {
    log "roofline: the workload's linear-layer floor at this machine's GEMM rates"
    "$PY" bench/roofline.py --workload mixed --num-prompts "$NUM_PROMPTS" --scale "$SCALE" \
        --decode-rows "$BATCH_SIZE" | tee "$OUT/roofline.txt"
}

run_all() {
    [[ -x $SERVER_BIN ]] || { log "no $SERVER_BIN: run '$0 build' first (under flock -s)"; exit 1; }
    OUT=${OUT:-results/peers-$(date -u +%Y%m%d-%H%M%S)}
    mkdir -p "$OUT"
    export PYTHONPATH=$ROOT TOKENIZERS_PARALLELISM=false
    {
        date -u +%Y-%m-%dT%H:%M:%SZ
        lscpu | grep -E '^(Model name|CPU\(s\)|Vendor ID)'
        echo "ggml: $(cpu_cmake_flags)"
    } >"$OUT/machine.txt"
    # Each engine in a process of its own: one that fails is reported and the others still run
    # (`set -e` does not act inside a function called from an `if`).
    local engine failed=()
    for engine in ${ENGINES//,/ }; do
        if ! OUT=$OUT NUM_PROMPTS=$NUM_PROMPTS SCALE=$SCALE SCENARIO=$SCENARIO \
            bash "$SELF" engine "$engine"; then
            log "engine $engine FAILED (see $OUT/$engine.log / $engine.txt)"
            failed+=("$engine")
        fi
    done
    "$PY" bench/peer_table.py --dir "$OUT"
    if ((${#failed[@]})); then
        log "failed: ${failed[*]}"
        return 1
    fi
}

run_engine() {
    case $1 in
        llama-server) run_llama_server ;;
        conveyor) run_conveyor conveyor ;;
        conveyor-fp32) run_conveyor conveyor-fp32 --quantization none --dtype float32 ;;
        hf-static) run_hf_static ;;
        roofline) run_roofline ;;
        *) log "unknown engine $1"; exit 2 ;;
    esac
}

usage() {
    echo "usage: $0 build | run [--out DIR] [--engines llama-server,conveyor,conveyor-fp32," \
        "hf-static,roofline] [--num-prompts 64] [--scale 1] [--scenario burst|single]" >&2
    exit 2
}

main() {
    local action=${1:-}
    shift || true
    if [[ $action == engine ]]; then  # internal: one engine, called by run_all
        ENGINE=${1:-}
        shift || true
    fi
    while (($#)); do
        case $1 in
            --out) OUT=$2; shift 2 ;;
            --engines) ENGINES=$2; shift 2 ;;
            --num-prompts) NUM_PROMPTS=$2; shift 2 ;;  # a smoke run: e.g. 4 prompts, scale 0.1
            --scale) SCALE=$2; shift 2 ;;
            --scenario) SCENARIO=$2; shift 2 ;;
            *) usage ;;
        esac
    done
    case $action in
        build) build_server ;;
        run) run_all ;;
        engine) run_engine "${ENGINE:?}" ;;
        *) usage ;;
    esac
}

main "$@"
