"""A record read from the input, and the rule that turns it into a prompt row: its id, the chat (or completion
prompt, or token ids) to send, its reference and its own sampling parameters. ``to_prompt_row`` raises ValueError
with the reason a record is not usable; the readers (io/formats.py) never raise on a bad row, they carry its
reason in a ``RawRow``."""
from __future__ import annotations

import json
import re
import string
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from batch_llm.config import InputConfig
from batch_llm.config.openai_batch import TASK_ENDPOINTS
from batch_llm.config.sampling import plain_token_ids, token_ids_problem
from batch_llm.rows.openai_batch import RequestLine
from batch_llm.rows.params import RowParams

ROLES = ("system", "user", "assistant", "tool", "developer")


@dataclass
class RawRow:
    line: int                     # 1-based position in the input (line or record number)
    record: dict | None           # None when the row could not be parsed
    error: str | None = None
    source: str = ""
    salvaged: dict | None = None  # a row that could not be used: its top-level ids and strings that read cleanly,
                                  # so that its error names it (an OpenAI Batch line's custom_id)


@dataclass
class PromptRow:
    """A validated row: its id, its place in the input, the chat to send, and the reference if any."""

    id: str
    idx: int
    messages: list[dict]
    reference: str | None = None
    prompt_token_ids: list[int] | None = None   # a pre-tokenized prompt, sent to the engine as is
    params: RowParams | None = None             # the row's own sampling parameters (rows/params.py)
    text: str | None = None                     # a completion prompt (``/v1/completions``): no chat template
    images: list[dict] | None = None            # the checked images of its image parts, in order (io/images.py)


def json_value(text: str) -> Any:
    """``json.loads`` of a row's text; nesting deeper than Python's recursion limit is a ValueError (the row's
    fault, like malformed JSON), not a RecursionError that would stop the file."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"JSON nested deeper than {sys.getrecursionlimit()} levels") from None


def template_columns(template: str) -> set[str]:
    """The columns a template reads: ``{lang}``, ``{meta.lang}`` and ``{langs[0]}`` all read ``lang(s)``."""
    names = (re.split(r"[.\[]", field)[0] for _, field, _, _ in string.Formatter().parse(template) if field)
    return {n for n in names if n and not n.isdigit()}


def _render_template(template: str, record: dict) -> str:
    try:
        return template.format_map(record)
    except KeyError as e:
        raise ValueError(f"template needs column {e.args[0]!r}, which this row lacks") from None


def _check_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object, got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role {role!r} is not one of {', '.join(ROLES)}")
        if isinstance(content, list):
            content = _content_parts(content, f"messages[{i}].content")
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of content parts, got "
                             f"{type(content).__name__}")
        out.append({"role": role, "content": content})
    if not any(_has_prompt(m["content"]) for m in out if m["role"] == "user"):
        raise ValueError("empty prompt: no user message has text")
    return out


def _has_prompt(content: str | list) -> bool:
    """A user message that asks something: text, or an image (a caption row may carry no text)."""
    if isinstance(content, str):
        return bool(content.strip())
    return any(p["type"] == IMAGE_URL or p["text"].strip() for p in content)


IMAGE_URL = "image_url"   # an OpenAI chat content part naming an image (checked by the planner: io/images.py)
IMAGE_BYTES = "image_bytes"  # a table cell's image bytes (input.image_columns), carried until the planner checks them


def _content_parts(parts: list, where: str) -> str | list[dict]:
    """OpenAI chat content parts: ``text`` and ``image_url`` (its ``url`` a data: URL, a storage URL or a path).
    Text parts alone are one string (joined by newlines, as vLLM joins them); with images, the parts in order:
    ``{"type": "text", "text": ...}`` and ``{"type": "image_url", "image_url": {"url": ...}}``."""
    if not parts:
        raise ValueError(f"{where} is an empty list of content parts")
    out: list[dict] = []
    for k, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        elif kind == IMAGE_URL:
            image = part.get(IMAGE_URL)
            url = image.get("url") if isinstance(image, dict) else image
            if not isinstance(url, str) or not url.strip():
                raise ValueError(f"{where}[{k}]: an image_url part needs image_url.url, a data: URL, a storage URL "
                                 "or a path")
            out.append({"type": IMAGE_URL, IMAGE_URL: {"url": url}})
        elif kind == "text":
            raise ValueError(f"{where}[{k}]: a text part needs a string 'text'")
        else:
            shown = repr(kind) if kind is not None else f"a {type(part).__name__}"
            raise ValueError(f"{where}[{k}]: content part {shown} is not read (text and image_url parts are)")
    if all(p["type"] == "text" for p in out):
        return "\n".join(p["text"] for p in out)
    return out


def _with_column_images(messages: list[dict], rec: dict, cfg: InputConfig) -> list[dict]:
    """``input.image_columns``: the row's images (a path or URL, a list of them, bytes, or a ``{bytes, path}``
    struct as Hugging Face datasets store images in Parquet) put before the text of its last user message; a null
    or empty cell adds none."""
    parts: list[dict] = []
    for col in cfg.image_columns:
        value = rec.get(col)
        if isinstance(value, str) and value.strip().startswith("["):  # a CSV cell holding a JSON list
            try:
                value = json_value(value)
            except json.JSONDecodeError:
                raise ValueError(f"column {col!r} starts like a JSON list but is not one") from None
        for item in value if isinstance(value, list) else [value]:
            if item is None or item == "":
                continue
            if isinstance(item, dict) and isinstance(item.get("bytes"), (bytes, bytearray)):
                parts.append({"type": IMAGE_BYTES, "bytes": bytes(item["bytes"]), "name": str(item.get("path") or "")})
            elif isinstance(item, dict) and isinstance(item.get("path"), str):
                parts.append({"type": IMAGE_URL, IMAGE_URL: {"url": item["path"]}})
            elif isinstance(item, (bytes, bytearray)):
                parts.append({"type": IMAGE_BYTES, "bytes": bytes(item), "name": ""})
            elif isinstance(item, str):
                parts.append({"type": IMAGE_URL, IMAGE_URL: {"url": item}})
            else:
                raise ValueError(f"column {col!r}: an image is a path or URL, bytes, or a {{bytes, path}} struct, "
                                 f"got {type(item).__name__}")
    if not parts:
        return messages
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        raise ValueError("the row's images (input.image_columns) need a user message to go in")
    i = users[-1]
    content = messages[i]["content"]
    text = [{"type": "text", "text": content}] if isinstance(content, str) else content
    return [*messages[:i], {**messages[i], "content": [*parts, *text]}, *messages[i + 1:]]


OPENAI_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
EMBEDDINGS_URL = "/v1/embeddings"


def to_prompt_row(raw: RawRow, idx: int, cfg: InputConfig, fmt: str, task: str = "generate") -> PromptRow:
    """Validates one parsed record; raises ValueError with the reason when it is not usable. ``task``: the
    pipeline's engine.task, which says the OpenAI Batch urls a line may name where ``input.openai_urls`` does not."""
    if fmt == "openai_batch":
        return _openai_row(raw.record or {}, idx, cfg, task)
    rec = raw.record or {}
    rid = _row_id(rec, cfg.id_column)
    params = RowParams.from_columns(_typed_cells(rec, cfg.sampling_columns), cfg.sampling_columns)
    tokens = rec.get("prompt_token_ids")
    if tokens is not None:
        with_images = [c for c in cfg.image_columns if rec.get(c) not in (None, "", [])]
        if with_images:
            raise ValueError(f"a pre-tokenized row (prompt_token_ids) takes no images, and this one has "
                             f"{', '.join(with_images)}")
        return PromptRow(id=rid, idx=idx, messages=[], prompt_token_ids=_check_token_ids(tokens), params=params)
    messages, prompt = rec.get(cfg.messages_column), rec.get(cfg.prompt_column)
    if fmt == "csv" and messages == "":  # an empty cell is CSV's null: the row's prompt may be in the other column
        messages = None
    if cfg.template:
        text = _render_template(cfg.template, rec)
        if not text.strip():
            raise ValueError("empty prompt after rendering the template")
        messages = [{"role": "user", "content": text}]
    elif messages is not None:
        if isinstance(messages, str) and fmt in ("csv", "parquet"):  # columns holding JSON text
            try:
                messages = json_value(messages)
            except json.JSONDecodeError:
                raise ValueError(f"column {cfg.messages_column!r} is text but not JSON") from None
        messages = _check_messages(messages)
    elif prompt is not None:
        messages = [{"role": "user", "content": _check_prompt(prompt)}]
    else:
        raise ValueError(_no_prompt_reason(rec, cfg))
    if cfg.image_columns:
        messages = _with_column_images(messages, rec, cfg)
    ref = rec.get(cfg.reference_column)
    return PromptRow(id=rid, idx=idx, messages=_with_system(messages, cfg), params=params,
                     reference=ref if isinstance(ref, str) and ref.strip() else None)


def _no_prompt_reason(rec: dict, cfg: InputConfig) -> str:
    """Why a row has no prompt: its prompt columns are null (a table's row has them), or absent (a JSON line)."""
    nulls = [repr(c) for c in (cfg.messages_column, cfg.prompt_column) if c in rec]
    if nulls:
        return f"no prompt: {' and '.join(nulls)} {'is' if len(nulls) == 1 else 'are'} null"
    return f"no prompt: the row has neither {cfg.messages_column!r} nor {cfg.prompt_column!r}"


def _openai_row(rec: dict, idx: int, cfg: InputConfig, task: str = "generate") -> PromptRow:
    """One OpenAI Batch request line: a chat body (``messages``), a completions body (``prompt``) or an embeddings
    body (``input``)."""
    line = request_line(rec, tuple(cfg.openai_urls or ()), task)
    rid, body, url = str(line.custom_id), line.body, line.url
    if url == EMBEDDINGS_URL:
        return _embedding_row(rid, idx, body)
    params = RowParams.from_openai_body(body, completions=url == "/v1/completions")
    if url == "/v1/chat/completions":
        return PromptRow(id=rid, idx=idx, messages=_with_system(_check_messages(body.get("messages")), cfg),
                         params=params)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # one prompt in a list; several would be several completions
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return PromptRow(id=rid, idx=idx, messages=[], prompt_token_ids=_check_token_ids(prompt), params=params)
    if not isinstance(prompt, str):
        raise ValueError("a /v1/completions body needs 'prompt': one string or one list of token ids")
    return PromptRow(id=rid, idx=idx, messages=[], text=_check_prompt(prompt), params=params)


def _embedding_row(rid: str, idx: int, body: dict) -> PromptRow:
    """An embeddings body: one input, a string or one list of token ids (one in a list too), as OpenAI's
    ``input``; several inputs in one line would be several vectors, refused with the reason."""
    params = RowParams.from_embeddings_body(body)
    if "input" not in body:
        raise ValueError("a /v1/embeddings body needs 'input': one string or one list of token ids")
    inp = body["input"]
    if isinstance(inp, list) and len(inp) == 1 and isinstance(inp[0], (str, list)):
        inp = inp[0]  # one input in a list
    if isinstance(inp, list) and inp and all(isinstance(t, int) and not isinstance(t, bool) for t in inp):
        return PromptRow(id=rid, idx=idx, messages=[], prompt_token_ids=_check_token_ids(inp), params=params)
    if isinstance(inp, list) and len(inp) > 1:
        raise ValueError(f"input is a list of {len(inp)} inputs: a batch line here embeds one (a string or one list "
                         "of token ids); give each input a line of its own")
    if not isinstance(inp, str):
        raise ValueError(f"input must be a string or a list of token ids, got {type(inp).__name__}")
    if not inp.strip():
        raise ValueError("empty input")
    return PromptRow(id=rid, idx=idx, messages=[], text=inp, params=params)


def request_line(rec: dict, urls: tuple[str, ...] | None = None, task: str = "generate") -> RequestLine:
    """An OpenAI Batch request line, checked: its custom_id, a POST to one of ``urls`` (a batch's endpoint, or every
    URL the pipeline's ``task`` answers), a body object."""
    _row_id(rec, "custom_id")
    urls = urls or TASK_ENDPOINTS[task]
    body, url = rec.get("body"), rec.get("url", "/v1/chat/completions")
    if not isinstance(body, dict):
        raise ValueError("OpenAI batch line without a 'body' object")
    if url not in urls:
        if url in TASK_ENDPOINTS[task]:
            raise ValueError(f"url {url!r} is not the batch's endpoint ({', '.join(urls)})")
        if url in OPENAI_URLS:
            asks = "a vector" if url == EMBEDDINGS_URL else "generated text"
            raise ValueError(f"url {url!r} asks for {asks}; this pipeline's engine.task {task} answers "
                             f"{', '.join(TASK_ENDPOINTS[task]) or 'no OpenAI endpoint'}")
        raise ValueError(f"url {url!r} is not supported (only {', '.join(urls)})")
    if rec.get("method", "POST") != "POST":
        raise ValueError(f"method {rec['method']!r}: batch requests are POST")
    return RequestLine(custom_id=rec["custom_id"], body=body, url=url, method="POST")


def _row_id(rec: dict, column: str) -> str:
    rid = rec.get(column)
    if rid is None or (isinstance(rid, str) and not rid.strip()):
        raise ValueError(f"missing id (column {column!r})")
    if isinstance(rid, bool) or not isinstance(rid, (str, int)):
        raise ValueError(f"id must be a string or an integer, got {type(rid).__name__}")
    return str(rid)


def _check_token_ids(tokens: Any) -> list[int]:
    if isinstance(tokens, list) and plain_token_ids(tokens):  # the common case; anything else item by item below
        return tokens
    if not (isinstance(tokens, list) and tokens and all(isinstance(t, int) and t >= 0 for t in tokens)):
        raise ValueError("prompt_token_ids must be a non-empty list of token ids")
    if problem := token_ids_problem(tokens, "prompt_token_ids", most=None):  # its length: the context's to say
        raise ValueError(problem)
    return tokens


def _check_prompt(prompt: Any) -> str:
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
    if not prompt.strip():
        raise ValueError("empty prompt")
    return prompt


def _with_system(messages: list[dict], cfg: InputConfig) -> list[dict]:
    if cfg.system_prompt and messages[0]["role"] != "system":
        return [{"role": "system", "content": cfg.system_prompt}, *messages]
    return messages


def _typed_cells(rec: dict, columns: Sequence[str]) -> dict:
    """The parameter cells of a row; CSV cells are text, so numbers are read from it (a stop cell may hold a
    JSON list; stop_token_ids a JSON list, chat_template_kwargs a JSON object, include_stop_str_in_output
    true or false; thinking and reasoning_effort words)."""
    out = {}
    for c in columns:
        v = rec.get(c)
        if isinstance(v, str) and v.strip():
            text = v.strip()
            if c == "stop":
                v = json_value(text) if text.startswith("[") else v
            elif c in ("stop_token_ids", "chat_template_kwargs"):
                try:
                    v = json.loads(text)
                except (ValueError, RecursionError):
                    raise ValueError(f"{c} must be JSON ({'a list' if c == 'stop_token_ids' else 'an object'}), "
                                     f"got {v!r}") from None
            elif c == "include_stop_str_in_output":
                v = {"true": True, "false": False}.get(text.lower(), v)  # anything else: refused as it is
            elif c in ("thinking", "reasoning_effort"):  # words (on / off / auto, low / high ...): checked as they are
                v = text
            else:
                try:
                    v = int(text) if text.lstrip("-").isdigit() else float(text)
                except ValueError:
                    raise ValueError(f"{c} must be a number, got {v!r}") from None
        out[c] = v
    return out

