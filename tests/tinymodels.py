"""Tiny random-weight checkpoints and tokenizers for tests, built with `transformers` and
`tokenizers` (nothing is downloaded), plus transformers-side reference outputs."""
from __future__ import annotations

import json

import torch

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=211, max_position_embeddings=512)

ARCH_CONFIGS = {
    # Llama 3 style: GQA and llama3 rope scaling
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}, rope_theta=500000.0)),
    "llama_linear": ("LlamaConfig", "LlamaForCausalLM", dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=256, head_dim=32,
                                                              num_attention_heads=4, hidden_size=96)),
}


def build_checkpoint(path, arch: str = "llama", seed: int = 0, **overrides):
    """overrides: config fields, and save_dtype ("bfloat16": the weights saved as most published
    checkpoints are; float32 by default)."""
    import transformers

    save_dtype = overrides.pop("save_dtype", None)

    cfg_name, model_name, extra = ARCH_CONFIGS[arch]
    config = getattr(transformers, cfg_name)(**{**TINY, **extra, **overrides})
    config.eos_token_id = overrides.get("eos_token_id", 2)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    with torch.no_grad():  # random init is small; widen it so logits have real spread
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    if save_dtype is not None:
        model.to(getattr(torch, save_dtype))
    model.save_pretrained(path)
    return path


def hf_model(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    model = hf_model(path)
    outs = []
    for ids in prompts:
        with torch.no_grad():
            x = torch.tensor([ids])
            gen = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0, min_new_tokens=max_new_tokens)
        outs.append(gen[0, len(ids):].tolist())
    return outs


TOKENIZER_CORPUS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "import os\nimport sys\n\nclass Foo:\n    pass\n",
    "héllo wörld — naïve café ✓ 你好 🙂\n",
] * 20


DEFAULT_SPECIALS = (("bos_token", "<|bos|>"), ("eos_token", "<|eos|>"), ("pad_token", "<|pad|>"))


def build_tokenizer(path, vocab_size: int = 300, specials=DEFAULT_SPECIALS):
    """A tiny byte-level BPE tokenizer, saved HF-style; `specials` are (role, token) pairs that
    take ids 0, 1, 2, … in order."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[t for _, t in specials],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TOKENIZER_CORPUS, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {**dict(specials), "tokenizer_class": "PreTrainedTokenizerFast"}))
    return tok


