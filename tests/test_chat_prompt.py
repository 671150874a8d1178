"""Chat prompts through the chat template (``chat_prompt_ids``, ``Engine.chat``,
``kvserve generate --chat``) and ``kvserve --version``, on the tiny random model."""

from importlib.metadata import version

import pytest
from transformers import AutoTokenizer

from kvserve import Engine, RequestRejected
from kvserve.cli import main
from kvserve.engine.chat import chat_prompt_ids
from kvserve.model.init import init_model

QUESTION = "What is the capital of France?"
CHATML = "<|im_start|>{role}\n{content}<|im_end|>\n"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return init_model(tmp_path_factory.mktemp("m") / "tiny-llama", "tiny-llama")


@pytest.fixture(scope="module")
def engine(ckpt):
    with Engine(model_path=ckpt, page_size=4, strict_checks=True) as e:
        yield e


def _chatml_ids(tokenizer, *turns: tuple[str, str]) -> list[int]:
    text = "".join(CHATML.format(role=r, content=c) for r, c in turns)
    return tokenizer.encode(text + "<|im_start|>assistant\n", add_special_tokens=False)


def test_chat_prompt_ids_are_the_templates_ids(ckpt):
    tok = AutoTokenizer.from_pretrained(ckpt)
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": QUESTION}]
    ids = chat_prompt_ids(tok, messages)
    assert ids == _chatml_ids(tok, ("system", "Be brief."), ("user", QUESTION))
    assert ids == tok.apply_chat_template(messages, add_generation_prompt=True,
                                          return_dict=True)["input_ids"]
    tok.chat_template = None  # no template: kvserve's ChatML fallback, the same ids
    assert chat_prompt_ids(tok, messages) == ids
    tok.chat_template = "{{ raise_exception('no system role') }}"
    with pytest.raises(ValueError, match="messages do not fit the chat template"):
        chat_prompt_ids(tok, messages)


def test_engine_chat_runs_the_template_prompt(engine):
    messages = [{"role": "user", "content": QUESTION}]
    ids = _chatml_ids(engine.tokenizer, ("user", QUESTION))
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    out = engine.chat(messages, params)
    assert out.prompt_tokens == len(ids)
    assert out.output_ids == engine.generate(input_ids=ids, sampling_params=params).output_ids
    for bad in ([], [{"role": "user"}], ["hello"], [{"role": "user", "content": 3}]):
        with pytest.raises(RequestRejected, match="messages must be a non-empty list"):
            engine.chat(bad, params)


def test_generate_cli_chat_applies_the_template(ckpt, engine, capsys):
    flags = ["--model", str(ckpt), "--max-new-tokens", "5", "--temperature", "0"]
    params = {"max_new_tokens": 5, "temperature": 0}
    assert main(["generate", "--chat", QUESTION, *flags]) == 0
    captured = capsys.readouterr()
    user = _chatml_ids(engine.tokenizer, ("user", QUESTION))
    assert f"prompt_tokens={len(user)} " in captured.err
    reply = engine.generate(input_ids=user, sampling_params=params)
    assert captured.out == reply.text + "\n"

    assert main(["generate", "--chat", QUESTION, "--system", "Be brief.", *flags]) == 0
    both = _chatml_ids(engine.tokenizer, ("system", "Be brief."), ("user", QUESTION))
    assert f"prompt_tokens={len(both)} " in capsys.readouterr().err

    assert main(["generate", QUESTION, *flags]) == 0  # plain generate stays a completion
    plain = engine.tokenizer.encode(QUESTION)
    assert f"prompt_tokens={len(plain)} " in capsys.readouterr().err

    assert main(["generate", QUESTION, "--system", "x", *flags]) == 2
    assert "--system needs --chat" in capsys.readouterr().err


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"kvserve {version('kvserve')}\n"
