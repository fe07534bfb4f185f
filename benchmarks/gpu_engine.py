"""The embedded engine's forward on a CUDA GPU against its bandwidth bound: a decode step and passes of k+1 rows.

    python benchmarks/gpu_engine.py --engines demo-engines --llama8b --output gpu-engine.json

Models: the demo target as built (FP8 weights, run in bfloat16 with FP8 products, and with the weights dequantized
to bfloat16), and with --llama8b a Llama-3-8B-shaped model of random weights made here (nothing is downloaded),
quantized to FP8 per tensor by trtspec's own quantizer (trtspec.engine.fp8), run with FP8 products and, on the
same weights dequantized, in bfloat16.

For each: the pass of one row (a decode step) and of k+1 rows (a verification of k draft tokens, k = 1..8) at a
cached context of --context tokens, timed (a) eagerly (the compact forward, `CompactModel.forward`: inputs made on
the host, the network, logits copied back), (b) as one CUDA graph replayed (the network captured once for that
pass's shape and position, logits copied back), which leaves out the host's launch overhead, and (c) as the served
engine runs it on CUDA (`PagedModel.forward`: the static-shape path, its bucket's graph replayed after the host
writes the pass's inputs, logits copied back), at --batches sequences of k+1 rows each. The bound is the bytes one
pass must read (every linear, the output head and the norms; `weight_bytes`) over the device-to-device copy bandwidth
measured in the same run (bytes read + written, as STREAM counts). Medians of --reps timings after warm-ups.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from trtspec.engine import fp8
from trtspec.engine.model import CompactModel, Segment
from trtspec.engine.paged import PagedModel
from trtspec.engine.runtime import Engine

KS = list(range(0, 9))


def copy_bandwidth(nbytes: int = 2 << 30, reps: int = 20) -> float:
    """Device-to-device copy, bytes read + written per second (median of `reps` after warm-up)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * nbytes / statistics.median(times)


def llama8b_state(device: torch.device, seed: int = 0) -> tuple[object, dict[str, torch.Tensor]]:
    """Meta-Llama-3-8B's shapes and rotary settings with random weights (std 0.02, norms 1), every decoder linear
    quantized to FP8 E4M3 per tensor as `trtspec build` does; embeddings and head bfloat16."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    config.architectures = ["LlamaForCausalLM"]
    g = torch.Generator(device=device).manual_seed(seed)
    h, inter, kv = config.hidden_size, config.intermediate_size, config.num_key_value_heads * 128

    def weight(rows, cols):
        return torch.randn(rows, cols, device=device, generator=g, dtype=torch.bfloat16) * 0.02

    state = {
        "model.embed_tokens.weight": weight(config.vocab_size, h),
        "lm_head.weight": weight(config.vocab_size, h),
        "model.norm.weight": torch.ones(h, device=device, dtype=torch.bfloat16),
    }
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        layer = {
            p + "self_attn.q_proj.weight": weight(h, h),
            p + "self_attn.k_proj.weight": weight(kv, h),
            p + "self_attn.v_proj.weight": weight(kv, h),
            p + "self_attn.o_proj.weight": weight(h, h),
            p + "mlp.gate_proj.weight": weight(inter, h),
            p + "mlp.up_proj.weight": weight(inter, h),
            p + "mlp.down_proj.weight": weight(h, inter),
        }
        state |= fp8.quantize_state_dict(layer, per_channel=False)
        state[p + "input_layernorm.weight"] = torch.ones(h, device=device, dtype=torch.bfloat16)
        state[p + "post_attention_layernorm.weight"] = torch.ones(h, device=device, dtype=torch.bfloat16)
    return config, state


def _events_median(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _wall_median(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


@torch.inference_mode()
def measure(model: CompactModel, context: int, reps: int, graphs: bool) -> dict:
    """Seconds of a pass of k+1 rows at position `context` on a cache holding `context` tokens, per k in KS."""
    vocab = model.vocab_size
    ids = torch.randint(0, vocab, (context + max(KS) + 1,), generator=torch.Generator().manual_seed(1)).tolist()
    kv = model.new_kv(context + max(KS) + 1)
    model.forward([Segment(ids[:context], 0, kv, 1)])
    out = {"eager": {}, "graph": {}}
    for k in KS:
        segment = Segment(ids[context : context + k + 1], context, kv, k + 1)
        for _ in range(3):
            model.forward([segment])
        out["eager"][k] = _wall_median(lambda: model.forward([segment]), reps)
        if not graphs:
            continue
        prepared = model.prepare([segment])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                model.run(prepared)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = model.run(prepared)
        eager_logits = model.run(prepared).float()
        graph.replay()
        torch.cuda.synchronize()
        # the replay computes what the eager pass computes (same kernels, same inputs)
        out.setdefault("graph_max_abs_diff", {})[k] = float((logits.float() - eager_logits).abs().max())
        out["graph"][k] = _wall_median(lambda: (graph.replay(), logits.float().cpu()), reps)
        del graph, logits
    return out


@torch.inference_mode()
def measure_served(model: PagedModel, context: int, reps: int, batches: list[int]) -> dict:
    """Seconds of the served engine's pass of `b` sequences of k+1 rows each at position `context`, per (b, k)."""
    vocab = model.vocab_size
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, vocab, (context + max(KS) + 1,), generator=gen).tolist() for _ in range(max(batches))]
    kvs = [model.new_kv(context + max(KS) + 1) for _ in seqs]
    for ids, kv in zip(seqs, kvs):
        model.forward([Segment(ids[:context], 0, kv, 1)])
    out = {}
    for b in batches:
        for k in KS:
            segments = [Segment(ids[context : context + k + 1], context, kv, k + 1) for ids, kv in zip(seqs, kvs)][:b]
            for _ in range(3):
                model.forward(segments)
            out[b, k] = _wall_median(lambda: model.forward(segments), reps)
            # the host copy of the pass's logits alone (every row's, float32), which grows with rows x vocabulary
            out["copy", b, k] = _wall_median(lambda: model.logits_to_host(b * (k + 1)), reps)
    return out


def as_compact(model: PagedModel) -> CompactModel:
    """The same weights under the compact model's own forward and caches (no second copy on the device)."""
    compact = copy.copy(model)
    compact.__class__ = CompactModel
    return compact


LLAMA8B_PRODUCTS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


@torch.inference_mode()
def products(reps: int) -> list[dict]:
    """One decoder layer's products of the 8B shape at 1, 4 and 9 rows, each timed as a CUDA graph of 20 calls:
    the bfloat16 product (F.linear), the FP8 product alone (`torch._scaled_mm` on activations already in E4M3),
    and kernels.Fp8Linear as the engine calls it (the per-token activation quantization included)."""
    from trtspec.engine import kernels

    out = []
    for name, (n, k) in LLAMA8B_PRODUCTS.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        q, scale = fp8.quantize(w)
        linear = kernels.Fp8Linear(q, scale, None, torch.bfloat16)
        for m in (1, 4, 9):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = x.to(fp8.FP8_DTYPE), torch.ones(m, 1, device="cuda")
            variants = {
                "bf16 F.linear": lambda: torch.nn.functional.linear(x, w),
                "fp8 _scaled_mm": lambda: torch._scaled_mm(
                    xq, linear.weight_t, scale_a=xs, scale_b=linear.scale_b, out_dtype=torch.bfloat16
                ),
                "fp8 Fp8Linear": lambda: linear(x),
            }
            row = {"product": name, "n": n, "k": k, "rows": m}
            for label, fn in variants.items():
                fn()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(20):
                        fn()
                seconds = _events_median(graph.replay, reps) / 20
                nbytes = n * k * (2 if label.startswith("bf16") else 1)
                row[label] = {"us": seconds * 1e6, "weight_tb_s": nbytes / seconds / 1e12}
            out.append(row)
        del w, q, linear
    return out


def report_rows(name: str, model: CompactModel, times: dict, served: dict, bandwidth: float) -> list[dict]:
    bound = model.weight_bytes / bandwidth
    rows = []
    for k in KS:
        row = {
            "model": name,
            "k": k,
            "rows": k + 1,
            "weight_bytes": model.weight_bytes,
            "bound_ms": bound * 1e3,
            "eager_ms": times["eager"][k] * 1e3,
            "eager_x_bound": times["eager"][k] / bound,
            "eager_x_decode": times["eager"][k] / times["eager"][0],
        }
        if times["graph"]:
            row |= {
                "graph_ms": times["graph"][k] * 1e3,
                "graph_x_bound": times["graph"][k] / bound,
                "graph_x_decode": times["graph"][k] / times["graph"][0],
                "graph_max_abs_diff": times["graph_max_abs_diff"][k],
            }
        for key, seconds in served.items():
            if key[0] == "copy" and key[2] == k:
                row[f"logits_copy_b{key[1]}_ms"] = seconds * 1e3
            elif key[0] != "copy" and key[1] == k:
                b = key[0]
                row[f"served_b{b}_ms"] = seconds * 1e3
                row[f"served_b{b}_x_decode"] = seconds / served[b, 0]
        rows.append(row)
    return rows


def table(rows: list[dict], bandwidth: float) -> Table:
    t = Table(
        title=f"passes of k+1 rows on a cached context; bound = weight bytes / copy bandwidth {bandwidth / 1e12:.2f} "
        "TB/s"
    )
    for col in (
        "model",
        "k",
        "weights MB",
        "bound ms",
        "eager ms",
        "x bound",
        "x decode",
        "graph ms",
        "x bound",
        "x decode",
        "served ms (x decode) at batch " + ", ".join(str(b) for b in batches(rows)),
    ):
        t.add_column(col, justify="right")
    for r in rows:
        graph = (
            [f"{r['graph_ms']:.3f}", f"{r['graph_x_bound']:.2f}", f"{r['graph_x_decode']:.3f}"]
            if "graph_ms" in r
            else ["-"] * 3
        )
        t.add_row(
            r["model"],
            str(r["k"]),
            f"{r['weight_bytes'] / 1e6:.0f}",
            f"{r['bound_ms']:.3f}",
            f"{r['eager_ms']:.3f}",
            f"{r['eager_x_bound']:.2f}",
            f"{r['eager_x_decode']:.3f}",
            *graph,
            "; ".join(f"{r[f'served_b{b}_ms']:.3f} ({r[f'served_b{b}_x_decode']:.2f})" for b in batches(rows)),
        )
    return t


def batches(rows: list[dict]) -> list[int]:
    return sorted(
        {
            int(key[len("served_b") : -len("_ms")])
            for r in rows
            for key in r
            if key.endswith("_ms") and key.startswith("served_b")
        }
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=Path, help="engine dir holding target/ (the demo pair)")
    p.add_argument("--llama8b", action="store_true", help="also a random-weight Llama-3-8B-shaped model, FP8")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--batches", default="1,4,8", help="sequences per served pass, e.g. 1,4,8 (the engine's batch)")
    p.add_argument(
        "--products",
        action="store_true",
        help="also time one 8B layer's products alone: bf16, FP8, FP8 as the engine calls it",
    )
    p.add_argument("--output", type=Path, default=Path("gpu-engine.json"))
    p.add_argument("--bf16-only", action="store_true", help="leave out the FP8-product variants")
    args = p.parse_args(argv)
    served_batches = [int(b) for b in args.batches.split(",")]
    console = Console()
    if not torch.cuda.is_available():
        console.print("no CUDA device: this benchmark measures the engine on a GPU")
        return 2
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    bandwidth = copy_bandwidth()
    console.print(
        f"{props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB; torch "
        f"{torch.__version__}; "
        f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + written)",
        highlight=False,
    )
    rows, models, product_rows = [], [], []
    if args.products:
        product_rows = products(args.reps)
        t = Table(title="one layer's products of the 8B shape, each a graph of 20 calls: microseconds (weight TB/s)")
        for col in ("product", "rows", "bf16 F.linear", "fp8 _scaled_mm", "fp8 Fp8Linear"):
            t.add_column(col, justify="right")
        for r in product_rows:
            t.add_row(
                f"{r['product']} {r['n']}x{r['k']}",
                str(r["rows"]),
                *(
                    f"{r[v]['us']:.1f} ({r[v]['weight_tb_s']:.2f})"
                    for v in ("bf16 F.linear", "fp8 _scaled_mm", "fp8 Fp8Linear")
                ),
            )
        console.print(t)
    if args.engines:
        models += [
            (
                "demo target fp8",
                lambda: (
                    Engine.load(
                        args.engines / "target",
                        device="cuda",
                        dtype="bfloat16",
                        fp8_matmul=True,
                        check_invariance=False,
                    ).model
                ),
            ),
            (
                "demo target bf16",
                lambda: (
                    Engine.load(args.engines / "target", device="cuda", dtype="bfloat16", check_invariance=False).model
                ),
            ),
        ]
        models = [m for m in models if not args.bf16_only or "bf16" in m[0]]
    if args.llama8b:

        def llama(fp8_matmul: bool):
            config, state = llama8b_state(device)
            model = PagedModel(
                config,
                state,
                dtype=torch.bfloat16,
                device=device,
                fp8_matmul=fp8_matmul,
                max_positions=args.context + 2 * max(KS) + 2,
                graphs=not args.no_graphs,
            )
            del state
            model.reserve(2 << 30, max(served_batches), max(KS) + 1)  # 2 GiB of KV: 16k positions of this shape
            return model

        models += [("llama-3-8b-shape fp8", lambda: llama(True)), ("llama-3-8b-shape bf16", lambda: llama(False))]
        models = [m for m in models if not args.bf16_only or "bf16" in m[0]]
    for name, load in models:
        started = time.perf_counter()
        model = load()
        gc.collect()
        torch.cuda.empty_cache()
        console.print(
            f"{name}: loaded in {time.perf_counter() - started:.1f} s, {model.weight_bytes / 1e9:.2f} GB of weights "
            f"read per pass; {model.kernel_summary}",
            highlight=False,
        )
        served = measure_served(
            model, args.context, args.reps, [b for b in served_batches if b <= model.buckets.sequences[-1]]
        )
        eager = measure(as_compact(model), args.context, args.reps, not args.no_graphs)
        rows += report_rows(name, model, eager, served, bandwidth)
        console.print(table([r for r in rows if r["model"] == name], bandwidth))
        del model
        gc.collect()
        torch.cuda.empty_cache()
    args.output.write_text(
        json.dumps(
            {
                "command": " ".join([Path(sys.executable).name] + sys.argv),
                "device": props.name,
                "torch": torch.__version__,
                "copy_bandwidth_bytes_per_s": bandwidth,
                "context": args.context,
                "reps": args.reps,
                "rows": rows,
                "products": product_rows,
            },
            indent=2,
        )
        + "\n"
    )
    console.print(table(rows, bandwidth))
    return 0


if __name__ == "__main__":
    sys.exit(main())
