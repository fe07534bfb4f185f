"""Tiny random-weight checkpoints with a real tokenizer, made on the spot (no downloads)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts tokens with a small model and verifies them with a large one.",
    "def add(a, b):\n    return a + b\n",
    "Triton serves models over HTTP and gRPC; metrics are exported for Prometheus.",
    "Once upon a time there was a tiny model that answered every question with numbers: 1 2 3 4 5.",
]


def make_tokenizer(path: Path, vocab_size: int = 320, corpus: list[str] | None = None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((corpus or CORPUS) * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")
    fast.save_pretrained(str(path))
    return fast


def make_checkpoint(
    path: Path,
    *,
    layers: int = 2,
    hidden: int = 64,
    vocab_size: int = 320,
    seed: int = 0,
    heads: int = 4,
    kv_heads: int = 2,
    tokenizer: bool = True,
    architecture: str = "llama",
    init_range: float = 0.2,
    corpus: list[str] | None = None,
    model_vocab_size: int | None = None,
) -> Path:
    """A random-weight causal LM saved as a Hugging Face checkpoint (safetensors) with a BPE tokenizer.

    `corpus` trains the tokenizer on other text (other token ids); `model_vocab_size` pads the embedding
    beyond the tokenizer's `vocab_size` (same tokens, different vocab_size, as real checkpoints often do)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    if tokenizer:
        tok = make_tokenizer(path, vocab_size, corpus)
        eos, pad = tok.eos_token_id, tok.pad_token_id
    else:
        eos, pad = 0, 1
    cls, cfg_cls = (Qwen2ForCausalLM, Qwen2Config) if architecture == "qwen2" else (LlamaForCausalLM, LlamaConfig)
    config = cfg_cls(
        vocab_size=model_vocab_size or vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=None,
        tie_word_embeddings=True,
        initializer_range=init_range,
    )
    torch.manual_seed(seed)
    model = cls(config)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def hf_generate(model, prompt, n: int, *, eos: int, **kw):
    """Hugging Face's greedy `generate` (do_sample=False), stopping at `eos` as the engine does, with the tiny
    checkpoints' pad id; `kw` goes on to `generate` (penalties, bad words, logits)."""
    ids = torch.tensor([list(prompt)])
    return model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=1,
        **kw,
    )


def write_config(path: Path, target: Path, draft: Path | None, /, **sections) -> Path:
    """A build config (JSON, which is YAML) for the pair; each keyword is merged into its section
    (`target={...}` and `draft={...}` included)."""
    config = {"name": "tiny", "backend": "torch", "target": {"checkpoint": str(target), "dtype": "float32"}}
    if draft is not None:
        config["draft"] = {"checkpoint": str(draft), "dtype": "float32"}
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = config[key] | value
        else:
            config[key] = value
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


def make_perturbed_copy(source: Path, path: Path, *, noise: float, seed: int = 0) -> Path:
    """A copy of `source` with Gaussian noise on its decoder weights: a draft that agrees with the
    target often but not always (two independent random models almost never agree)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, path)
    weights = path / "model.safetensors"
    state = load_file(str(weights))
    gen = torch.Generator().manual_seed(seed)
    for name, tensor in state.items():
        if ".layers." in name and tensor.ndim == 2:
            state[name] = tensor + noise * tensor.std() * torch.randn(tensor.shape, generator=gen)
    save_file(state, str(weights), metadata={"format": "pt"})
    return path


def make_bigram_copy(source: Path, path: Path) -> Path:
    """A copy of `source` whose decoder layers add nothing (attention and MLP outputs zeroed): each position's
    logits depend on its own token alone, so its greedy text after a token is what followed that token before,
    a target that copies a passage the prompt already holds."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, path)
    weights = path / "model.safetensors"
    state = load_file(str(weights))
    for name in state:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            state[name] = torch.zeros_like(state[name])
    save_file(state, str(weights), metadata={"format": "pt"})
    return path


def make_numbers_blind_pair(root: Path, *, layers: int = 24, hidden: int = 768, seed: int = 0) -> tuple[Path, Path]:
    """A target and, as its draft, its own first layer: speculation pays on a CPU (the draft costs a fraction of
    the target) and acceptance depends on the text, as with real pairs. Tokens with a digit carry a flag (hidden
    dimension 0) that only the target's last layer reads: elsewhere the later layers add nothing (attention
    outputs zeroed, MLPs gated by the flag; computed all the same), so the draft predicts every token after words.
    After a number both models continue with a number: the draft with the same one again, the target with the
    number a fixed derangement of the numbers assigns to it (its last MLP maps each number's hidden state to the
    next number's embedding), so the draft is wrong on every token after a number, whatever the models' size.
    A prompt that ends in numbers is one the draft cannot predict."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    target = make_checkpoint(root / "target", layers=layers, hidden=hidden, seed=seed)
    path = target / "model.safetensors"
    state = load_file(str(path))
    embed = state["model.embed_tokens.weight"]
    tokens = AutoTokenizer.from_pretrained(str(target)).convert_ids_to_tokens(list(range(len(embed))))
    numbers = torch.tensor([i for i, token in enumerate(tokens) if any(c.isdigit() for c in token or "")])
    embed[:, 0] = 0.0
    embed[numbers] *= 0.1  # a number never wins after words (tied embeddings: the LM head)
    embed[numbers, 0] = 50.0  # far above the rest: after a number, a number comes
    last = layers - 1
    for name, w in state.items():
        if name.endswith("o_proj.weight"):
            w.zero_()  # no layer reads the context: each token's state is its own
        elif name.startswith("model.layers.0.") and name.endswith("down_proj.weight"):
            w *= 0.01  # the first layer moves the text along without drowning the flag
            w[0] = 0.0  # and leaves the flag as the token set it
        elif ".layers." in name and name.endswith(("down_proj.weight", "up_proj.weight")):
            w.zero_()
        elif ".layers." in name and name.endswith("gate_proj.weight"):
            w.zero_()
            w[:, 0] = 4.0 / hidden**0.5  # the flag, normalized (about sqrt(hidden)), opens the gate; 0 shuts it
    # the last MLP: up passes dimensions 1.. through, down maps each number's state after the first layer (what
    # the last layer sees: the layers between add nothing) to the embedding of the number that follows it, never
    # the one the draft predicts there
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(target)), dtype=torch.float32)
    model.load_state_dict(state, strict=False)
    with torch.no_grad():
        h = model(numbers[:, None], output_hidden_states=True).hidden_states[1][:, 0]  # after layer 0
        drafted = model.lm_head(model.model.norm(h)).argmax(-1)
        order, follower = numbers.tolist(), []
        for i, d in enumerate(drafted.tolist()):  # the next number in the list that is not the draft's guess
            follower.append(next(m for m in order[i + 1 :] + order[:i] if m != d))
        x = model.model.layers[last].post_attention_layernorm(h)
        g = torch.nn.functional.silu(x[:, :1] * 4.0 / hidden**0.5)
        wanted = embed[torch.tensor(follower), 1:] - h[:, 1:]
        state[f"model.layers.{last}.mlp.up_proj.weight"][1:hidden, 1:] = torch.eye(hidden - 1)
        solution = torch.linalg.lstsq((g * x[:, 1:]).double(), wanted.double(), driver="gelsd").solution
        state[f"model.layers.{last}.mlp.down_proj.weight"][1:, 1:hidden] = solution.T.float()
    save_file(state, str(path), metadata={"format": "pt"})
    draft = root / "draft"
    shutil.copytree(target, draft)
    config = json.loads((draft / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (draft / "config.json").write_text(json.dumps(config))
    save_file(
        {name: w for name, w in state.items() if ".layers." not in name or name.startswith("model.layers.0.")},
        str(draft / "model.safetensors"),
        metadata={"format": "pt"},
    )
    return target, draft


def served_pair(
    root: Path,
    *,
    max_input_len: int = 128,
    overrides: dict | None = None,
    write=None,
    pair=None,
    engine: dict | None = None,
):
    """A 2-layer target and a perturbed copy as its draft (max_draft_len 4), built and deployed under `root`,
    as a TritonServer not yet started. `write(config_path, engines, repo, overrides=...)` writes the repository
    (default: `trtspec deploy`'s write_repository); `pair(root)` makes another (target, draft); `engine` adds to
    the build config's engine section."""
    from trtspec.compile import run_build
    from trtspec.config import load_config
    from trtspec.deploy.writer import write_repository
    from trtspec.server import TritonServer, free_port

    if pair is None:
        target = make_checkpoint(root / "target", layers=2, seed=0)
        draft = make_perturbed_copy(target, root / "draft", noise=0.01)
    else:
        target, draft = pair(root)
    config = write_config(
        root / "build.yaml",
        target,
        draft,
        speculation={"max_draft_len": 4},
        engine={
            "max_input_len": max_input_len,
            "max_seq_len": 2 * max_input_len,
            "gather_context_logits": True,
            "gather_generation_logits": True,
            **(engine or {}),
        },
    )
    engines = run_build(config, root / "engines")
    if write is None:
        repo = write_repository(load_config(config), engines, root / "repo", overrides=overrides or {})
    else:
        repo = write(config, engines, root / "repo", overrides=overrides or {})
    return TritonServer(repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def chat_tokenizer(repo: Path, out: Path) -> Path:
    """The tokenizer a deployed repository's BLS uses, saved to `out` with a tiny chat template (tiny tokenizers
    have none)."""
    import re

    from transformers import AutoTokenizer

    config = (repo / "tensorrt_llm_bls" / "config.pbtxt").read_text()
    source = re.search(r'key: "tokenizer_dir" value: \{ string_value: "([^"]*)" \}', config).group(1)
    tok = AutoTokenizer.from_pretrained(source)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out)
    return out
