"""Trains the demo model pair: one shared tokenizer, a target and a draft model.

This script owns everything under models/demo and models/demo-draft. It reads the
Python standard library's own source (present on every machine with Python), holds out
~3% of files by a hash of their path, and then:

    corpus ──► byte-level BPE tokenizer ──► target (cross-entropy)
                                        └─► draft  (cross-entropy + KL to the saved target)
    held-out files ──► loss per token of each model, draft/target greedy agreement

Training is budgeted by wall clock (the machine is shared), so the number of steps is
recorded rather than fixed; everything else is seeded. Run it as a script:

    .venv/bin/python models/train.py [--target-minutes 16] [--draft-minutes 9]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import platform
import random
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# OpenMP threads that spin while waiting starve each other when other processes share the
# CPU: measured 118 tok/s spinning vs 950 passive on this 2-core box under load. Must be
# set before torch loads its OpenMP runtime.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from tqdm import tqdm  # noqa: E402
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402

log = logging.getLogger("train")

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
VOCAB_SIZE = 4096
MAX_POSITION_EMBEDDINGS = 2048
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages"}
HELD_OUT_PER_MILLE = 30


@dataclass(slots=True)
class TrainArgs:
    out: Path
    seed: int
    target_minutes: float
    draft_minutes: float
    seq_len: int
    batch_size: int
    distill_weight: float

    def __post_init__(self) -> None:
        if self.seq_len > MAX_POSITION_EMBEDDINGS:
            raise ValueError(f"seq_len must be <= {MAX_POSITION_EMBEDDINGS}")
        if not 0.0 <= self.distill_weight <= 1.0:
            raise ValueError("distill_weight must be in [0, 1]")


@dataclass(slots=True)
class Corpus:
    train_texts: list[str]
    eval_texts: list[str]


@dataclass(slots=True)
class RunStats:
    num_params: int
    num_steps: int
    num_tokens: int
    minutes: float
    final_train_loss: float


# ---------------------------------------------------------------- corpus


def is_held_out(rel_path: str) -> bool:
    """A stable ~3% of files, chosen by path so it does not move when files are added."""
    digest = hashlib.sha256(rel_path.encode()).digest()
    return int.from_bytes(digest[:8], "big") % 1000 < HELD_OUT_PER_MILLE


def list_source_files(root: Path) -> list[Path]:
    paths = (p for p in root.rglob("*.py") if p.is_file())
    kept = [p for p in paths if not EXCLUDED_DIRS & set(p.relative_to(root).parts[:-1])]
    return sorted(kept, key=lambda p: p.relative_to(root).as_posix())


def load_corpus(root: Path) -> Corpus:
    corpus = Corpus(train_texts=[], eval_texts=[])
    for path in list_source_files(root):
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # a handful of stdlib files are deliberately not UTF-8
        rel_path = path.relative_to(root).as_posix()
        (corpus.eval_texts if is_held_out(rel_path) else corpus.train_texts).append(text)
    return corpus


# ---------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[BOS, EOS, PAD],  # ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


# The model knows only Python source, so a conversation is shown to it as a module docstring
# ("role: content" lines) followed by "def ", which it continues as code.
CHAT_TEMPLATE = ("{{ '\"\"\"\\n' }}"
                 "{%- for message in messages -%}{{ message['role'] ~ ': ' ~ message['content'] ~ '\\n' }}{%- endfor -%}"
                 "{{ '\"\"\"\\n' }}"
                 "{%- if add_generation_prompt -%}{{ '\\ndef ' }}{%- endif -%}")


def save_tokenizer(tokenizer: Tokenizer, folder: Path) -> None:
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def encode_documents(tokenizer: Tokenizer, texts: list[str]) -> torch.Tensor:
    """One token stream: each document followed by <|eos|>.  # [num_tokens]"""
    eos_id = tokenizer.token_to_id(EOS)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts):
        ids.extend(encoding.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.int32)


# ---------------------------------------------------------------- models


def llama_config(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
                 tokenizer: Tokenizer) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.token_to_id(BOS),
        eos_token_id=tokenizer.token_to_id(EOS),
        pad_token_id=tokenizer.token_to_id(PAD),
    )


def target_config(tokenizer: Tokenizer) -> LlamaConfig:
    # Small on purpose: with ~17 CPU-minutes a small target sees more tokens, and a target
    # not much bigger than the draft is easier for the draft to agree with.
    return llama_config(256, 8, 8, 4, 768, tokenizer)


def draft_config(tokenizer: Tokenizer) -> LlamaConfig:
    return llama_config(128, 2, 4, 2, 352, tokenizer)


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def save_model(model: LlamaForCausalLM, tokenizer: Tokenizer, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.pad_token_id,
    )
    model.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    save_tokenizer(tokenizer, folder)


def load_model(folder: Path) -> LlamaForCausalLM:
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    return model.eval()


# ---------------------------------------------------------------- training


def sample_batch(data: torch.Tensor, seq_len: int, batch_size: int,
                 generator: torch.Generator) -> torch.Tensor:
    """Random windows of seq_len + 1 tokens.  # [batch_size, seq_len + 1]"""
    starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=generator)
    return torch.stack([data[s:s + seq_len + 1] for s in starts.tolist()]).long()


def learning_rate(step: int, progress: float, peak: float, num_warmup_steps: int) -> float:
    """Linear warmup, then cosine to 10% of peak by fraction of the time budget.

    Warmup ends after num_warmup_steps or 3% of the budget, whichever comes first, so a
    slow (shared) machine does not spend its whole budget warming up.
    """
    warmup = max((step + 1) / num_warmup_steps, progress / 0.03)
    if warmup < 1.0:
        return peak * warmup
    return peak * (0.1 + 0.45 * (1.0 + math.cos(math.pi * min(progress, 1.0))))


def make_optimizer(model: torch.nn.Module, peak_lr: float) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=peak_lr, betas=(0.9, 0.95), eps=1e-8)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # logits: [batch, seq, vocab], labels: [batch, seq]
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def distill_loss(logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) at temperature 1, mean over positions."""
    log_q = F.log_softmax(logits.float().flatten(0, 1), dim=-1)
    log_p = F.log_softmax(teacher_logits.float().flatten(0, 1), dim=-1)
    return F.kl_div(log_q, log_p, log_target=True, reduction="batchmean")


def train(model: LlamaForCausalLM, data: torch.Tensor, args: TrainArgs, minutes: float,
          peak_lr: float, name: str, teacher: LlamaForCausalLM | None = None) -> RunStats:
    """Trains until the wall-clock budget is spent; bf16 autocast (measured ~1.7x on CPU)."""
    generator = torch.Generator().manual_seed(args.seed)
    optimizer = make_optimizer(model, peak_lr)
    budget_s, start = minutes * 60.0, time.monotonic()
    step, ema_loss = 0, float("nan")
    model.train()
    with tqdm(total=int(budget_s), desc=name, unit="s", mininterval=10) as bar:
        while (elapsed := time.monotonic() - start) < budget_s:
            lr = learning_rate(step, elapsed / budget_s, peak_lr, num_warmup_steps=100)
            for group in optimizer.param_groups:
                group["lr"] = lr
            batch = sample_batch(data, args.seq_len, args.batch_size, generator)
            loss = train_step(model, optimizer, batch, args.distill_weight, teacher)
            ema_loss = loss if step == 0 else 0.98 * ema_loss + 0.02 * loss
            step += 1
            tokens_per_s = step * batch[:, 1:].numel() / max(elapsed, 1e-6)
            bar.set_postfix(loss=f"{ema_loss:.3f}", tok_s=f"{tokens_per_s:.0f}", refresh=False)
            bar.update(int(time.monotonic() - start) - bar.n)
    model.eval()
    return RunStats(count_params(model), step, step * args.batch_size * args.seq_len,
                    (time.monotonic() - start) / 60.0, ema_loss)


def train_step(model: LlamaForCausalLM, optimizer: torch.optim.Optimizer, batch: torch.Tensor,
               distill_weight: float, teacher: LlamaForCausalLM | None) -> float:
    inputs, labels = batch[:, :-1], batch[:, 1:]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=inputs).logits
    loss = cross_entropy(logits, labels)
    if teacher is not None:
        with torch.no_grad():
            teacher_logits = teacher(input_ids=inputs).logits
        loss = (1 - distill_weight) * loss + distill_weight * distill_loss(logits, teacher_logits)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss.item()


# ---------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(target: LlamaForCausalLM, draft: LlamaForCausalLM, data: torch.Tensor,
             seq_len: int) -> dict[str, float]:
    """Loss per token (nats) of each model and the greedy agreement rate, on held-out data.

    Agreement is the share of positions where draft and target pick the same greedy next
    token: the acceptance rate greedy speculative decoding sees on this text.
    """
    num_windows = (len(data) - 1) // seq_len
    sums = {"target": 0.0, "draft": 0.0, "agree": 0.0}
    for i in tqdm(range(num_windows), desc="eval", mininterval=10):
        window = data[i * seq_len:(i + 1) * seq_len + 1].long()[None]
        inputs, labels = window[:, :-1], window[:, 1:]
        target_logits = target(input_ids=inputs).logits
        draft_logits = draft(input_ids=inputs).logits
        sums["target"] += cross_entropy(target_logits, labels).item()
        sums["draft"] += cross_entropy(draft_logits, labels).item()
        agree = target_logits.argmax(-1) == draft_logits.argmax(-1)
        sums["agree"] += agree.float().mean().item()
    return {
        "target_loss_per_token": sums["target"] / num_windows,
        "draft_loss_per_token": sums["draft"] / num_windows,
        "agreement_rate": sums["agree"] / num_windows,
        "num_eval_tokens": num_windows * seq_len,
    }


# ---------------------------------------------------------------- main


def parse_args() -> TrainArgs:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent,
                        help="folder that receives demo/ and demo-draft/ (default: models/)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target-minutes", type=float, default=16.0)
    parser.add_argument("--draft-minutes", type=float, default=9.0)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=12)
    parser.add_argument("--distill-weight", type=float, default=0.7,
                        help="share of the draft's loss that is KL to the target")
    ns = parser.parse_args()
    return TrainArgs(**vars(ns))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    torch.set_num_threads(2)  # the budget was measured on 2 cores


def prepare_data(args: TrainArgs) -> tuple[Tokenizer, torch.Tensor, torch.Tensor, dict]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    corpus = load_corpus(stdlib)
    log.info("corpus: %d train files, %d held out, from %s",
             len(corpus.train_texts), len(corpus.eval_texts), stdlib)
    tokenizer = train_tokenizer(corpus.train_texts)
    train_ids = encode_documents(tokenizer, corpus.train_texts)
    eval_ids = encode_documents(tokenizer, corpus.eval_texts)
    info = {"stdlib": str(stdlib), "python_version": platform.python_version(),
            "num_train_files": len(corpus.train_texts), "num_eval_files": len(corpus.eval_texts),
            "num_train_tokens": len(train_ids), "num_eval_tokens": len(eval_ids)}
    log.info("tokens: %d train, %d held out", len(train_ids), len(eval_ids))
    return tokenizer, train_ids, eval_ids, info


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    transformers.logging.set_verbosity_error()
    args = parse_args()
    seed_everything(args.seed)
    start = time.monotonic()
    tokenizer, train_ids, eval_ids, corpus_info = prepare_data(args)
    target_dir, draft_dir = args.out / "demo", args.out / "demo-draft"

    target = LlamaForCausalLM(target_config(tokenizer))
    target_stats = train(target, train_ids, args, args.target_minutes, 2e-3, "target")
    save_model(target, tokenizer, target_dir)
    teacher = load_model(target_dir)  # distil from the weights that ship

    torch.manual_seed(args.seed)
    draft = LlamaForCausalLM(draft_config(tokenizer))
    draft_stats = train(draft, train_ids, args, args.draft_minutes, 3e-3, "draft", teacher)
    save_model(draft, tokenizer, draft_dir)

    figures = evaluate(load_model(target_dir), load_model(draft_dir), eval_ids, args.seq_len)
    log.info("held-out: %s", figures)
    report = {
        **figures,
        "target": asdict(target_stats),
        "draft": asdict(draft_stats),
        "corpus": corpus_info,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(args).items()},
        "seed": args.seed,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "total_minutes": (time.monotonic() - start) / 60.0,
    }
    (target_dir / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
