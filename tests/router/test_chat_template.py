"""Chat templates: the demo pair's, a Hugging Face-style template's variables, and the sandbox
refusing what a hostile template tries (each a 400-able `TemplateError`, never a crash)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.router.chat_template import ChatMessage, ChatTemplate, TemplateError

REPO = Path(__file__).resolve().parents[2]


def test_the_demo_pair_ships_one_template_and_one_tokenizer():
    target, draft = REPO / "models" / "demo", REPO / "models" / "demo-draft"
    assert (target / "tokenizer.json").read_bytes() == (draft / "tokenizer.json").read_bytes()
    configs = [json.loads((d / "tokenizer_config.json").read_text()) for d in (target, draft)]
    assert configs[0]["chat_template"] == configs[1]["chat_template"]
    text = ChatTemplate.from_dir(target).render([ChatMessage("system", "Be brief."), ChatMessage("user", "a\nb")])
    assert text == '"""\nsystem: Be brief.\nuser: a\nb\n"""\n\ndef '


def test_hugging_face_variables(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>"}, "eos_token": "</s>",
        "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}|{{ m.content }}]{% endfor %}"
                         "{% if add_generation_prompt %}>{% endif %}{{ eos_token }}"}))
    t = ChatTemplate.from_dir(tmp_path)
    assert t.render([ChatMessage("user", "hi")]) == "<s>[user|hi]></s>"
    assert t.render([ChatMessage("user", "hi")], add_generation_prompt=False) == "<s>[user|hi]</s>"


def test_no_template_is_none(tmp_path):
    assert ChatTemplate.from_dir(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert ChatTemplate.from_dir(tmp_path) is None


@pytest.mark.parametrize("source, words", [
    ("{{ raise_exception('no system messages') }}", "no system messages"),
    ("{{ messages.__class__.__mro__ }}", "sandbox"),
    ("{{ ''.__class__.__subclasses__() }}", "sandbox"),
    ("{% for m in messages %}{{ m.nope }}{% endfor %}", "failed"),
    ("{{ messages.append(1) }}", "sandbox"),
])
def test_a_template_cannot_escape_or_crash(source, words):
    with pytest.raises(TemplateError, match=words):
        ChatTemplate(source).render([ChatMessage("user", "hi")])


def test_a_template_that_does_not_parse_is_a_load_error():
    with pytest.raises(ValueError, match="does not parse"):
        ChatTemplate("{% for %}")


def test_the_training_script_writes_the_shipped_template():
    import ast

    tree = ast.parse((REPO / "models" / "train.py").read_text())
    (source,) = [ast.literal_eval(n.value) for n in tree.body
                 if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "CHAT_TEMPLATE"]
    assert source == json.loads((REPO / "models" / "demo" / "tokenizer_config.json").read_text())["chat_template"]
