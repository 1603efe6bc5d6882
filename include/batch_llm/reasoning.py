"""Reasoning models: what a chat template says about thinking, the thinking switch, and which reasoning parser.

A reasoning model thinks before it answers: ``<think>…</think>`` then the answer. Whether it does is the chat
template's business, and templates say it two ways (read from the template's text, ``template_thinking``):

- a **switch**, a template variable (``enable_thinking``: Qwen3, GLM, Hunyuan; ``thinking``: DeepSeek-V3.1,
  Granite) that hybrid models read: ``sampling.thinking: on | off`` sets it, through the same template
  variables as ``sampling.chat_template_kwargs`` (a row's own ``thinking`` column or ``chat_template_kwargs``
  laid over it);
- a generation prompt that **opens** the thinking block (ends inside ``<think>``): QwQ, the DeepSeek-R1 distills,
  Qwen3's thinking-only models. Those always think: ``on`` needs nothing, ``off`` cannot be had.

``off`` on a template without a switch, or ``on`` on one that neither has a switch nor opens a block, is refused
naming why (``ThinkingRefused``), never silently rendered as the template's default.

The reasoning parser (``engine.reasoning_parser``, vLLM's parser name) parts the thinking from the answer, and
vLLM's thinking budget and reasoning-aware structured outputs need it. ``auto`` picks it from the model
(``default_reasoning_parser``): ``qwen3`` for a Qwen3 architecture whose template thinks, ``deepseek_r1`` for
another model whose template opens the block (the R1 distills, QwQ), none otherwise.

    tt = template_thinking(chat_template_text)
    variables = thinking_variables("off", tt)      # {"enable_thinking": False}, or ThinkingRefused
"""
from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Thinking = Literal["auto", "on", "off"]
THINKING_MODES = ("auto", "on", "off")
#: Template variables that switch thinking on and off, in the order they are looked for.
SWITCH_VARIABLES = ("enable_thinking", "thinking")
#: The template variable OpenAI's ``reasoning_effort`` sets (gpt-oss's templates read it; vLLM passes it the same way).
EFFORT_VARIABLE = "reasoning_effort"
THINK_START, THINK_END = "<think>", "</think>"
#: ``engine.reasoning_parser``'s default: chosen from the model.
AUTO = "auto"


class ThinkingRefused(ValueError):
    """A thinking setting the model's chat template cannot honour; the message says why."""


@dataclass(frozen=True)
class TemplateThinking:
    """What a chat template says about thinking."""

    switch: str | None = None      # the template variable that switches thinking (enable_thinking, thinking)
    opens: bool = False            # its generation prompt, rendered with the template's defaults, opens <think>
    reasoning_effort: bool = False  # it reads a reasoning_effort variable

    @property
    def thinks(self) -> bool:
        """A reasoning model's template: it can think (a switch) or always does (it opens the block)."""
        return self.switch is not None or self.opens


@functools.lru_cache(maxsize=32)
def template_thinking(template: str | None) -> TemplateThinking:
    """Reads a chat template's text: its thinking switch, whether its generation prompt opens a thinking block,
    whether it takes ``reasoning_effort``."""
    if not template:
        return TemplateThinking()
    variables = _template_variables(template)
    switch = next((v for v in SWITCH_VARIABLES if v in variables), None)
    return TemplateThinking(switch=switch, opens=_opens_thinking(template),
                            reasoning_effort=EFFORT_VARIABLE in variables)


def _environment():
    # As transformers renders chat templates (its apply_chat_template): sandboxed, blocks trimmed, loop controls.
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **{
        k: v for k, v in kw.items() if k in ("indent", "separators", "sort_keys")})

    def raise_exception(message: str) -> None:
        from jinja2.exceptions import TemplateError

        raise TemplateError(message)

    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: "")
    return env


def _template_variables(template: str) -> set[str]:
    """The variables a template reads without setting them (jinja2's own analysis); where jinja2 cannot parse
    it (a tag of some engine's own), the names used inside its ``{% %}`` / ``{{ }}`` blocks, strings left out."""
    import jinja2
    from jinja2 import meta

    try:
        return set(meta.find_undeclared_variables(_environment().parse(template)))
    except jinja2.TemplateSyntaxError:
        blocks = re.findall(r"\{[{%](.*?)[%}]\}", template, flags=re.S)
        code = re.sub(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"", "", " ".join(blocks))
        return set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", code))


def template_kwargs_problem(kwargs: dict[str, Any], template: str | None, where: str) -> str | None:
    """Why ``kwargs`` (``sampling.chat_template_kwargs``) cannot all reach the chat ``template``: a key that is no
    variable the template reads would be rendered as if it were not set, silently. ``where``: the template's
    source, for the message. None when every key is one of its variables, or there is no template to read."""
    if not kwargs or not template:
        return None
    variables = _template_variables(template)
    unknown = sorted(set(kwargs) - variables)
    if not unknown:
        return None
    return (f"sampling.chat_template_kwargs.{unknown[0]}: the chat template ({where}) has no variable {unknown[0]!r}, "
            f"so it would change nothing; the template's variables: {', '.join(sorted(variables)) or 'none'}")


def _opens_thinking(template: str) -> bool:
    """Whether the generation prompt of a one-message chat, rendered with the template's defaults, ends inside a
    thinking block (its last ``<think>`` after its last ``</think>``). A template that cannot be rendered so
    (it needs tools, a system message, ...) is read as not opening one."""
    try:
        text = _environment().from_string(template).render(
            messages=[{"role": "user", "content": "Hello"}], add_generation_prompt=True, bos_token="", eos_token="")
    except Exception:  # noqa: BLE001 - any template error: no evidence that it opens a block
        return False
    return text.rfind(THINK_START) > text.rfind(THINK_END)


def thinking_variables(mode: str | None, tt: TemplateThinking) -> dict[str, Any]:
    """The template variables of ``sampling.thinking`` (or a row's ``thinking``): none for ``auto`` (the
    template's default); ThinkingRefused where the template cannot do what is asked."""
    if mode in (None, "auto"):
        return {}
    if mode not in ("on", "off"):
        raise ThinkingRefused(f"thinking must be auto, on or off, got {mode!r}")
    if tt.switch is not None:
        return {tt.switch: mode == "on"}
    if mode == "on":
        if tt.opens:  # it always thinks: nothing to switch
            return {}
        raise ThinkingRefused("thinking: on: the model's chat template has no thinking switch (no "
                              f"{' or '.join(SWITCH_VARIABLES)} variable) and does not open a {THINK_START} block: "
                              "this model does not think")
    why = f"its generation prompt opens a {THINK_START} block, so it always thinks" if tt.opens else \
        "it does not think"
    raise ThinkingRefused(f"thinking: off: the model's chat template has no thinking switch (no "
                          f"{' or '.join(SWITCH_VARIABLES)} variable; {why})")


def effort_variables(effort: str | None, tt: TemplateThinking) -> dict[str, Any]:
    """OpenAI's ``reasoning_effort`` as the template variable of that name, where the template reads one (as
    vLLM's server passes it); ThinkingRefused where it does not."""
    if effort is None:
        return {}
    if not tt.reasoning_effort:
        hint = f" (its thinking switch is {tt.switch}: set thinking on or off instead)" if tt.switch else ""
        raise ThinkingRefused(f"reasoning_effort={effort!r}: the model's chat template has no {EFFORT_VARIABLE} "
                              f"variable{hint}")
    return {EFFORT_VARIABLE: effort}


def model_architectures(model_dir: str) -> tuple[str, ...]:
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ()
    return tuple(a for a in config.get("architectures") or () if isinstance(a, str))


def default_reasoning_parser(model_dir: str, template: str | None) -> str | None:
    """vLLM's reasoning parser for a model, from its architecture and chat template: ``qwen3`` for a Qwen3
    architecture whose template thinks (Qwen3's hybrid and thinking-only models; Qwen3's instruct-only models have
    neither a switch nor an opening block); ``deepseek_r1`` for any other model whose template opens the thinking
    block (the DeepSeek-R1 distills on Qwen2 and Llama, QwQ: the parser vLLM names for them); None otherwise (set
    ``engine.reasoning_parser`` for another family)."""
    tt = template_thinking(template)
    if not tt.thinks:
        return None
    if any(a.startswith("Qwen3") for a in model_architectures(model_dir)):
        return "qwen3"
    return "deepseek_r1" if tt.opens else None


def resolved_reasoning_parser(configured: str | None, *, serves_reasoning: bool, model_dir: str,
                              template: str | None) -> str | None:
    """``engine.reasoning_parser`` as the engine gets it: ``auto`` chosen from the model (none on an engine without
    a reasoning parser), null none, a name itself."""
    if configured != AUTO:
        return configured
    return default_reasoning_parser(model_dir, template) if serves_reasoning else None
