"""Rows on their way to the engine as requests (``RequestBuilder``): the chat template rendered and tokenized (a
row's own template variables and thinking switch), pre-tokenized rows as they are, the prompt's length checked
against the context the engine has, images refused where the engine or model takes none and loaded a bounded
window ahead of the engine; requests kept for later on local disk (``RequestSpool``). A row that cannot become a
request fails with its reason (the runner's ``fail``)."""
from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Container, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from batch_llm.analysis.timeline import Timeline
from batch_llm.config import PipelineConfig
from batch_llm.engines.base import EngineInfo, GenRequest
from batch_llm.io.storage import iter_jsonl, json_bytes
from batch_llm.reasoning import TemplateThinking, ThinkingRefused, template_thinking
from batch_llm.rows.params import RowParams, template_kwargs

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_tokenizer(model_dir: str, chat_template: str | None, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    if chat_template:
        tok.chat_template = chat_template
    return tok


def prompt_basis(r: dict) -> list:
    """What the prompt is, for its key: token ids, a completion text or a chat."""
    if "prompt_token_ids" in r:
        return ["ids", r["prompt_token_ids"]]
    return ["text", r["text"]] if "text" in r else ["chat", r["messages"]]


def row_params(r: dict) -> dict | None:
    """The shard row's own sampling parameters (``max_tokens`` alone in shards planned before row params)."""
    if "params" in r:
        return r["params"]
    return {"max_tokens": r["max_tokens"]} if r.get("max_tokens") else None


def _spool_line(req: GenRequest) -> bytes:
    """A request on local disk: its images by reference (loaded again when it goes to the engine)."""
    params = req.params.to_json() if req.params is not None else None
    return json_bytes([req.key, req.prompt_token_ids, req.prompt_text, params, req.image_refs]) + b"\n"


def _spooled_requests(path: Path) -> Iterator[GenRequest]:
    for key, ids, text, params, *refs in iter_jsonl(path):
        yield GenRequest(key=key, prompt_token_ids=ids, prompt_text=text, params=RowParams.from_json(params),
                         image_refs=refs[0] if refs else None)


class RequestSpool:
    """Requests kept for later on local disk (a shard's invalid outputs can be many; their prompts are not
    held in memory)."""

    def __init__(self, path: Path):
        self.path, self.count = path, 0
        self._fh: BinaryIO | None = None

    def add(self, req: GenRequest) -> None:
        if self._fh is None:
            self._fh = open(self.path, "wb")
        self._fh.write(_spool_line(req))
        self.count += 1

    def close(self) -> "RequestSpool":
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        return self

    def read(self) -> Iterator[GenRequest]:
        return _spooled_requests(self.path) if self.count else iter(())

class RequestBuilder:
    """A shard's rows made into requests for the engine, for the runner: ``groups`` (request_id → its rows, the
    runner's: a request whose rows are done is built no more) and ``sent_by`` (row id → request_id, for the row
    whose prompt is sent) are the runner's, read here; ``fail`` fails a request's rows with a reason (and the
    prompt's tokens). ``info``: the started engine's, once it started (its context may be shorter)."""

    def __init__(self, cfg: PipelineConfig, *, model_dir: str, image_options: dict, groups: Container[str],
                 sent_by: dict[str, str], fail: Callable[[str, str, int], None], timeline: Timeline):
        self.cfg, self.model_dir, self.image_options = cfg, model_dir, image_options
        self.groups, self.sent_by, self.fail, self.timeline = groups, sent_by, fail, timeline
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self.info: EngineInfo | None = None

    def tokenize_while(self, engine_starting: Callable[[], bool], rows: Iterator[dict], spool: Path) -> Path | None:
        """Renders requests into a local spool for as long as the engine is starting; the rest are rendered
        as the engine takes them."""
        if not engine_starting():
            return None
        t0 = time.time()
        with open(spool, "wb") as fh:
            for r in rows:
                req = self._request_for(r)
                if req is not None:
                    fh.write(_spool_line(req))
                if not engine_starting():
                    break
        self.timeline.add("tokenize", t0)
        return spool

    def requests(self, spooled: Path | None, rows: Iterator[dict],
                 sent: Callable[[GenRequest], None]) -> Iterator[GenRequest]:
        """Every request still to generate, in the planner's order: the spooled ones, then the rest. A request's
        images are loaded here, as the engine pulls it, on ``input.image_workers`` threads a bounded window ahead
        (``io.images.load_ahead``; each as ``with_images`` says): only the requests the engine holds at once and
        that window have decoded images, never the shard's."""
        from batch_llm.io.images import ImageProblem, decoded_bytes, load_ahead

        inp = self.cfg.input
        for req, images in load_ahead(self._first_requests(spooled, rows), lambda r: r.image_refs or (),
                                      self._load_image, inp.image_workers,
                                      cost=lambda r: decoded_bytes(r.image_refs or (), inp.max_image_pixels),
                                      budget=inp.max_decoded_bytes_ahead):
            if isinstance(images, ImageProblem):
                self.fail(req.key, str(images), 0)
                continue
            sent(req)  # kept where its output may be asked again (``results.OutputChecks.sent``)
            yield req if images is None else dataclasses.replace(req, images=images)

    def with_images(self, req: GenRequest) -> GenRequest | None:
        """The request with its images decoded (``io.images.load_image``: read again, its content hash compared
        with the plan's, decoded in full with PIL); None, its rows failed with the reason, where one cannot be
        (gone or changed since the plan, corrupt past its header). Whether this engine and model take images was
        asked when the request was made (``_request_for``: every request, spooled or asked again, comes from it)."""
        if not req.image_refs:
            return req
        from batch_llm.io.images import ImageProblem

        try:
            images = [self._load_image(ref) for ref in req.image_refs]
        except ImageProblem as e:
            self.fail(req.key, str(e), 0)
            return None
        return dataclasses.replace(req, images=images)

    def _load_image(self, ref: dict) -> Any:
        """One image of a request, loaded under the input's limits and read from where its plan may read
        (``io.images.load_image``)."""
        from batch_llm.host import path_policy
        from batch_llm.io.images import load_image

        inp = self.cfg.input
        return load_image(ref, self.image_options, inp.max_image_bytes, max_pixels=inp.max_image_pixels,
                          stores=path_policy.input_stores(inp.path, inp.conn_id))

    def image_refusal(self, n: int) -> str | None:
        """Why this shard's engine or model cannot take a request's ``n`` images (a review pass's rows meet the
        review model's engine here), or None."""
        from batch_llm.config.capabilities import takes_no_images

        if why := takes_no_images(self.cfg.engine.kind):
            return f"the row has {n} image(s): {why} (a review: or filter.review.images: text)"
        if not self._model_takes_images:
            return (f"the row has {n} image(s): the model at {self.model_dir} takes no images (its config.json names "
                    "no vision part); use a vision-language model (a review: or filter.review.images: text)")
        return None

    @functools.cached_property
    def _model_takes_images(self) -> bool:
        from batch_llm.io.images import model_takes_images

        return model_takes_images(self.model_dir)

    def _first_requests(self, spooled: Path | None, rows: Iterator[dict]) -> Iterator[GenRequest]:
        if spooled is not None:  # rendered while the engine started: a back-off may have shortened the context since
            yield from (req for req in _spooled_requests(spooled) if not self._too_long(req.key, req.prompt_token_ids))
        for r in rows:
            req = self._request_for(r)
            if req is not None:
                yield req

    def _request_for(self, r: dict) -> GenRequest | None:
        """The request of the row whose prompt is sent; rows that cannot become one are error rows."""
        rid = self.sent_by.get(r["id"])
        if rid is None or rid not in self.groups:
            return None
        if r.get("images") and (refusal := self.image_refusal(len(r["images"]))):  # before a text template sees them
            self.fail(rid, refusal, 0)
            return None
        try:
            text, ids = self.render(r)
        except ThinkingRefused as e:  # the row's thinking setting, which this model's template cannot honour
            self.fail(rid, str(e), 0)
            return None
        except Exception as e:  # noqa: BLE001 - a template that rejects the chat is a row error
            self.fail(rid, f"chat template failed: {e}", 0)
            return None
        if self._too_long(rid, ids):
            return None
        return GenRequest(key=rid, prompt_token_ids=ids, prompt_text=text,
                          params=RowParams.from_json(row_params(r)), image_refs=r.get("images") or None)

    def _too_long(self, rid: str, ids: list[int]) -> bool:
        """Fails the request's rows when its prompt leaves no room in the context the engine has: a row error
        with its reason, where the engine would fail the shard."""
        max_len = self._context_limit()
        if not max_len or len(ids) < max_len:
            return False
        configured = self.cfg.engine.max_model_len
        lowered = " (lowered from engine.max_model_len by memory back-off)" if configured and max_len < configured else ""
        self.fail(rid, f"prompt is {len(ids)} tokens; the context (max_model_len) is {max_len}{lowered}", len(ids))
        return True

    def _context_limit(self) -> int | None:
        """engine.max_model_len, or, once the engine started, the context it started with: a memory back-off
        may have lowered it (the engine's own figure counts where it reports one)."""
        limits = [self.cfg.engine.max_model_len]
        if self.info is not None:
            limits += [getattr(getattr(self.info, "config", None), "max_model_len", None),
                       self.info.settings.get("max_model_len")]
        known = [x for x in limits if isinstance(x, int) and x > 0]
        return min(known) if known else None

    def render(self, r: dict) -> tuple[str, list[int]]:
        if "prompt_token_ids" in r:  # pre-tokenized rows need no tokenizer
            return "", r["prompt_token_ids"]
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(self.model_dir, self.cfg.model.chat_template,
                                             self.cfg.model.trust_remote_code)
        if "text" in r:  # a completion prompt: tokenized as vLLM's completions API does (special tokens added)
            return r["text"], self.tokenizer(r["text"], add_special_tokens=True)["input_ids"]
        if not self.tokenizer.chat_template:
            raise ValueError(f"the model at {self.model_dir} has no chat template; set model.chat_template")
        variables = template_kwargs(RowParams.from_json(row_params(r)), self.cfg.sampling, self._template_thinking)
        text = self.tokenizer.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True,
                                                  **variables)
        return text, self.tokenizer(text, add_special_tokens=False)["input_ids"]

    @functools.cached_property
    def _template_thinking(self) -> TemplateThinking:
        """What the tokenizer's chat template (the one rendering the rows) says about thinking, read once."""
        template = self.tokenizer.chat_template if self.tokenizer is not None else None
        return template_thinking(template if isinstance(template, str) else None)
