"""Tiny random-weight models of every supported architecture, saved as Hugging Face
folders with a small trained tokenizer, for comparing the engine against transformers."""

from __future__ import annotations

from pathlib import Path

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Continuous batching admits new requests between decode steps.",
    "Kubernetes runs containers; an operator reconciles custom resources.",
    "Prefix caching reuses the blocks of a shared system prompt.",
] * 20

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer(folder: Path, vocab_size: int = 320):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        CORPUS, vocab_size=vocab_size, min_frequency=1, special_tokens=["<s>", "</s>", "<pad>"]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(folder)
    return tok


def _config(arch: str, vocab_size: int, **overrides):
    import transformers

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        initializer_range=0.2,
    )
    common.update(overrides)
    cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[arch]
    if arch == "qwen3":
        common.setdefault("head_dim", 32)
    if arch == "mistral":
        common.setdefault("sliding_window", None)
    return cls(**common)


def build_tiny_model(
    folder: Path, arch: str, dtype=torch.float32, seed: int = 0, qk_scale: float = 1.0,
    **overrides,
):
    """Save a random ``arch`` model plus tokenizer into ``folder``; return the HF model.

    ``qk_scale`` multiplies queries and keys (through q/k norms where the architecture has
    them), so attention scores grow by its square: sharp attention, where reading a wrong
    KV block or position shows in the logits instead of averaging away."""
    import transformers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(folder)
    # vocab_size may exceed the tokenizer's (an odd size, say): ids past it are unused.
    config = _config(arch, overrides.pop("vocab_size", len(tok)), **overrides)
    torch.manual_seed(seed)
    model_cls = {
        "llama": transformers.LlamaForCausalLM,
        "mistral": transformers.MistralForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
    }[arch]
    model = model_cls(config).to(dtype).eval()
    if arch == "qwen2":
        # Fresh models start with zero biases; make them matter.
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.2)
    if qk_scale != 1.0:
        with torch.no_grad():
            for layer in model.model.layers:
                attn = layer.self_attn
                scaled = [attn.q_norm, attn.k_norm] if hasattr(attn, "q_norm") else [
                    attn.q_proj, attn.k_proj]  # fmt: skip
                for module in scaled:
                    module.weight.mul_(qk_scale)
                    if getattr(module, "bias", None) is not None:
                        module.bias.mul_(qk_scale)
    model.save_pretrained(folder)
    return model


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own greedy generate, one prompt at a time (no padding effects)."""
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=2,
            )
        outs.append(gen[0, len(prompt) :].tolist())
    return outs


def build_successor_model(
    folder: Path, successors: dict[int, int], added_tokens: list[str] = (), seed: int = 0
):
    """A tiny llama whose greedy next token is ``successors[last token]``: every layer's
    output projections are zero, so the final hidden state is the current token's
    (normalised) embedding, and the LM head row of ``successors[t]`` is token t's embedding.
    Random unit embeddings in 64 dimensions are nearly orthogonal, so that row wins by a wide
    margin. ``added_tokens`` join the tokenizer (ids from 320 up) before the model is sized.
    Returns (tokenizer, hf_model)."""
    from transformers import AutoTokenizer

    folder = Path(folder)
    model = build_tiny_model(folder, "llama", vocab_size=384, seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if added_tokens:
        tokenizer.add_tokens(list(added_tokens))
        tokenizer.save_pretrained(folder)
    assert len(tokenizer) <= 384
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        embed = torch.randn(384, 64, generator=generator)
        embed /= embed.norm(dim=1, keepdim=True)
        model.model.embed_tokens.weight.copy_(embed)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = torch.zeros(384, 64)
        for token, successor in successors.items():
            head[successor] += embed[token]
        model.lm_head.weight.copy_(head)
    model.save_pretrained(folder)
    return tokenizer, model


def build_eagle_head(
    folder: Path, target_folder: Path, seed: int = 0, qk_scale: float = 1.0,
    fc: torch.Tensor | None = None, fc_bias: bool = True, zero_outputs: bool = False,
    embed_copy: bool = True, bin_format: bool = False, num_layers: int = 1,
) -> dict[str, torch.Tensor]:
    """An EAGLE-1/2 head for the target in ``target_folder``, written in the layout the
    EAGLE authors publish: its config.json (the target's, with ``num_layers`` layers) and
    weights ``fc.weight`` (H x 2H), ``fc.bias``, ``layers.N.*`` without layer 0's
    ``input_layernorm``, a copy of the target's ``embed_tokens.weight`` (``embed_copy``);
    safetensors, or ``pytorch_model.bin`` as published (``bin_format``). ``qk_scale``
    sharpens attention (so that a wrong KV position shows); ``fc`` replaces the random
    fusion; ``zero_outputs`` zeroes o_proj and down_proj (the layer passes its input
    through). Returns the tensors (names as saved)."""
    import json

    from safetensors.torch import load_file, save_file

    folder, target_folder = Path(folder), Path(target_folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = json.loads((target_folder / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (folder / "config.json").write_text(json.dumps(config))
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    dim = hidden // heads
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, std):
        return torch.randn(*shape, generator=gen) * std

    tensors = {"fc.weight": rand(hidden, 2 * hidden, std=(2 * hidden) ** -0.5) if fc is None
               else fc.clone()}  # fmt: skip
    if fc_bias:
        tensors["fc.bias"] = rand(hidden, std=0.1)
    out_std = 0.0 if zero_outputs else 0.3
    for i in range(num_layers):
        p = f"layers.{i}."
        if i > 0:
            tensors[p + "input_layernorm.weight"] = 1 + rand(hidden, std=0.1)
        tensors[p + "post_attention_layernorm.weight"] = 1 + rand(hidden, std=0.1)
        tensors[p + "self_attn.q_proj.weight"] = rand(heads * dim, hidden, std=0.2 * qk_scale)
        tensors[p + "self_attn.k_proj.weight"] = rand(kv_heads * dim, hidden, std=0.2 * qk_scale)
        tensors[p + "self_attn.v_proj.weight"] = rand(kv_heads * dim, hidden, std=0.2)
        tensors[p + "self_attn.o_proj.weight"] = rand(hidden, heads * dim, std=out_std)
        tensors[p + "mlp.gate_proj.weight"] = rand(inter, hidden, std=0.2)
        tensors[p + "mlp.up_proj.weight"] = rand(inter, hidden, std=0.2)
        tensors[p + "mlp.down_proj.weight"] = rand(hidden, inter, std=out_std)
    if embed_copy:
        (weights,) = target_folder.glob("*.safetensors")
        tensors["embed_tokens.weight"] = load_file(weights)["model.embed_tokens.weight"]
    tensors = {name: t.contiguous() for name, t in tensors.items()}
    if bin_format:
        torch.save(tensors, folder / "pytorch_model.bin")
    else:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return tensors


def eagle3_draft_targets(vocab: int, draft_vocab: int) -> torch.Tensor:
    """The target id of each draft id in ``build_eagle3_head``'s heads: the 32 lowest ids
    as they are, then every other id (so that ``d2t`` is not all zeros)."""
    ids = torch.arange(draft_vocab)
    return torch.where(ids < 32, ids, 32 + 2 * (ids - 32)) % vocab


def build_eagle3_head(
    folder: Path, target_folder: Path, seed: int = 0, draft_vocab: int | None = None,
    qk_scale: float = 1.0, zero_outputs: bool = False, embed_copy: bool = False,
    aux_layers: list[int] | None = None, norm_before_residual: bool = False,
    fc: torch.Tensor | None = None, lm_head: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """An EAGLE-3 head for the target in ``target_folder``, in the layout the EAGLE authors
    publish: config.json (the target's Llama shape, one layer, architecture
    ``LlamaForCausalLMEagle3``, ``draft_vocab_size``, optionally
    ``eagle_config.eagle_aux_hidden_state_layer_ids``) and ``model.safetensors`` with
    ``fc.weight`` (H x 3H), ``midlayer.*`` (q/k/v 2H wide, ``hidden_norm``), ``norm.weight``,
    ``lm_head.weight`` over ``draft_vocab`` ids, ``d2t`` (draft id -> target id offset:
    ``eagle3_draft_targets``, not the identity) and ``t2d``. ``fc`` and ``lm_head``
    replace the random ones; ``zero_outputs`` zeroes o_proj and down_proj (the layer then
    passes its feature through). Returns the tensors (names as saved)."""
    import json

    from safetensors.torch import load_file, save_file

    folder, target_folder = Path(folder), Path(target_folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = json.loads((target_folder / "config.json").read_text())
    vocab = config["vocab_size"]
    draft_vocab = draft_vocab or vocab // 2
    config.update(num_hidden_layers=1, architectures=["LlamaForCausalLMEagle3"],
                  model_type="llama", draft_vocab_size=draft_vocab,
                  norm_before_residual=norm_before_residual)  # fmt: skip
    if aux_layers is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layers}
    (folder / "config.json").write_text(json.dumps(config))
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    dim = config.get("head_dim") or hidden // heads
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, std):
        return torch.randn(*shape, generator=gen) * std

    out_std = 0.0 if zero_outputs else 0.3
    m = "midlayer."
    targets = eagle3_draft_targets(vocab, draft_vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[targets] = True
    tensors = {
        "fc.weight": rand(hidden, 3 * hidden, std=(3 * hidden) ** -0.5) if fc is None
        else fc.clone(),
        m + "input_layernorm.weight": 1 + rand(hidden, std=0.1),
        m + "hidden_norm.weight": 1 + rand(hidden, std=0.1),
        m + "post_attention_layernorm.weight": 1 + rand(hidden, std=0.1),
        m + "self_attn.q_proj.weight": rand(heads * dim, 2 * hidden, std=0.2 * qk_scale),
        m + "self_attn.k_proj.weight": rand(kv_heads * dim, 2 * hidden, std=0.2 * qk_scale),
        m + "self_attn.v_proj.weight": rand(kv_heads * dim, 2 * hidden, std=0.2),
        m + "self_attn.o_proj.weight": rand(hidden, heads * dim, std=out_std),
        m + "mlp.gate_proj.weight": rand(inter, hidden, std=0.2),
        m + "mlp.up_proj.weight": rand(inter, hidden, std=0.2),
        m + "mlp.down_proj.weight": rand(hidden, inter, std=out_std),
        "norm.weight": 1 + rand(hidden, std=0.1),
        "lm_head.weight": rand(draft_vocab, hidden, std=hidden**-0.5 * 4) if lm_head is None
        else lm_head.clone(),
        "d2t": targets - torch.arange(draft_vocab),
        "t2d": t2d,
    }
    if embed_copy:
        (weights,) = target_folder.glob("*.safetensors")
        tensors["embed_tokens.weight"] = load_file(weights)["model.embed_tokens.weight"]
    tensors = {name: t.contiguous() for name, t in tensors.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return tensors


def build_successor_eagle3_head(folder: Path, target_folder: Path, model, successors: dict):
    """An EAGLE-3 head for ``build_successor_model``'s target that drafts the token after
    next: that model's residual stream is each token's embedding at every layer, so
    ``fc = [I, 0, 0]`` makes the feature at p the embedding of token p, a layer passing it
    through (``zero_outputs``) hands it to the LM head, whose row for
    ``successors[successors[t]]`` is token t's embedding. One draft a step is then always
    accepted; further drafts (fed the same feature back) are not."""
    embed = model.model.embed_tokens.weight.detach()
    vocab, hidden = embed.shape
    draft_vocab = vocab // 2
    draft_of = {int(t): i for i, t in enumerate(eagle3_draft_targets(vocab, draft_vocab))}
    rows = torch.zeros(draft_vocab, hidden)
    for token, successor in successors.items():
        rows[draft_of[successors[successor]]] += embed[token]
    fc = torch.cat([torch.eye(hidden), torch.zeros(hidden, 2 * hidden)], dim=1)
    build_eagle3_head(folder, target_folder, draft_vocab=draft_vocab, zero_outputs=True,
                      aux_layers=[1, 1, 1], fc=fc, lm_head=rows)
