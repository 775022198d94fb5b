"""The model's sampling defaults, from its `generation_config.json` (vLLM's `--generation-config`).

A checkpoint may ship a Hugging Face `generation_config.json` whose sampling fields its authors recommend. With
`generation_config="auto"` (the default, as vLLM's) those fields are the defaults of every request that does not
set them: `LLM.generate` without `SamplingParams`, and every field a server request leaves out. `"vllm"` ignores
the file (the library's own defaults: temperature 1, no penalties); a folder path reads the
`generation_config.json` in that folder instead of the model's.

Fields read, as vLLM reads them: `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty` and
`max_new_tokens` (the default `max_tokens`). Others (`do_sample`, `bos_token_id`, ...) are not sampling defaults
here; as in vLLM, `do_sample: false` does not make the defaults greedy (write `"temperature": 0`). A default the
engine cannot honour for every request (a repetition penalty under speculative decoding, which refuses logits
processors) is left out with a warning at start-up (`engine_defaults`), so that requests setting nothing still run;
a request that asks for it itself still gets the engine's error.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from deepserve.core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

FILE_NAME = "generation_config.json"
#: generation_config.json's field -> SamplingParams' field
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(source: str, model_dir: str | Path | None) -> dict[str, Any]:
    """The sampling defaults as `SamplingParams` keyword arguments: {} for `"vllm"`, or for `"auto"` where the
    model has no `generation_config.json`. A malformed file or a value `SamplingParams` refuses is a ValueError
    naming the file and the field."""
    if source == "vllm":
        return {}
    if source == "auto":
        if model_dir is None or not (Path(model_dir) / FILE_NAME).is_file():
            return {}
        path = Path(model_dir) / FILE_NAME
    else:
        path = Path(source) / FILE_NAME
        if not path.is_file():
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder holding {FILE_NAME}; "
                             f"{path} does not exist")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} cannot be read as JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(raw).__name__}")
    defaults = {FIELDS[name]: raw[name] for name in FIELDS if raw.get(name) is not None}
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    if defaults:
        logger.info("sampling defaults from %s: %s (generation_config='vllm' ignores them)", path, defaults)
    return defaults


#: defaults that are logits processors (`SamplingParams.uses_logits_processors`), which speculative decoding refuses
PROCESSOR_FIELDS = ("repetition_penalty",)


def engine_defaults(defaults: dict[str, Any], speculative: bool) -> dict[str, Any]:
    """`defaults` less what an engine with (`speculative`) or without speculative decoding cannot apply to every
    request, each left-out field logged as a warning."""
    if not speculative:
        return defaults
    dropped = {name: defaults[name] for name in PROCESSOR_FIELDS if defaults.get(name, 1.0) != 1.0}
    if dropped:
        logger.warning("the model's generation_config.json sets %s, which speculative decoding does not support: "
                       "not applied as a default (requests that ask for it get an error)", dropped)
    return {name: value for name, value in defaults.items() if name not in dropped}
