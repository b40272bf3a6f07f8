"""Checks the shipped demo model pair under models/: it loads, shares one tokenizer,
has the sizes DESIGN.md promises and generates text. Written against the committed
checkpoints, so a retrain that breaks any of this fails here before it reaches the engine.
"""

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, LlamaForCausalLM

MODELS_DIR = Path(__file__).resolve().parents[2] / "models"
TARGET_DIR = MODELS_DIR / "demo"
DRAFT_DIR = MODELS_DIR / "demo-draft"
SNIPPET = (
    "class Stack:\n"
    "    \"\"\"LIFO — with ünïcode and an emoji 🐍.\"\"\"\n"
    "\n"
    "\tdef push(self, x):  # tab-indented on purpose\r\n"
    "        self._items.append(x ** 2)\n"
)


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    return AutoModelForCausalLM.from_pretrained(TARGET_DIR).eval()


@pytest.fixture(scope="module")
def draft() -> LlamaForCausalLM:
    return AutoModelForCausalLM.from_pretrained(DRAFT_DIR).eval()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(TARGET_DIR / "tokenizer.json"))


def num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_checkpoints_load_as_bf16_llama(target, draft):
    for model in (target, draft):
        assert isinstance(model, LlamaForCausalLM)
        assert model.dtype == torch.bfloat16
    assert target.config.num_key_value_heads < target.config.num_attention_heads  # GQA


def test_tokenizer_round_trips_python(tokenizer):
    ids = tokenizer.encode(SNIPPET).ids
    assert len(ids) < len(SNIPPET.encode())  # BPE merged something
    assert tokenizer.decode(ids) == SNIPPET


def test_models_share_one_tokenizer(target, draft, tokenizer):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (TARGET_DIR / name).read_bytes() == (DRAFT_DIR / name).read_bytes()
    for model in (target, draft):
        assert model.config.vocab_size == tokenizer.get_vocab_size()
        assert model.config.eos_token_id == tokenizer.token_to_id("<|eos|>")
        assert model.config.bos_token_id == tokenizer.token_to_id("<|bos|>")
        assert model.config.pad_token_id == tokenizer.token_to_id("<|pad|>")
    assert target.config.max_position_embeddings == draft.config.max_position_embeddings


def test_tokenizer_config_names_special_tokens():
    config = json.loads((TARGET_DIR / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == (
        "<|bos|>", "<|eos|>", "<|pad|>")


def test_parameter_counts_in_range(target, draft):
    assert 8e6 <= num_params(target) <= 20e6
    assert 1e6 <= num_params(draft) <= 3e6


def test_train_report_describes_the_pair(target, draft):
    report = json.loads((TARGET_DIR / "train_report.json").read_text())
    assert report["target"]["num_params"] == num_params(target)
    assert report["draft"]["num_params"] == num_params(draft)
    assert 0.0 <= report["agreement_rate"] <= 1.0
    assert report["target_loss_per_token"] > 0 and report["draft_loss_per_token"] > 0


def test_pdserve_continues_a_prompt_with_text(tokenizer):
    """Through pdserve, each model continues a prompt with real text: new tokens, decoded by the
    shared tokenizer to what the engine reports, without replacement characters."""
    from pdserve.engine import LLM, SamplingParams

    for path in (TARGET_DIR, DRAFT_DIR):
        out = LLM(path).generate(["def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=12))[0]
        assert out.token_ids and out.finish_reason is not None
        assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)
        assert out.text.strip() and "\ufffd" not in out.text
