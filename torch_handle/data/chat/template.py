"""Chat templates rendered as Hugging Face transformers renders them, and the tokens each turn contributes.

**Rendering.** A template is Jinja, run in the environment of transformers' ``apply_chat_template``
(``transformers/utils/chat_template_utils.py``, ``_cached_compile_jinja_template``): a sandbox
(``ImmutableSandboxedEnvironment``) with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension and
the ``{% generation %}`` tag, a ``tojson`` that does not escape HTML, and the globals ``raise_exception``,
``strftime_now``, ``dict`` and ``namespace``. It sees ``messages``, ``add_generation_prompt`` and the tokenizer's
special tokens (``bos_token``, ``eos_token``, ... from ``tokenizer_config.json``), as ``apply_chat_template`` passes
them. The text is rendered once and tokenized without special tokens (``add_special_tokens=False``, as
``apply_chat_template(tokenize=True)`` does), so a BOS the template writes is not added a second time.

**Which tokens are trained** (the definition, docs/fine-tuning.md): the tokens of assistant turn ``i`` are the
characters the template renders for that turn, the difference between the conversation rendered through turn
``i`` and rendered up to it with ``add_generation_prompt=True``: the answer and its end-of-turn token, so the
model learns to stop. A token is trained when it starts inside such a span. A template whose rendering of a
prefix is not a prefix of the whole is refused (its turns have no span). Where the template marks
``{% generation %}`` blocks, each marked span must lie inside the turn's span, with only whitespace outside it.

No torch import.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

from torch_handle.errors import DataError

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
          " + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
"""ChatML (OpenAI; Qwen's templates are its descendants): what ``--template chatml`` renders."""
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")
"""The special tokens ChatML needs; tokenizers that handle trains reserve them (ids 4 and 5:
:data:`torch_handle.data.datasets.RESERVED_TOKENS`); a base whose vocabulary lacks them gets them added
(:func:`add_template_tokens`)."""
ZEPHYR = ("{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\\n' + "
          "message['content'] + eos_token }}\n{% elif message['role'] == 'system' %}\n{{ '<|system|>\\n' + "
          "message['content'] + eos_token }}\n"
          "{% elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\\n'  + message['content'] + eos_token }}\n"
          "{% endif %}\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}")
"""Zephyr's (HuggingFaceH4/zephyr-7b-beta): every turn ends with the tokenizer's ``eos_token``, so a vocabulary
without ChatML's tokens (the byte-level BPE handle trains, whose ``<eos>`` is special) still ends each answer with
one token that is trained and stops generation. What ``--template zephyr`` renders."""
BUILT_IN = {"chatml": CHATML, "zephyr": ZEPHYR}
TEMPLATE_FILE = "chat_template.jinja"
CHAT_FILES = (TEMPLATE_FILE, "tokenizer_config.json")
"""What a prepared directory of conversations, and a run trained on one, keep beside ``tokenizer.json``: the
template (as transformers saves it) and the special tokens it reads."""
def copy_chat_files(source: Path, run_dir: Path) -> None:
    """The :data:`CHAT_FILES` that ``source`` (a prepared directory of conversations) has, copied into ``run_dir``."""
    import shutil

    for name in CHAT_FILES:
        if (Path(source) / name).is_file():
            shutil.copyfile(Path(source) / name, Path(run_dir) / name)


def template_tokens(template: ChatTemplate) -> tuple[str, ...]:
    """The special tokens ``template`` writes that a vocabulary must hold whole, each one id: those of
    :data:`CHATML_TOKENS` its source writes (ChatML's and its descendants'). Other markers (Zephyr's ``<|user|>``)
    are text that the base tokenizes as it does any text."""
    return tuple(t for t in CHATML_TOKENS if t in template.source)


def add_template_tokens(tokenizer: Any, template: ChatTemplate) -> dict[str, int]:
    """Add to ``tokenizer`` (a ``tokenizers.Tokenizer``, in place) the :func:`template_tokens` its vocabulary lacks,
    as special tokens (never split, never merged), after its last id, in :data:`CHATML_TOKENS`' order: what
    transformers' ``tokenizer.add_special_tokens`` does. Returns ``{token: id}`` of those added (empty: none
    lacked); the model's embedding and output rows then grow to the new vocabulary
    (:func:`torch_handle.checkpoint.vocab_rows.grow_vocab`)."""
    missing = [t for t in template_tokens(template) if tokenizer.token_to_id(t) is None]
    if missing:
        tokenizer.add_special_tokens(missing)
    return {t: int(tokenizer.token_to_id(t)) for t in missing}


END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "</s>", "<eos>")
"""Tokens that end an assistant's turn in the common templates; generation stops at any in the vocabulary."""
TRAIN_ON = ("assistant", "last", "all")


def end_of_turn_ids(tokenizer: Any, template: ChatTemplate) -> set[int]:
    """The ids that end an assistant turn: the template's ``eos_token`` and the common end-of-turn tokens
    (:data:`END_OF_TURN`), where the vocabulary has them: where ``handle chat`` stops, and what a prepare checks is
    trained."""
    names = [dict(template.special_tokens).get("eos_token"), *END_OF_TURN]
    return {i for name in names if isinstance(name, str) and (i := tokenizer.token_to_id(name)) is not None}


@dataclass(frozen=True)
class ChatTemplate:
    """A template's source and where it came from (``name``: ``chatml``, a file, or ``<base>/tokenizer_config.json``),
    and the special tokens the template sees."""

    source: str
    name: str
    special_tokens: tuple[tuple[str, Any], ...] = ()

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.source.encode("utf-8")).hexdigest()

    @functools.cached_property
    def has_generation_markers(self) -> bool:
        import re

        return re.search(r"\{%-?\s*generation\s*-?%\}", self.source) is not None

    @functools.cached_property
    def _variables(self) -> dict[str, Any]:
        """The compiled template's globals and the special tokens: what every rendering sees besides the
        conversation, merged once."""
        return {**_compiled(self.source).globals, **dict(self.special_tokens)}

    def render(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = False) -> str:
        """The conversation's text: what jinja's ``Template.render(messages=..., add_generation_prompt=...,
        **special_tokens)`` returns, with the globals merged into the variables once (:attr:`_variables`, a
        context over them), not at every call (a prepare renders each conversation twice or more).

        Raises:
            DataError: the template raised (``raise_exception``, a role it does not know) or is not valid Jinja.
        """
        import jinja2

        compiled = _compiled(self.source)
        try:
            context = compiled.new_context({**self._variables, "messages": list(messages),
                                            "add_generation_prompt": add_generation_prompt}, shared=True)
            return compiled.environment.concat(compiled.root_render_func(context))
        except jinja2.TemplateError as e:
            raise DataError(f"chat template {self.name}: {' '.join(str(e).split())}") from None

    def generation_spans(self, messages: Sequence[dict[str, Any]]) -> list[tuple[int, int]]:
        """The ``{% generation %}`` blocks' character spans of the whole conversation (empty without markers)."""
        compiled = _compiled(self.source)
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        with compiled.environment.activate_tracker(blocks, spans):
            for block in compiled.generate(messages=list(messages), add_generation_prompt=False,
                                           **dict(self.special_tokens)):
                blocks.append(block)
        return spans


@functools.lru_cache(maxsize=8)
def _compiled(source: str) -> Any:
    """The template compiled in transformers' environment (see the module docstring).

    Raises:
        DataError: not valid Jinja."""
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTracker(Extension):
        """``{% generation %}...{% endgeneration %}``: renders its body; while tracking, records its span."""

        tags = {"generation"}

        def __init__(self, environment: Any):
            super().__init__(environment)
            environment.extend(activate_tracker=self.activate_tracker)
            self._blocks: list[str] | None = None
            self._spans: list[tuple[int, int]] | None = None

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_generation"), [], [], body).set_lineno(lineno)

        @jinja2.pass_eval_context
        def _generation(self, context: Any, caller: Any) -> str:
            text = caller()
            if self._spans is not None:
                start = len("".join(self._blocks))
                self._spans.append((start, start + len(text)))
            return text

        def activate_tracker(self, blocks: list[str], spans: list[tuple[int, int]]) -> Any:
            import contextlib

            @contextlib.contextmanager
            def active():
                self._blocks, self._spans = blocks, spans
                try:
                    yield
                finally:
                    self._blocks = self._spans = None

            return active()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class TemplateDict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_': {name!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTracker, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=TemplateDict(), namespace=TemplateNamespace)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise DataError(f"chat template: not valid Jinja (line {e.lineno}: {e.message})") from None


def special_tokens_of(tokenizer_dir: Path) -> tuple[tuple[str, Any], ...]:
    """What ``apply_chat_template`` hands a template of the tokenizer in ``tokenizer_dir``: its
    ``tokenizer_config.json``'s ``*_token`` entries (as strings) and ``additional_special_tokens``."""
    try:
        config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ()
    out = {}
    for key, value in config.items() if isinstance(config, dict) else ():
        value = value.get("content") if isinstance(value, dict) else value
        if key.endswith("_token") and isinstance(value, str):
            out[key] = value
    extra = config.get("additional_special_tokens") if isinstance(config, dict) else None
    if isinstance(extra, list):
        out["additional_special_tokens"] = [t.get("content") if isinstance(t, dict) else t for t in extra]
    return tuple(sorted(out.items()))


def load_template(spec: str | None, tokenizer_file: Path) -> ChatTemplate:
    """The template to render with: ``spec`` (``chatml``, or a ``.jinja`` file), else the base's own (the
    ``chat_template.jinja`` beside ``tokenizer_file``, else its ``tokenizer_config.json``'s ``chat_template``).

    Raises:
        DataError: no such file; a base with no template and no ``spec``; not valid Jinja.
    """
    directory = Path(tokenizer_file).parent
    specials = special_tokens_of(directory)
    if spec:
        if spec in BUILT_IN:
            template = ChatTemplate(BUILT_IN[spec], spec, specials)
        else:
            path = Path(spec).expanduser()
            if not path.is_file():
                raise DataError(f"--template {spec}: no such file (give chatml, zephyr or a .jinja file)")
            template = ChatTemplate(path.read_text(encoding="utf-8"), str(path), specials)
    elif (directory / "chat_template.jinja").is_file():
        template = ChatTemplate((directory / "chat_template.jinja").read_text(encoding="utf-8"),
                                str(directory / "chat_template.jinja"), specials)
    else:
        source = None
        try:
            source = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template")
        except (OSError, ValueError, AttributeError):
            pass
        if isinstance(source, list):  # named templates: the default one
            source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"),
                          None)
        if not isinstance(source, str):
            raise DataError(f"{directory}: no chat template (no chat_template.jinja, none in tokenizer_config.json): "
                            f"give --template chatml, zephyr or a .jinja file")
        template = ChatTemplate(source, str(directory / "tokenizer_config.json"), specials)
    _compiled(template.source)  # not valid Jinja: refused now
    return template


def turn_spans(template: ChatTemplate, messages: Sequence[dict[str, Any]], train_on: str = "assistant"
               ) -> tuple[str, list[tuple[int, int]]]:
    """``(text, spans)``: the whole conversation rendered, and the character spans of its trained turns (see the
    module docstring): assistant turns (``train_on="assistant"``, those whose message does not say
    ``"train": false``), the final assistant turn (``"last"``), or every turn but the system's (``"all"``).

    Raises:
        DataError: a prefix whose rendering is not a prefix of the whole, ``{% generation %}`` spans that disagree,
            or what rendering raises.
    """
    whole = template.render(messages)
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
    spans = []
    for i, message in enumerate(messages):
        role = message.get("role")
        wanted = (role == "assistant" and message.get("train", True) is not False) if train_on == "assistant" else \
            (i == last) if train_on == "last" else (role != "system")
        if not wanted:
            continue
        before = template.render(messages[:i], add_generation_prompt=role == "assistant")
        through = whole if i + 1 == len(messages) else template.render(messages[:i + 1])  # the last: the whole
        if not through.startswith(before) or not whole.startswith(through):
            raise DataError(f"chat template {template.name}: the rendering of a conversation's first {i} turns is not "
                            f"a prefix of its rendering through turn {i + 1} (its turns cannot be told apart)")
        spans.append((len(before), len(through)))
    if template.has_generation_markers and train_on == "assistant":
        for start, end in template.generation_spans(messages):
            if not any(s <= start and end <= e and not whole[s:start].strip() and not whole[end:e].strip()
                       for s, e in spans):
                raise DataError(f"chat template {template.name}: a {{% generation %}} block ({start}:{end}) is not "
                                f"an assistant turn's span")
    return whole, spans


def trained_of(encoding: Any, spans: Sequence[tuple[int, int]]) -> tuple[list[int], list[bool]]:
    """``(ids, trained)`` of a rendering's ``encoding`` (HF ``tokenizers``' ``Encoding``, with character
    offsets): each token trained when it starts inside one of the character ``spans`` (:func:`turn_spans`).

    The tokens of a span are found from its ends (``char_to_token``, ``token_to_chars``: two look-ups a span,
    not the offsets of every token); a span whose ends no token covers reads every token's offsets."""
    ids = encoding.ids
    trained = [False] * len(ids)
    for s, e in spans:
        first, last = encoding.char_to_token(s), encoding.char_to_token(e - 1) if e > s else None
        if first is None or last is None:  # not covered (a normalizer dropped them): every token's start
            for k, (start, _) in enumerate(encoding.offsets):
                trained[k] = trained[k] or s <= start < e
            continue
        if encoding.token_to_chars(first)[0] < s:  # the token holding s starts before the span
            first += 1
        trained[first:last + 1] = [True] * max(0, last + 1 - first)
    return list(ids), trained


def encode_conversation(tokenizer: Any, template: ChatTemplate, messages: Sequence[dict[str, Any]],
                        train_on: str = "assistant") -> tuple[list[int], list[bool]]:
    """``(ids, trained)`` of one conversation: the rendering's token ids (``add_special_tokens=False``, as
    ``apply_chat_template(tokenize=True)``) and, for each, whether it starts inside a trained span."""
    text, spans = turn_spans(template, messages, train_on)
    return trained_of(tokenizer.encode(text, add_special_tokens=False), spans)
