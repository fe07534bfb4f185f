"""HF checkpoint -> TensorRT-LLM checkpoint, through TensorRT-LLM's own Python API; run as a build step:

    python -m trtspec.compile.trtllm_checkpoint quantize --model_dir M --qformat fp8 --kv_cache_dtype fp8 ... \\
        --output_dir C
    python -m trtspec.compile.trtllm_checkpoint convert --model_dir M --dtype bfloat16 --tp_size 4 --output_dir C

`quantize` takes the flags of TensorRT-LLM's examples/quantization/quantize.py and calls the function that script
calls, `tensorrt_llm.quantization.quantize_and_export` (ModelOpt calibration, then a TensorRT-LLM checkpoint with
`mapping` for tp/pp). `convert` does what a model's convert_checkpoint.py does without quantization: per rank,
`<ModelClass>.from_hugging_face(model_dir, dtype, mapping=Mapping(...))` then `.save_checkpoint(output_dir)`.
The example scripts are not part of the tensorrt_llm wheel, which is why trtspec carries this runner; the build
config's `trtllm.quantize_script` / `trtllm.convert_script` run NVIDIA's scripts instead, with the same flags.

Only this module imports tensorrt_llm, and only when it runs.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from pathlib import Path

# quantize.py's flags and defaults (examples/quantization/quantize.py, 0.2x-1.x).
QUANTIZE_DEFAULTS = {
    "device": "cuda",
    "device_map": "auto",
    "calib_dataset": "cnn_dailymail",
    "dtype": "auto",
    "qformat": "full_prec",
    "kv_cache_dtype": None,
    "calib_size": 512,
    "batch_size": 1,
    "calib_max_seq_length": 512,
    "awq_block_size": 128,
    "tp_size": 1,
    "pp_size": 1,
    "cp_size": 1,
    "seed": 1234,
    "tokenizer_max_seq_length": 2048,
    "quantize_lm_head": False,
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m trtspec.compile.trtllm_checkpoint", description=__doc__.splitlines()[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    q = commands.add_parser("quantize", help="ModelOpt quantization (quantize.py's flags)")
    q.add_argument("--model_dir", required=True)
    q.add_argument("--output_dir", required=True)
    q.add_argument("--dtype", default="auto", choices=["auto", "float16", "bfloat16", "float32"])
    q.add_argument("--qformat", default="full_prec")
    q.add_argument("--kv_cache_dtype", default=None, choices=["int8", "fp8"])
    q.add_argument("--calib_dataset", default=QUANTIZE_DEFAULTS["calib_dataset"])
    for name in (
        "calib_size",
        "batch_size",
        "calib_max_seq_length",
        "tp_size",
        "pp_size",
        "cp_size",
        "seed",
        "tokenizer_max_seq_length",
        "awq_block_size",
    ):
        q.add_argument(f"--{name}", type=int, default=QUANTIZE_DEFAULTS[name])
    q.add_argument("--quantize_lm_head", action="store_true", help="the output head in FP8 too")
    q.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    q.add_argument("--device_map", default="auto", choices=["auto", "sequential", "cpu", "gpu"])
    c = commands.add_parser("convert", help="plain conversion (convert_checkpoint.py's flags)")
    c.add_argument("--model_dir", required=True)
    c.add_argument("--output_dir", required=True)
    c.add_argument("--dtype", default="auto", choices=["auto", "float16", "bfloat16", "float32"])
    c.add_argument("--tp_size", type=int, default=1)
    c.add_argument("--pp_size", type=int, default=1)
    return parser.parse_args(argv)


def quantize_kwargs(args: argparse.Namespace, signature: inspect.Signature) -> dict:
    """quantize.py's arguments for the installed `quantize_and_export`, whose parameter list changed between releases
    (keyword-only; later ones add cp_size, medusa and export options): pass the ones it takes, fail on a required one
    trtspec cannot fill."""
    values = {**QUANTIZE_DEFAULTS, **{k: v for k, v in vars(args).items() if k != "command"}}
    kwargs, missing = {}, []
    for name, param in signature.parameters.items():
        if name in values:
            kwargs[name] = values[name]
        elif param.default is inspect.Parameter.empty and param.kind not in (param.VAR_KEYWORD, param.VAR_POSITIONAL):
            missing.append(name)
    if values["quantize_lm_head"] and "quantize_lm_head" not in signature.parameters:
        raise SystemExit(
            "this TensorRT-LLM's quantize_and_export has no quantize_lm_head: upgrade TensorRT-LLM, or drop "
            "quantize_lm_head from the build config"
        )
    if missing:
        raise SystemExit(
            f"this TensorRT-LLM's quantize_and_export needs {', '.join(missing)}, which trtspec does not "
            "know how to fill: set trtllm.quantize_script to its examples/quantization/quantize.py"
        )
    return kwargs


def quantize(args: argparse.Namespace) -> None:
    import torch.multiprocessing as mp
    from tensorrt_llm.quantization import quantize_and_export

    mp.set_start_method("spawn", force=True)  # as quantize.py does
    quantize_and_export(**quantize_kwargs(args, inspect.signature(quantize_and_export)))


def convert(args: argparse.Namespace) -> None:
    from tensorrt_llm.mapping import Mapping
    from tensorrt_llm.models import MODEL_MAP

    config = json.loads((Path(args.model_dir) / "config.json").read_text())
    architecture = (config.get("architectures") or ["?"])[0]
    if architecture not in MODEL_MAP:
        raise SystemExit(f"TensorRT-LLM has no model class for {architecture}; set trtllm.convert_script")
    model_cls = MODEL_MAP[architecture]
    world_size = args.tp_size * args.pp_size
    for rank in range(world_size):
        mapping = Mapping(world_size=world_size, rank=rank, tp_size=args.tp_size, pp_size=args.pp_size)
        model = model_cls.from_hugging_face(args.model_dir, args.dtype, mapping=mapping)
        model.save_checkpoint(args.output_dir, save_config=(rank == 0))
        del model
        print(f"rank {rank + 1}/{world_size} written to {args.output_dir}", flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    {"quantize": quantize, "convert": convert}[args.command](args)


if __name__ == "__main__":
    main()
