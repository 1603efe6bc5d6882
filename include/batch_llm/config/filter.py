"""The ``filter`` section: the sensitive-word lists and the content review by a model, and the check of the local
word-list files when a pipeline file loads."""
from __future__ import annotations

import re
import typing
from typing import Literal

from pydantic import Field, field_validator, model_validator

from batch_llm.config.capabilities import who_can
from batch_llm.config.engine import EngineConfig
from batch_llm.config.model import ModelConfig
from batch_llm.config.section import Section
from batch_llm.host import path_policy

# The generated text fields the word lists scan: the answer, and a reasoning model's thinking (engine.reasoning_parser)
ScannedField = Literal["output", "reasoning"]


class WordListConfig(Section):
    """A sensitive-word list and what to do on a hit: flag the row, mask the word, or drop the row."""

    name: str
    path: str = Field(description="A file (one word per line, # comments) or builtin:en / builtin:zh")
    action: Literal["flag", "mask", "drop"] = "mask"
    scan: list[ScannedField] | None = Field(None, description="The fields this list scans; null: filter.scan")
    fold: list[Literal["confusables", "han_variants", "separators"]] = Field(
        default_factory=list, description="Look-alike spellings this list also matches (stages/confusables.py). "
        "confusables: each character as its Unicode TR39 skeleton (a Cyrillic а in an English word is a; small "
        "capitals ᴄᴀꜱɪɴᴏ are casino), combining accents dropped; ASCII stays as it is. han_variants: traditional "
        "Chinese characters as simplified (賭博 is 赌博). separators: a run of separators of any length between "
        "two letters or digits dropped: spaces, tabs, line breaks, dashes, underscores, dots, symbols (傻 逼, "
        "b  a  d, ca-sino); clause and sentence punctuation stays. Their false positives on the sample data: "
        "docs/user-guide.md")
    match: Literal["word", "prefix", "stem"] = Field(
        "word", description="How a listed word of ASCII letters matches: word: whole words only (ass is not in "
        "class); prefix: also any word that starts with it (casino: casinos, casinobonus); stem: also the word "
        "with an English ending, s, es, ed, d, ing, ings, er, ers (casinos, casino_bonus). A hit covers the "
        "word form. Other words (Chinese) match anywhere whatever this says")

    @field_validator("fold")
    @classmethod
    def _each_fold_once(cls, v: list[str]) -> list[str]:
        return sorted(set(v))  # one spelling per set of folds: lists of the same folds share one folded text


# The review template's placeholders (stages/review.py fills them; any other {...} is left as written)
REVIEW_PLACEHOLDERS = ("prompt", "output", "reasoning", "categories")
REVIEW_CATEGORIES = ["violence", "sexual", "hate", "harassment", "self_harm", "illegal", "privacy", "other"]
_REVIEW_ACTIONS = Literal["flag", "mask", "drop"]


class ReviewConfig(Section):
    """Content review by a model (``stages/review.py``): after the shards, a guard or classifier model reads each
    (prompt, output) and says ``safe`` or ``unsafe`` with categories, in a second inference pass of its own
    (mapped over the shards like ``batch_inference``: lease, worker, chunk commits, resume, result cache). The
    verdict becomes the row's ``review_verdict`` and ``review_categories``; ``action`` / ``actions`` say what an
    unsafe verdict does (flag the row, mask the output, drop the row), as the word lists' actions do.

    ``engine.task: generate`` (a guard model asked by ``template``, its answer decoded under the JSON schema
    ``{"verdict": "safe" | "unsafe", "categories": [...]}``) or ``engine.task: classify`` (a classifier: its top
    class mapped to a verdict by ``labels``; an unsafe class is the category)."""

    enabled: bool = True
    model: ModelConfig = Field(description="The review model, fetched like model: a ModelScope id, a local "
                               "folder or an object-storage prefix")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="The review model's engine (its own "
                                 "settings: a guard model is often smaller than the model it reviews); task: "
                                 "generate or classify")
    template: str | None = Field(None, description="The review prompt; {prompt}, {output}, {reasoning} and "
                                 "{categories} are filled per row (other braces stay as written). null: a prompt "
                                 "asking for the JSON verdict (generate), {output} alone (classify)")
    system_prompt: str | None = Field(None, description="A system message before the review prompt (chat only)")
    chat: bool | None = Field(None, description="Send the review prompt as a chat (the model's chat template) or "
                              "as plain text; null: chat for generate, plain text for classify")
    reasoning: bool = Field(False, description="Show the row's reasoning (the reasoning column of a reasoning "
                            "model) to the review model too: the template's {reasoning}")
    categories: list[str] = Field(default_factory=lambda: list(REVIEW_CATEGORIES), min_length=1,
                                  description="generate: the categories a verdict may name (the schema's enum)")
    max_tokens: int = Field(64, gt=0, description="generate: the verdict's token limit")
    guided_decoding: bool = Field(True, description="generate: decode the verdict under its JSON schema (vLLM); "
                                  "false: only check it (a verdict that does not parse is a review error)")
    labels: dict[str, Literal["safe", "unsafe"]] = Field(
        default_factory=dict, description="classify: each class of the model and its verdict; an unsafe class is "
        "the row's category. With engine.classify.labels, the same classes")
    action: _REVIEW_ACTIONS = Field("flag", description="What an unsafe verdict does: flag (the row keeps its "
                                    "output, review_verdict says unsafe), mask (the whole output masked), drop (the "
                                    "row goes to the errors: dropped by review: <category>)")
    actions: dict[str, _REVIEW_ACTIONS] = Field(default_factory=dict, description="Per category, overriding "
                                                "action; a verdict of several categories takes the strongest "
                                                "(drop, then mask, then flag)")
    images: Literal["text", "agreement", "content"] = Field(
        "text", description="What the review does with a row's images (image parts, input.image_columns). text: "
        "they are left out (a text-only review model reads the prompt's text and the output); agreement: the review "
        "model, a vision-language model, is shown them and asked (image_template) whether the output agrees with "
        "them: a disagreement is an unsafe verdict of image_category, with the same actions; content: shown them with "
        "the ordinary review prompt. Rows without images always get the ordinary prompt. generate only")
    image_template: str | None = Field(None, description="images: agreement: the review prompt of a row with images "
                                       "({prompt}, {output}, {reasoning}, {categories} filled as in template); null: "
                                       "a prompt asking whether the output agrees with the image, in the verdict's JSON")
    image_category: str = Field("image_mismatch", min_length=1, description="images: agreement: the category of an "
                                "output that does not agree with its image (a category of the verdict's schema, "
                                "which actions may name)")
    on_error: Literal["flag", "drop"] = Field("drop", description="A row the review could not judge (the review "
                                              "model failed on it, or its answer did not parse): drop (to the errors: "
                                              "review failed: <reason>) or flag (kept, review_verdict: error)")

    @model_validator(mode="after")
    def _settings_of_the_task(self) -> "ReviewConfig":
        task, problems = self.engine.task, []
        if task == "embed":
            problems.append("engine.task: embed gives vectors, not a verdict: use generate (a guard model) or "
                            "classify (a classifier)")
        if task == "classify":
            # compared with the defaults, not model_fields_set: with_overrides dumps every field
            defaults = type(self).model_fields
            given = [k for k in ("categories", "max_tokens", "guided_decoding")
                     if getattr(self, k) != defaults[k].get_default(call_default_factory=True)]
            problems += [f"{k}: a setting of engine.task: generate (remove it)" for k in given]
            if not self.labels:
                problems.append("labels: map each class of the classifier to safe or unsafe")
            head = self.engine.classify.labels
            if head is not None and set(head) != set(self.labels):
                problems.append(f"labels {sorted(self.labels)}: name the classes of engine.classify.labels "
                                f"{sorted(head)}, each once")
        elif self.labels:
            problems.append("labels: a setting of engine.task: classify (remove it)")
        if task == "generate" and self.guided_decoding and not self.engine.caps.guided_decoding:
            problems.append(f"guided_decoding: engine {self.engine.kind} cannot decode under a schema "
                            f"({who_can('guided_decoding')}); set guided_decoding: false to only check the verdicts")
        known = set(self.verdict_categories) if task == "generate" else \
            {k for k, v in self.labels.items() if v == "unsafe"}
        problems += [f"actions.{k}: not a category of the review ({', '.join(sorted(known))})"
                     for k in self.actions if k not in known]
        for key, template in (("template", self.template), ("image_template", self.image_template)):
            if template is None:
                continue
            named = set(re.findall(r"\{(" + "|".join(REVIEW_PLACEHOLDERS) + r")\}", template))
            if "output" not in named:
                problems.append(f"{key}: it never shows the output to review: put {{output}} in it")
            if self.reasoning and "reasoning" not in named:
                problems.append(f"{key}: reasoning is true but the template has no {{reasoning}}")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @model_validator(mode="after")
    def _image_settings(self) -> "ReviewConfig":
        problems = []
        if self.engine.task == "classify" and self.images != "text":
            problems.append(f"images: {self.images}: a classifier reads the output as text (images: text, or leave "
                            "it out)")
        defaults = type(self).model_fields
        if self.images != "agreement":
            given = [k for k in ("image_template", "image_category") if getattr(self, k) != defaults[k].default]
            problems += [f"{k}: a setting of images: agreement (remove it)" for k in given]
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def verdict_categories(self) -> list[str]:
        """The categories a generate-style verdict may name: ``categories``, and ``image_category`` where rows with
        images are asked whether the output agrees with them."""
        extra = [self.image_category] if self.images == "agreement" and self.image_category not in \
            self.categories else []
        return [*self.categories, *extra]


class FilterConfig(Section):
    enabled: bool = True
    lists: list[WordListConfig] = Field(default_factory=lambda: [
        WordListConfig(name="en", path="builtin:en", action="mask"),
        WordListConfig(name="zh", path="builtin:zh", action="mask"),
    ])
    mask_char: str = Field("*", min_length=1, max_length=1)
    case_sensitive: bool = False
    scan: list[ScannedField] = Field(default_factory=lambda: list(typing.get_args(ScannedField)), min_length=1,
                                     description="The fields every list scans unless it names its own (scan): the "
                                     "answer (output, every sample) and a reasoning model's thinking (reasoning). "
                                     "The log-probabilities' tokens and their alternatives hold both: every list "
                                     "scans them. A mask hides a hit in every copy of it (docs/user-guide.md, "
                                     "Content filter)")
    review: ReviewConfig | None = Field(None, description="Content review by a model after the word lists' "
                                        "scan (stages/review.py); null: none")


def word_list_problems(cfg: FilterConfig) -> list[str]:
    """Word lists that cannot be read: an unknown built-in, a local path that is not a regular file (missing, a
    device, a FIFO) or over ``path_policy.MAX_WORD_LIST_BYTES`` (object-storage paths are not looked at: that
    needs credentials, and the filter stage checks them when it starts)."""
    problems = []
    for i, wl in enumerate(cfg.lists):
        where = f"filter.lists.{i}.path: word list {wl.name!r}"
        resolved = path_policy.resolve(wl.path)
        if resolved.kind == "builtin":
            try:
                path_policy.builtin_file(wl.path)
            except path_policy.PathRefused as e:
                problems.append(f"{where}: {e}")
        elif resolved.kind == "local" and resolved.local_path:
            problem = path_policy.local_file_problem(resolved.local_path, path_policy.MAX_WORD_LIST_BYTES)
            if problem:
                problems.append(f"{where}: {problem} (give an existing file of one word per line, "
                                f"or builtin:en / builtin:zh)")
    return problems
