"""Quantize stage: a W4A16 (AWQ) or FP8_DYNAMIC export with llm-compressor, cached by model, scheme and
settings.

Two halves, two Python environments (llm-compressor pins a compressed-tensors that vLLM does not accept):

* ``quantize_model`` runs in the main environment. It finds the cached export for
  (model key, scheme, method, group size, calibration settings), or starts the quantize environment's
  Python on ``python -m batch_llm.stages.quantize MODEL_DIR OUT_DIR CFG_JSON`` under a file lock, so two tasks
  never export the same thing twice. It never imports llm-compressor (nor torch).
* ``export_checkpoint`` runs inside the quantize environment. W4A16: AWQ (activation-aware scale search,
  then group-wise int4 weights with zero points) or plain round-to-nearest ("pack-quantized"). FP8_DYNAMIC:
  FP8 e4m3 weights with a scale per output channel, activations quantized per token by the engine at run
  time; no calibration data ("float-quantized"). Both are saved as compressed-tensors checkpoints
  (``quantization_config.quant_method == "compressed-tensors"`` in config.json), which vLLM detects by
  itself. The tokenizer files and the chat template travel with it. The folder appears atomically: it is
  written under a temporary sibling name and renamed when complete.

Calibration data is built offline from a small English text bundled below, rendered through the model's
own chat template; nothing is downloaded.

Group size: it must divide every linear layer's input size, and vLLM's CPU kernel (CPUWNA16) wants layer
sizes that are multiples of 32. Unset (``quantize.group_size: null``, the default), it is the largest of
128, 64 and 32 that divides the model's layer sizes (hidden size first, read from its config.json):
SmolLM2-135M (hidden 576, intermediate 1536) gets 64. The choice is logged and recorded in the result
(``group_size``, ``group_size_chosen``). A size set explicitly that does not divide them fails before
anything starts.

    python -m batch_llm.stages.quantize MODEL_DIR OUT_DIR '{"method": "awq", "group_size": 64}'
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batch_llm.config import PipelineConfig, QuantizeConfig

if TYPE_CHECKING:  # the exporter runs this module in the quantize environment, which has no msgspec
    from batch_llm.layout import RunLayout
    from batch_llm.manifests import FetchManifest, ModelRef, QuantizeManifest

log = logging.getLogger(__name__)

#: Bump when the export's output changes for the same settings: old cache entries are then ignored.
EXPORT_VERSION = 1
#: Written into the export folder last (before the rename); its presence marks a complete export.
INFO_FILE = "quantize_info.json"
#: Files copied from the source model when the tokenizer's ``save_pretrained`` did not write them.
_SIDE_FILES = ("chat_template.jinja", "chat_template.json", "generation_config.json", "tokenizer.json",
               "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
               "merges.txt", "added_tokens.json")
_OUTPUT_TAIL_LINES = 60

REPO_ROOT = Path(__file__).resolve().parents[3]


class QuantizeError(RuntimeError):
    """The export failed; the message carries the tail of the exporter's output."""


# --------------------------------------------------------------------------------------------------------
# Main environment: cache lookup, lock, subprocess
# --------------------------------------------------------------------------------------------------------

def default_quantized_cache_dir() -> Path:
    """``$BATCH_LLM_MODEL_CACHE/quantized``, else ``<checkout>/.cache/modelscope/quantized``."""
    from batch_llm.demo_model import default_cache_dir

    return Path(default_cache_dir()) / "quantized"


def quantize_python(cfg: QuantizeConfig) -> str:
    """The quantize environment's interpreter: ``cfg.python``, ``$BATCH_LLM_QUANTIZE_PYTHON`` or
    ``<repo>/.venv-quantize/bin/python``."""
    return cfg.python or os.environ.get("BATCH_LLM_QUANTIZE_PYTHON") or str(
        REPO_ROOT / ".venv-quantize" / "bin" / "python")


def cache_settings(cfg: QuantizeConfig, model_key: str) -> dict:
    """Everything that changes the exported weights; the cache key is its hash."""
    if cfg.scheme == "FP8_DYNAMIC":  # data-free: the model and the scheme are all there is
        return {"model_key": model_key, "scheme": cfg.scheme, "export_version": EXPORT_VERSION}
    settings: dict[str, Any] = {"model_key": model_key, "scheme": cfg.scheme, "method": cfg.method,
                                "group_size": cfg.group_size, "export_version": EXPORT_VERSION}
    if cfg.method == "awq":  # round-to-nearest reads no calibration data
        settings.update(awq_grid=cfg.awq_grid, calibration_samples=cfg.calibration_samples,
                        calibration_seq_len=cfg.calibration_seq_len)
    return settings


def cache_entry_dir(cfg: QuantizeConfig, model_key: str) -> Path:
    """``<cache>/<readable model key>-<scheme>[-<method>-g<group>]-<hash of all settings>``."""
    settings = cache_settings(cfg, model_key)
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    readable = re.sub(r"[^A-Za-z0-9_.-]+", "--", model_key).strip("-.")[:80] or "model"
    root = Path(os.path.expanduser(cfg.cache_dir)) if cfg.cache_dir else default_quantized_cache_dir()
    detail = f"-{cfg.method}-g{cfg.group_size}" if cfg.scheme == "W4A16" else ""
    return root / f"{readable}-{cfg.scheme}{detail}-{digest}"


def read_export_info(out_dir: Path) -> dict | None:
    """The info of a complete export in ``out_dir``, or None when there is none."""
    try:
        info = json.loads((Path(out_dir) / INFO_FILE).read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None
    return info if (Path(out_dir) / "config.json").exists() else None


GROUP_SIZE_CHOICES = (128, 64, 32)


def _layer_sizes(model_dir: str | Path) -> dict[str, int] | None:
    """The sizes a group must divide (hidden, intermediate, attention width), from config.json; None when
    the folder has no readable config."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    config = config.get("text_config") or config
    sizes = {k: config[k] for k in ("hidden_size", "intermediate_size") if isinstance(config.get(k), int)}
    if isinstance(config.get("num_attention_heads"), int):
        head_dim = config.get("head_dim") or (sizes.get("hidden_size", 0) // config["num_attention_heads"])
        if head_dim:
            sizes["num_attention_heads*head_dim"] = config["num_attention_heads"] * head_dim
    return sizes


def choose_group_size(model_dir: str | Path) -> int:
    """The largest of 128, 64, 32 that divides the model's hidden size and its other layer sizes."""
    sizes = _layer_sizes(model_dir)
    if not sizes or "hidden_size" not in sizes:
        raise ValueError(f"quantize.group_size is unset and {model_dir} has no config.json with a hidden_size "
                         "to choose it from; set quantize.group_size")
    for g in GROUP_SIZE_CHOICES:
        if all(v % g == 0 for v in sizes.values()):
            return g
    raise ValueError(f"quantize.group_size: none of {list(GROUP_SIZE_CHOICES)} divides the model's layer sizes "
                     f"{sizes}; set quantize.group_size to a divisor of them")


def resolve_group_size(model_dir: str | Path, cfg: QuantizeConfig) -> tuple[QuantizeConfig, str]:
    """(the config with its group size set, "configured" or "auto"): an unset group size is chosen from the
    model (``choose_group_size``); a scheme without groups (FP8_DYNAMIC) gives (cfg, "not applicable")."""
    if cfg.scheme != "W4A16":
        return cfg, "not applicable"
    if cfg.group_size is not None:
        return cfg, "configured"
    g = choose_group_size(model_dir)
    log.info("quantize: group_size unset; chose %d from %s's layer sizes %s", g, model_dir, _layer_sizes(model_dir))
    return cfg.model_copy(update={"group_size": g}), "auto"


def check_settings(model_dir: str | Path, cfg: QuantizeConfig) -> None:
    """Fails early, before any process starts, on settings the export would reject."""
    if cfg.scheme != "W4A16":
        return  # FP8_DYNAMIC has no settings the model could reject
    if cfg.method == "awq" and cfg.awq_grid < 3:
        # llm-compressor's grid with duo scaling is [identity] + awq_grid - 1 points spaced 1/(awq_grid-2)
        raise ValueError(f"quantize.awq_grid={cfg.awq_grid}: AWQ needs a grid of at least 3 points")
    if cfg.group_size is not None:  # unset: resolve_group_size chooses one that divides the layers
        check_group_size(model_dir, cfg.group_size)


def check_group_size(model_dir: str | Path, group_size: int) -> None:
    """Fails early when the group size does not divide the linear layers' input sizes.

    vLLM's CPU kernel (CPUWNA16) also wants input and output sizes that are multiples of 32, and a group
    must not straddle two rows: SmolLM2-135M (hidden 576, intermediate 1536) takes 32, 64 or 192, not 128.
    """
    sizes = _layer_sizes(model_dir)
    if sizes is None:
        return  # the exporter reports a broken model folder itself
    bad = {k: v for k, v in sizes.items() if v % group_size}
    if bad:
        common = 0
        for v in sizes.values():
            common = _gcd(common, v)
        options = [g for g in (32, 64, 128, 256) if common % g == 0] or [d for d in (16, 8) if common % d == 0]
        raise ValueError(f"quantize.group_size={group_size} does not divide the model's layer sizes {bad}; "
                         f"use one of {options or 'a divisor of ' + str(common)}")


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def quantize_model(model_dir: str, cfg: QuantizeConfig, *, model_key: str) -> dict:
    """Returns the export of ``model_dir`` under ``cfg.scheme``, exporting it first unless it is cached.

    ``model_key`` identifies the source weights (model id, revision and a content hash, chosen by the
    caller); together with the scheme, method, group size and calibration settings it keys the cache.
    Result: the export's info (``method``, ``scheme``, ``group_size``, ``size_bytes``, ``export_seconds``,
    ...) plus ``model_dir``, ``cache_hit``, ``seconds`` (this call's wall time) and ``group_size_chosen``
    ("auto" when ``cfg.group_size`` was unset and chosen from the model, "configured", or "not applicable").
    """
    started = time.monotonic()
    cfg, chosen = resolve_group_size(model_dir, cfg)
    out_dir = cache_entry_dir(cfg, model_key)
    info = read_export_info(out_dir)
    if info is not None:
        log.info("quantize: cache hit %s", out_dir)
        return {**_result(info, out_dir, True, started), "group_size_chosen": chosen}

    check_settings(model_dir, cfg)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    lock_path = out_dir.with_name(f".{out_dir.name}.lock")
    with open(lock_path, "a+") as lock:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("quantize: another process is exporting %s; waiting for it", out_dir.name)
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        info = read_export_info(out_dir)  # the other process may have finished it meanwhile
        if info is not None:
            log.info("quantize: cache hit %s (exported by another process)", out_dir)
            return {**_result(info, out_dir, True, started), "group_size_chosen": chosen}
        for stale in out_dir.parent.glob(f".{out_dir.name}.*.partial"):  # left by a killed exporter
            shutil.rmtree(stale, ignore_errors=True)
        _run_exporter(Path(model_dir), out_dir, cfg)
    info = read_export_info(out_dir)
    if info is None:
        raise QuantizeError(f"quantize: the exporter finished but {out_dir} holds no complete export")
    return {**_result(info, out_dir, False, started), "group_size_chosen": chosen}


def _result(info: dict, out_dir: Path, cache_hit: bool, started: float) -> dict:
    return {**info, "export_seconds": info.get("seconds"), "model_dir": str(out_dir), "cache_hit": cache_hit,
            "seconds": round(time.monotonic() - started, 3)}


def _run_exporter(model_dir: Path, out_dir: Path, cfg: QuantizeConfig) -> None:
    python = quantize_python(cfg)
    if not Path(python).exists() and shutil.which(python) is None:
        raise QuantizeError(f"quantize: no interpreter at {python}; build the quantize environment "
                            "(scripts/setup.sh) or set quantize.python / $BATCH_LLM_QUANTIZE_PYTHON")
    # only what was set: settings of another scheme at their defaults would be refused there
    cmd = [python, "-m", "batch_llm.stages.quantize", str(model_dir), str(out_dir), cfg.model_dump_json(exclude_unset=True)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.setdefault("TQDM_MININTERVAL", "10")  # progress bars: a log line per bar every 10 s, not per step
    # No PYTHONPATH: batch-llm is installed in the quantize environment too (scripts/setup.sh, the image,
    # `pip install "batch-llm[quantize]"`), so the exporter runs the version installed there.
    detail = f" {cfg.method}, group {cfg.group_size}" if cfg.scheme == "W4A16" else ""
    log.info("quantize: exporting %s (%s%s) into %s with %s", model_dir, cfg.scheme, detail, out_dir, python)
    tail: deque[str] = deque(maxlen=_OUTPUT_TAIL_LINES)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=env, text=True, errors="replace", bufsize=1, start_new_session=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            # tqdm redraws with carriage returns: keep the last state of the line
            line = line.rsplit("\r", 1)[-1] if "\r" in line else line
            if line.strip():
                tail.append(line)
                log.info("quantize| %s", line)
        rc = proc.wait()
    except BaseException:  # a killed task must not leave the exporter running
        stop_exporter(proc)
        raise
    if rc != 0:
        raise QuantizeError(f"quantize: the exporter failed (exit code {rc}) for {model_dir}; "
                            f"last output:\n" + "\n".join(tail))


STOP_GRACE_SECONDS = 10.0  # how long a stop waits for the exporter's group to end after SIGTERM, then SIGKILL


def stop_exporter(proc: subprocess.Popen) -> None:
    """Ends the exporter's process group (SIGTERM, then SIGKILL, until no live member is left), then reaps it.

    The group is named by the exporter's pid, which names it only until the exporter is reaped (then the pid
    may be anyone's): ``WorkerHandle`` signals only an unreaped leader (a zombie still holds its pid) and reaps
    it after the group is gone, so a child of the exporter is not left running either."""
    from batch_llm.host.procgroup import GroupLeader  # WorkerHandle's group ending; worker itself sits above stages

    GroupLeader(proc).stop(grace_seconds=STOP_GRACE_SECONDS)


# --------------------------------------------------------------------------------------------------------
# Quantize environment: the export itself
# --------------------------------------------------------------------------------------------------------

# A small English calibration text (written for this project), used as chat turns and running prose.
_CALIBRATION_CHATS = [
    ("What is the capital of France?", "The capital of France is Paris, a city on the river Seine known for "
     "its museums, its cafés and the Eiffel Tower."),
    ("Summarize why the sky looks blue.", "Sunlight contains all colours. Air molecules scatter short, blue "
     "wavelengths much more than long, red ones, so blue light reaches our eyes from every direction."),
    ("Write a haiku about autumn.", "Maple leaves drifting\ncold wind over empty fields\nthe geese call goodbye"),
    ("How do I reverse a list in Python?", "Use `items.reverse()` to reverse it in place, or "
     "`list(reversed(items))` and `items[::-1]` to get a reversed copy."),
    ("Translate 'good morning' into Spanish and German.", "In Spanish it is 'buenos días'; in German, "
     "'guten Morgen'."),
    ("Explain what a database index does.", "An index is a sorted structure, often a B-tree, that lets the "
     "database find rows by a column's value without scanning the whole table, at the cost of extra "
     "storage and slower writes."),
    ("Give me three tips for better sleep.", "1. Go to bed at the same time every night. 2. Keep the bedroom "
     "dark, quiet and cool. 3. Avoid caffeine and bright screens in the evening."),
    ("What is 17 multiplied by 23?", "17 × 23 = 391."),
    ("Classify the sentiment: 'The delivery was late and the box was damaged.'", "Negative. The customer "
     "complains about a late delivery and a damaged package."),
    ("Who wrote 'Pride and Prejudice'?", "Jane Austen wrote 'Pride and Prejudice', published in 1813."),
    ("Describe photosynthesis in one paragraph.", "Photosynthesis is the process by which plants, algae and "
     "some bacteria use light energy to turn water and carbon dioxide into glucose and oxygen. It takes "
     "place in the chloroplasts, where chlorophyll absorbs mostly red and blue light."),
    ("Extract the date from: 'The meeting moved to 14 March 2025 at 10am.'", "14 March 2025."),
]
_CALIBRATION_PROSE = [
    "The history of the printing press shows how a single invention can change the way ideas travel. Before "
    "movable type, books were copied by hand, slowly and at great cost. Within fifty years of Gutenberg's "
    "first Bible, presses were running in more than two hundred European cities.",
    "To bake simple bread, mix five hundred grams of flour with ten grams of salt, seven grams of dried "
    "yeast and about three hundred and fifty millilitres of warm water. Knead for ten minutes, let the dough "
    "rise for an hour, shape it, let it rise again and bake it at two hundred and twenty degrees.",
    "The function reads the configuration file, validates every key and returns a typed object. When a "
    "value is missing, the default applies; when a key is unknown, the function raises an error that names "
    "the file and the key, so that a typo never passes silently.",
    "Rivers shape the land around them. Over thousands of years they carve valleys, carry sediment to the "
    "sea and build deltas where they slow down. Many early civilisations grew along rivers such as the "
    "Nile, the Tigris, the Euphrates, the Indus and the Yellow River.",
    "Dear team, thank you for your work on the quarterly report. The numbers look good: revenue grew by "
    "eight percent and costs stayed flat. Please send me your comments by Friday so that we can publish "
    "the final version next week. Best regards, Anna.",
    "In mathematics, a prime number is a natural number greater than one that has no divisors other than "
    "one and itself. The first primes are 2, 3, 5, 7, 11 and 13. Euclid proved that there are infinitely "
    "many of them more than two thousand years ago.",
    "The train to the coast leaves at 8:15 from platform four. The journey takes two hours and ten minutes, "
    "with a change at the junction. Tickets bought online are cheaper, and children under twelve travel "
    "for half the price.",
    "Good software tests are small, fast and independent. Each one checks a single behaviour, sets up the "
    "data it needs and leaves nothing behind. When a test fails, its name and message should tell the "
    "reader what broke without opening a debugger.",
    "Coffee was first cultivated in Yemen and spread through the Ottoman Empire to Europe in the "
    "seventeenth century. Today Brazil, Vietnam and Colombia grow most of the world's coffee, and billions "
    "of cups are drunk every day.",
    "The patient reported a mild headache and a sore throat for three days, without fever. The doctor "
    "recommended rest, plenty of fluids and a follow-up visit if the symptoms did not improve within a "
    "week.",
]


def calibration_token_ids(tokenizer: Any, samples: int, seq_len: int, seed: int = 0) -> list[list[int]]:
    """``samples`` token sequences of exactly ``seq_len`` tokens, built offline.

    Each sample is a chat (one or more turns from the bundled text, rendered by the model's chat template
    when it has one) followed by running prose, cut at ``seq_len`` tokens.
    """
    import random

    rng = random.Random(seed)
    out: list[list[int]] = []
    for _ in range(samples):
        turns = rng.sample(_CALIBRATION_CHATS, k=min(len(_CALIBRATION_CHATS), rng.randint(1, 3)))
        messages = []
        for q, a in turns:
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        ids: list[int] = []
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(messages, tokenize=False)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer("\n\n".join(f"{q}\n{a}" for q, a in turns))["input_ids"]
        while len(ids) < seq_len:
            ids += tokenizer("\n\n" + rng.choice(_CALIBRATION_PROSE), add_special_tokens=False)["input_ids"]
        out.append(list(ids[:seq_len]))
    return out


def _bypass_pin_memory_without_accelerator() -> None:
    """llm-compressor's AWQ pins its activation cache for faster host-to-device copies; on a host without
    an accelerator ``Tensor.pin_memory()`` raises. Pinning buys nothing there: make it a no-op."""
    import torch
    from llmcompressor.pipelines.cache import IntermediatesCache

    if not torch.accelerator.is_available():
        IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def export_checkpoint(model_dir: Path, out_dir: Path, cfg: QuantizeConfig) -> dict:
    """Exports ``model_dir`` under ``cfg.scheme`` as a compressed-tensors checkpoint into ``out_dir``
    (atomically).

    Runs in the quantize environment (imports llm-compressor). W4A16 with ``cfg.method`` ``awq`` (grid
    search of per-channel scales on calibration activations, ``cfg.awq_grid`` points, then group-wise int4)
    or ``rtn`` (group-wise int4 by round-to-nearest, no data); FP8_DYNAMIC (no data). Returns the info also
    written as ``quantize_info.json``.
    """
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    started = time.monotonic()
    existing = read_export_info(out_dir)
    if existing is not None:
        return existing

    import torch
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _bypass_pin_memory_without_accelerator()
    cfg, _ = resolve_group_size(model_dir, cfg)  # quantize_model passes it resolved; a direct call may not
    check_settings(model_dir, cfg)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    model.eval()
    if cfg.scheme == "W4A16":
        recipe, kwargs = _w4a16_recipe(cfg, tokenizer)
    elif cfg.scheme == "FP8_DYNAMIC":
        recipe, kwargs = _fp8_dynamic_recipe(), {}
    else:
        raise ValueError(f"unsupported scheme {cfg.scheme!r}")

    detail = f"{cfg.method} group {cfg.group_size} " if cfg.scheme == "W4A16" else ""
    print(f"quantize: {cfg.scheme} {detail}on {model_dir} "
          f"(torch {torch.__version__}, {torch.get_num_threads()} threads)", flush=True)
    with torch.no_grad():
        model = oneshot(model=model, tokenizer=tokenizer, recipe=recipe, **kwargs)
    quantized_at = time.monotonic()

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.{uuid.uuid4().hex[:8]}.partial")
    try:
        model.save_pretrained(tmp, save_compressed=True)
        tokenizer.save_pretrained(tmp)
        for name in _SIDE_FILES:
            if (model_dir / name).is_file() and not (tmp / name).exists():
                shutil.copy2(model_dir / name, tmp / name)
        _check_export(tmp, cfg.scheme)
        info = _export_info(cfg, model_dir)
        info["quantize_seconds"] = round(quantized_at - started, 1)
        info["seconds"] = round(time.monotonic() - started, 1)
        info["size_bytes"] = _dir_size(tmp)
        # where llm-compressor ran the calibration (it onloads layers to the GPU when there is one)
        info["accelerator"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=1) + "\n")
        try:
            os.rename(tmp, out_dir)
        except OSError:
            won = read_export_info(out_dir)  # a complete export won the race: keep it
            if won is None:
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            return won
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return info


def _w4a16_recipe(cfg: QuantizeConfig, tokenizer: Any) -> tuple[list, dict]:
    """(recipe, oneshot keyword arguments) of the W4A16 export: AWQ with calibration data, or RTN."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.quantization import QuantizationModifier

    # W4A16: int4 weights, one scale and one zero point per group of `group_size` input channels; 16-bit
    # activations (llm-compressor's W4A16_ASYM preset, with our group size). Zero points are what AWQ
    # was made for and measurably better here (SmolLM2-135M perplexity on held-out text, bf16 32.0:
    # AWQ asymmetric 40-42, symmetric 47-53; RTN asymmetric 45, symmetric 46). vLLM's kernels take
    # both (CPUWNA16: uint4 with zero points, uint4b8 without).
    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group",
                                 group_size=cfg.group_size, dynamic=False),
    )
    quant = QuantizationModifier(config_groups={"group_0": scheme}, ignore=["lm_head"])
    if cfg.method == "rtn":
        return [quant], {}
    if cfg.method != "awq":
        raise ValueError(f"unknown quantize method {cfg.method!r}")
    from datasets import Dataset
    from llmcompressor.modifiers.transform.awq import AWQModifier

    ids = calibration_token_ids(tokenizer, cfg.calibration_samples, cfg.calibration_seq_len)
    dataset = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]})
    kwargs = dict(dataset=dataset, num_calibration_samples=len(ids), max_seq_length=cfg.calibration_seq_len,
                  shuffle_calibration_samples=False, batch_size=1)
    return [AWQModifier(n_grid=cfg.awq_grid, duo_scaling=True), quant], kwargs


def _fp8_dynamic_recipe() -> list:
    """llm-compressor's FP8_DYNAMIC preset: e4m3 weights, a scale per output channel (min-max, no data);
    activations per token at run time. lm_head stays 16-bit (its errors reach every logit)."""
    from llmcompressor.modifiers.quantization import QuantizationModifier

    return [QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"])]


def _export_info(cfg: QuantizeConfig, model_dir: Path) -> dict:
    """The export's record (quantize_info.json), before its timings and size."""
    w4 = cfg.scheme == "W4A16"
    awq = w4 and cfg.method == "awq"
    return {
        "method": cfg.method if w4 else "fp8_dynamic", "scheme": cfg.scheme,
        "group_size": cfg.group_size if w4 else None, "format": "compressed-tensors", "zero_point": w4,
        "awq_grid": cfg.awq_grid if awq else None,
        "calibration_samples": cfg.calibration_samples if awq else 0,
        "calibration_seq_len": cfg.calibration_seq_len if awq else 0,
        "source_model_dir": str(model_dir), "export_version": EXPORT_VERSION, "versions": _versions(),
    }


#: What each scheme's config.json must say: (weight type, bits).
_EXPECTED_WEIGHTS = {"W4A16": ("int", 4), "FP8_DYNAMIC": ("float", 8)}


def _check_export(path: Path, scheme: str = "W4A16") -> None:
    """The export must carry a compressed-tensors quantization config with the scheme's weights."""
    qc = json.loads((path / "config.json").read_text()).get("quantization_config") or {}
    if qc.get("quant_method") != "compressed-tensors":
        raise QuantizeError(f"export has no compressed-tensors quantization_config: {qc}")
    weights = {(g.get("weights", {}).get("type"), g.get("weights", {}).get("num_bits"))
               for g in (qc.get("config_groups") or {}).values()}
    if weights != {_EXPECTED_WEIGHTS[scheme]}:
        raise QuantizeError(f"export's weights are {sorted(weights)}, not {scheme}'s {_EXPECTED_WEIGHTS[scheme]}")
    if not any(path.glob("*.safetensors")):
        raise QuantizeError("export wrote no safetensors")


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("llmcompressor", "compressed-tensors", "torch", "transformers"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 3:
        print("usage: python -m batch_llm.stages.quantize MODEL_DIR OUT_DIR CFG_JSON", file=sys.stderr)
        return 2
    cfg = QuantizeConfig.model_validate_json(argv[2])
    info = export_checkpoint(Path(argv[0]), Path(argv[1]), cfg)
    print("quantize: done " + json.dumps(info), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())


def quantize(cfg: PipelineConfig, layout: RunLayout, model: ModelRef | FetchManifest | dict) -> QuantizeManifest:
    """The W4A16 or FP8_DYNAMIC export when enabled (cached by model, revision, scheme and settings);
    otherwise the model as is."""
    from batch_llm.manifests import ModelRef, QuantizeManifest

    ref = ModelRef.of(model)
    if not cfg.quantize.enabled:
        m = QuantizeManifest(id=ref.id, revision=ref.revision, local_dir=ref.local_dir, model_key=ref.model_key,
                             quantized=False, lora_dir=ref.lora_dir)
    else:
        q = quantize_model(ref.local_dir, cfg.quantize, model_key=ref.model_key)
        m = QuantizeManifest(id=ref.id, revision=ref.revision, local_dir=q["model_dir"], quantized=True,
                             quantization=q, model_key=f"{ref.model_key}+{Path(q['model_dir']).name}",
                             lora_dir=ref.lora_dir)
    m.write(layout.stage("quantize").path())
    return m
