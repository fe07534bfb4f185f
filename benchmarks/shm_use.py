"""How much of /dev/shm a served speculative deployment takes for many long requests at once.

    python benchmarks/shm_use.py --requests 64 --prompt-tokens 1000 --max-tokens 1000

Triton's Python backend gives every model instance one shared-memory region (/dev/shm/
triton_python_backend_shm_region_*): the BLS's engine calls (their inputs) and the engines' responses to them live
in the BLS's region, which grows by shm-growth-byte-size whenever what is alive does not fit and never shrinks. So
what a deployment holds per request, times the requests in flight, is what a container's --shm-size must cover.

It builds a tiny random pair (a 2-layer target, a perturbed copy as its draft; max_seq_len 2048) in --workdir, or
reuses one built there, serves it with the BLS admitting all --requests at once, and sends them together over HTTP
(`generate`, not streamed), each a --prompt-tokens prompt asking for --max-tokens tokens (min_tokens too, so none
ends early). While they run it samples, every 0.2 s, the regions the server's own processes map (not other servers'):
their size (what the files say) and the pages written (what tmpfs holds, `du`), and `df /dev/shm`'s used bytes (the
whole machine). Printed as JSON: the peaks, the requests' outcomes and the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

REGION = "triton_python_backend_shm_region"


def build(root: Path, requests: int):
    """The tiny pair's repository under `root` (built once) and a server for it, not yet started."""
    from support.tiny import make_checkpoint, make_perturbed_copy, write_config

    from trtspec.compile import run_build
    from trtspec.config import load_config
    from trtspec.deploy.writer import write_repository
    from trtspec.server import TritonServer, free_port

    engines = root / "engines"
    config = root / "build.yaml"
    if not (engines / "target" / "config.json").exists():
        target = make_checkpoint(root / "target", layers=2, seed=0)
        draft = make_perturbed_copy(target, root / "draft", noise=0.01)
        write_config(
            config,
            target,
            draft,
            speculation={"max_draft_len": 4},
            engine={"max_input_len": 1024, "max_seq_len": 2048, "max_batch_size": 16},
        )
        run_build(config, engines)
    repo = write_repository(
        load_config(config),
        engines,
        Path(tempfile.mkdtemp(prefix="repo-", dir=root)) / "model_repository",
        # all at once, and as long as they take on a CPU (the deployment's bound is 10 minutes)
        overrides={"max_concurrent_requests": requests, "request_timeout_ms": 4 * 3600 * 1000},
    )
    return TritonServer(repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port()), root / "target"


def regions(pids: list[int]) -> set[str]:
    """The shared-memory regions these processes map."""
    found = set()
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                if REGION in line:
                    found.add(line.split(maxsplit=5)[-1].removesuffix(" (deleted)"))
        except OSError:
            continue
    return found


def group(pid: int) -> list[int]:
    """tritonserver and its stubs (the server's process group)."""
    pgid = os.getpgid(pid)
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid:
                    out.append(int(entry.name))
            except OSError:
                continue
    return out


class Sampler(threading.Thread):
    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.stopped = pid, threading.Event()
        self.peak = {"region_bytes": 0, "written_bytes": 0, "df_used_bytes": 0, "regions": 0}
        self.first: dict | None = None

    def sample(self) -> dict:
        size = written = 0
        names = regions(group(self.pid))
        for name in names:
            try:
                st = os.stat(name)
            except OSError:
                continue
            size, written = size + st.st_size, written + st.st_blocks * 512
        fs = os.statvfs("/dev/shm")
        used = (fs.f_blocks - fs.f_bfree) * fs.f_frsize
        return {"region_bytes": size, "written_bytes": written, "df_used_bytes": used, "regions": len(names)}

    def run(self):
        while not self.stopped.wait(0.2):
            now = self.sample()
            self.first = self.first or now
            self.peak = {k: max(v, now[k]) for k, v in self.peak.items()}


def prompt_of(tokenizer_dir: Path, tokens: int) -> str:
    """A text of about `tokens` tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    words = "Speculative decoding drafts tokens with a small model and verifies them with a large one. ".split()
    text, i = "", 0
    while len(tok(text)["input_ids"]) < tokens:
        text += words[i % len(words)] + (" " if i % 7 else " 1 2 3 ")
        i += 1
    return text


def send(url: str, body: dict) -> tuple[str, int]:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=3600) as resp:
            out = json.loads(resp.read())
        return "ok", len(out.get("output_ids") or [])
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}: {exc.read()[:200]!r}", 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=1000)
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "trtspec-shm-use")
    args = p.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    server, tokenizer = build(args.workdir, args.requests)
    prompt = prompt_of(tokenizer, args.prompt_tokens)
    body = {"text_input": prompt, "max_tokens": args.max_tokens, "min_tokens": args.max_tokens, "temperature": 0.0}
    url = f"{server.http_base_url}/v2/models/tensorrt_llm_bls/generate"
    with server:
        sampler = Sampler(server.pid)
        sampler.start()
        time.sleep(1.0)  # a sample before the load: the regions as loaded
        start = time.perf_counter()
        with ThreadPoolExecutor(args.requests) as pool:
            outcomes = list(pool.map(lambda _: send(url, body), range(args.requests)))
        seconds = time.perf_counter() - start
        time.sleep(0.5)
        sampler.stopped.set()
        sampler.join()
        after = sampler.sample()
    kinds: dict[str, int] = {}
    for kind, _ in outcomes:
        kinds[kind] = kinds.get(kind, 0) + 1
    report = {
        "requests": args.requests,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "outcomes": kinds,
        "tokens": sum(n for _, n in outcomes),
        "seconds": round(seconds, 1),
        "before": sampler.first,
        "peak": sampler.peak,
        "after": after,
        "peak_region_mib": round(sampler.peak["region_bytes"] / 2**20, 1),
        "peak_written_mib": round(sampler.peak["written_bytes"] / 2**20, 1),
    }
    print(json.dumps(report, indent=2))
    return 0 if set(kinds) == {"ok"} else 1


if __name__ == "__main__":
    raise SystemExit(main())
