"""The packaged default model, SmolLM2-135M-Instruct: the names that select it and the sampling
defaults its authors publish. Free of torch, so the command line can read it cheaply."""

from __future__ import annotations

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_ALIASES = frozenset({DEFAULT_MODEL.lower(), "default"})

# The sampling HuggingFaceTB recommend for SmolLM2-135M-Instruct: the model card's usage example
# (https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct, "model.generate(inputs,
# max_new_tokens=50, temperature=0.2, top_p=0.9, do_sample=True)"). The package ships a GGUF
# without the hub's generation_config.json; `--generation-config auto` applies these instead.
PUBLISHED_SAMPLING = {"temperature": 0.2, "top_p": 0.9}
PUBLISHED_SAMPLING_SOURCE = f"the sampling {DEFAULT_MODEL}'s authors recommend on its model card"


def names_default_model(model: str) -> bool:
    """Whether `model` names the default model: its name or "default", in any case."""
    return model.strip().lower() in _ALIASES
