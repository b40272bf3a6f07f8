"""`Tokenizer`: a checkpoint's `tokenizer.json` through the `tokenizers` library. No torch, so
the router can use it too."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer


class Tokenizer:
    def __init__(self, path: Path):
        self._tok = _HFTokenizer.from_file(str(path / "tokenizer.json"))
        cfg_path = path / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.eos_token_id = self._special_id(cfg.get("eos_token"))
        self.bos_token_id = self._special_id(cfg.get("bos_token"))
        self.add_bos = bool(cfg.get("add_bos_token", False)) and self.bos_token_id is not None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer | None":
        """The tokenizer beside a checkpoint, or None if it ships without one."""
        path = Path(path)
        return cls(path) if (path / "tokenizer.json").is_file() else None

    def _special_id(self, token: object) -> int | None:
        if isinstance(token, dict):
            token = token.get("content")
        return self._tok.token_to_id(token) if isinstance(token, str) else None

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=True).ids
        if self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
