"""The tiny offline models of ``batch_llm.tiny_models`` through the real vLLM CPU engine.

The reasoning model: the template's ``enable_thinking`` switch reaches the engine's prompt, a thinking budget makes
the engine write ``</think>`` after N thinking tokens, a JSON schema applies to the answer after ``</think>``, and
vLLM's ``qwen3`` reasoning parser parts thinking from answer. The guard model answers inside a schema. The
vision-language model takes an image as a ``data:`` URL part and as a PIL image, and the image changes the answer.
The three engines run one after the other in one child process (vLLM's engine core in that process).
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
from batch_llm import tiny_models
from helpers import run_in_group, vllm_cpu_env

SCHEMA = {"type": "object", "properties": {"verdict": {"enum": ["safe", "unsafe"]}}, "required": ["verdict"],
          "additionalProperties": False}

# One child process (vLLM imported once), the three engines in turn: reasoning, guard, vision-language.
CHILD = r"""
import base64, gc, io, json, sys, time
from PIL import Image
from vllm import LLM, SamplingParams
from vllm.config import StructuredOutputsConfig
from vllm.reasoning import ReasoningParserManager
from vllm.sampling_params import StructuredOutputsParams

reasoning_dir, guard_dir, vl_dir, schema = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
out = {}
# No free whitespace in guided JSON, or a random-weight model spends its tokens on it. vLLM 0.32 reads this from the
# engine's settings only (with the xgrammar or guidance backend), not from the request's flag of the same name.
# A new config per engine: vLLM writes the engine's reasoning parser into the one it is given, and a later engine
# given the same object would hold its grammar back for a </think> that never comes.
def compact():
    return StructuredOutputsConfig(backend="xgrammar", disable_any_whitespace=True)
t = time.monotonic()
llm = LLM(model=reasoning_dir, reasoning_parser="qwen3", enforce_eager=True, max_model_len=512, seed=0,
          structured_outputs_config=compact())
out["start_s"] = time.monotonic() - t
tok = llm.get_tokenizer()
end_id = tok.convert_tokens_to_ids("</think>")
msgs = [{"role": "user", "content": "How long does the battery last?"}]
hot = dict(temperature=1.0, seed=7, ignore_eos=True)

def one(params, **kw):
    o = llm.chat(msgs, params, use_tqdm=False, **kw)[0]
    return {"prompt": tok.decode(o.prompt_token_ids, skip_special_tokens=False), "text": o.outputs[0].text,
            "ids": list(o.outputs[0].token_ids), "finish": o.outputs[0].finish_reason}

out["end_id"] = end_id
out["on"] = one(SamplingParams(max_tokens=4, **hot))
out["off"] = one(SamplingParams(max_tokens=4, **hot), chat_template_kwargs={"enable_thinking": False})
out["budget"] = {n: one(SamplingParams(max_tokens=16, thinking_token_budget=n, **hot)) for n in (1, 5)}
out["unbudgeted"] = one(SamplingParams(max_tokens=16, **hot))
guided = StructuredOutputsParams(json=schema)
out["guided"] = one(SamplingParams(max_tokens=48, temperature=1.0, seed=7, thinking_token_budget=3,
                                   structured_outputs=guided))
out["guided_off"] = one(SamplingParams(max_tokens=48, temperature=1.0, seed=7, structured_outputs=guided),
                        chat_template_kwargs={"enable_thinking": False})
thinking = ReasoningParserManager.get_reasoning_parser("qwen3")(tok)
not_thinking = ReasoningParserManager.get_reasoning_parser("qwen3")(tok, chat_template_kwargs={"enable_thinking": False})
out["split"] = {k: thinking.extract_reasoning(out[k]["text"], None) for k in ("unbudgeted", "guided")}
out["split"]["budget_5"] = thinking.extract_reasoning(out["budget"][5]["text"], None)
out["split"]["guided_off"] = not_thinking.extract_reasoning(out["guided_off"]["text"], None)
del llm
gc.collect()

t = time.monotonic()
guard = LLM(model=guard_dir, enforce_eager=True, max_model_len=512, seed=0, structured_outputs_config=compact())
out["guard_start_s"] = time.monotonic() - t
o = guard.chat([{"role": "user", "content": "Review: the battery lasts long. Verdict?"}],
               SamplingParams(max_tokens=48, temperature=1.0, seed=7, structured_outputs=guided), use_tqdm=False)[0]
out["guard"] = {"prompt": guard.get_tokenizer().decode(o.prompt_token_ids, skip_special_tokens=False),
                "text": o.outputs[0].text}
try:
    guard.chat([{"role": "user", "content": "x"}], SamplingParams(max_tokens=4, thinking_token_budget=2), use_tqdm=False)
except Exception as e:  # a budget needs a reasoning parser
    out["budget_without_parser"] = str(e)
del guard
gc.collect()

t = time.monotonic()
llm = LLM(model=vl_dir, enforce_eager=True, max_model_len=512, seed=0, limit_mm_per_prompt={"image": 1})
vl = out["vl"] = {"start_s": time.monotonic() - t}
tok = llm.get_tokenizer()
greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

def png_url(colour):
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), colour).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()

def chat(*parts):
    o = llm.chat([{"role": "user", "content": [*parts, {"type": "text", "text": "Does the text match the image?"}]}],
                 greedy, use_tqdm=False)[0]
    return {"prompt": tok.decode(o.prompt_token_ids, skip_special_tokens=False), "ids": list(o.outputs[0].token_ids)}

vl["url_red"] = chat({"type": "image_url", "image_url": {"url": png_url("red")}})
vl["url_blue"] = chat({"type": "image_url", "image_url": {"url": png_url("blue")}})
vl["pil_red"] = chat({"type": "image_pil", "image_pil": Image.new("RGB", (64, 48), "red")})
try:
    chat({"type": "image_url", "image_url": {"url": png_url("red")}},
         {"type": "image_url", "image_url": {"url": png_url("blue")}})
except Exception as e:
    vl["two_images"] = str(e)
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def reasoning() -> dict:
    """What the engines answered (the vision-language model's under "vl")."""
    folders = [str(build()) for build in (tiny_models.build_tiny_reasoning_model, tiny_models.build_tiny_guard_model,
                                          tiny_models.build_tiny_vl_model)]
    env = dict(vllm_cpu_env(), VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = run_in_group([sys.executable, "-c", CHILD, *folders, json.dumps(SCHEMA)], env=env, timeout=600)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.fixture(scope="module")
def vl(reasoning) -> dict:
    return reasoning["vl"]


def _sha(path: Path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_a_build_is_reused_and_an_older_recipe_rebuilt_with_the_same_weights(tmp_path):
    folder = tiny_models.build_tiny_reasoning_model(tmp_path)
    assert folder == tmp_path / "models" / "batch-llm--tiny-qwen3" / "snapshots" / "master"
    weights = folder / "model.safetensors"
    built_at, digest = weights.stat().st_mtime_ns, _sha(folder)
    assert tiny_models.build_tiny_reasoning_model(tmp_path) == folder and weights.stat().st_mtime_ns == built_at
    (folder / tiny_models.MARKER).write_text(json.dumps({"model_id": tiny_models.TINY_REASONING_ID, "recipe": 0}))
    assert tiny_models.build_tiny_reasoning_model(tmp_path) == folder
    assert weights.stat().st_mtime_ns != built_at and _sha(folder) == digest  # rebuilt; the seed is fixed
    assert [p.name for p in folder.parent.iterdir()] == ["master"]  # no partial or stale folder left behind


def test_the_reasoning_tokenizer_keeps_the_think_tags_as_text():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models.build_tiny_reasoning_model())
    ids = tok.encode("<think>\nhm</think>\n\nyes<|im_end|>", add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("<think>") and tok.convert_tokens_to_ids("</think>") in ids
    # Not special (as in Qwen3's tokenizer): an engine that skips special tokens still writes them out.
    assert tok.decode(ids, skip_special_tokens=True) == "<think>\nhm</think>\n\nyes"
    assert tok.eos_token == "<|im_end|>"
    text = "电池续航 battery {\"verdict\": \"safe\"} é 🙂"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_the_thinking_switch_changes_the_engines_prompt(reasoning):
    assert reasoning["on"]["prompt"].endswith("<|im_start|>assistant\n<think>\n")
    assert reasoning["off"]["prompt"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_the_budget_ends_thinking_after_n_tokens(reasoning):
    end_id = reasoning["end_id"]
    for n, run in reasoning["budget"].items():
        # The budget counts from <think>: the prompt's newline after it is the first thinking token.
        assert run["ids"].index(end_id) == int(n) - 1, run
    reasoning_text, answer = reasoning["split"]["budget_5"]
    assert reasoning["budget"]["5"]["text"] == reasoning_text + "</think>" + answer
    assert end_id not in reasoning["unbudgeted"]["ids"]
    assert reasoning["split"]["unbudgeted"] == [reasoning["unbudgeted"]["text"], None]  # thinking never ended
    assert reasoning["start_s"] < 240  # tiny: not a speed check (94 s seen under make test's load)


def test_the_schema_applies_to_the_answer_after_thinking(reasoning):
    reasoning_text, answer = reasoning["split"]["guided"]
    assert reasoning_text and "{" not in reasoning["guided"]["text"].split("</think>")[0]
    assert json.loads(answer)["verdict"] in ("safe", "unsafe") and reasoning["guided"]["finish"] == "stop"
    # Thinking off: the grammar starts at once, and the parser built for it reads the whole text as the answer.
    assert reasoning["split"]["guided_off"][0] is None
    assert json.loads(reasoning["split"]["guided_off"][1])["verdict"] in ("safe", "unsafe")


def test_the_guard_model_answers_inside_the_schema(reasoning):
    assert reasoning["guard"]["prompt"].endswith("Verdict?<|im_end|>\n<|im_start|>assistant\n")
    assert "<think>" not in reasoning["guard"]["prompt"]
    assert json.loads(reasoning["guard"]["text"])["verdict"] in ("safe", "unsafe")
    assert "reasoning_config is not configured" in reasoning["budget_without_parser"]


def test_the_vision_language_model_takes_an_image_url_and_a_pil_image(vl):
    image_tokens = "<image>" * tiny_models.VL_QUERY_TOKENS
    for run in (vl["url_red"], vl["url_blue"], vl["pil_red"]):
        assert run["prompt"].startswith(image_tokens + "<|im_start|>user\n") and len(run["ids"]) == 6, run
    assert vl["url_red"]["ids"] == vl["pil_red"]["ids"]  # the same picture, however it came
    assert vl["url_red"]["ids"] != vl["url_blue"]["ids"]  # the picture reaches the model
    assert "at most 1 image" in vl["two_images"].lower(), vl["two_images"]
    assert vl["start_s"] < 240  # tiny: not a speed check (94 s seen under make test's load)
