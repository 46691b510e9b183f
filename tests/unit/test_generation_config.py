"""--generation-config auto|vllm|FOLDER: which sampling defaults each mode gives, how a request's
own values win over them, and the start-up errors of a file that cannot be used."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvbridge.engine.setup.default_model import PUBLISHED_SAMPLING
from kvbridge.engine.setup.generation_config import (NO_DEFAULTS, GenerationConfigError, SamplingDefaults,
                                               sampling_defaults, startup_lines)
from kvbridge.server import protocol as p

FIELDS = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
          "max_new_tokens": 7}


def model_folder(tmp_path: Path, values: dict | str | None, name: str = "model") -> Path:
    """A folder as `kvbridge serve` checks it (config.json), with `values` as its generation_config.json."""
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    if values is not None:
        text = values if isinstance(values, str) else json.dumps(values)
        (folder / "generation_config.json").write_text(text)
    return folder


def test_auto_reads_the_model_folders_sampling_fields_and_ignores_the_rest(tmp_path: Path) -> None:
    folder = model_folder(tmp_path, {**FIELDS, "do_sample": True, "bos_token_id": 1, "eos_token_id": [2, 3]})
    got = sampling_defaults("auto", str(folder))
    assert got.as_dict() == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05,
                             "repetition_penalty": 1.1, "max_tokens": 7}
    assert got.source == str(folder / "generation_config.json")


def test_auto_without_a_generation_config_or_for_a_gguf_has_no_defaults(tmp_path: Path) -> None:
    assert sampling_defaults("auto", str(model_folder(tmp_path, None))) is NO_DEFAULTS
    assert sampling_defaults("auto", str(model_folder(tmp_path, {"bos_token_id": 1}, "ids-only"))) is NO_DEFAULTS
    assert sampling_defaults("auto", str(tmp_path / "model.gguf")) is NO_DEFAULTS


def test_auto_gives_the_default_model_its_published_sampling() -> None:
    for name in ("SmolLM2-135M-Instruct", "default", "smollm2-135m-instruct"):
        assert sampling_defaults("auto", name).as_dict() == PUBLISHED_SAMPLING


def test_vllm_ignores_the_folder_and_the_published_sampling(tmp_path: Path) -> None:
    assert sampling_defaults("vllm", str(model_folder(tmp_path, FIELDS))) is NO_DEFAULTS
    assert sampling_defaults("vllm", "SmolLM2-135M-Instruct") is NO_DEFAULTS
    assert startup_lines(NO_DEFAULTS) == []


def test_a_folder_gives_its_own_values_whatever_the_model(tmp_path: Path) -> None:
    model = model_folder(tmp_path, {"temperature": 0.9}, "model")
    other = model_folder(tmp_path, {"temperature": 0.1, "max_new_tokens": 3}, "other")
    assert sampling_defaults(str(other), str(model)).as_dict() == {"temperature": 0.1, "max_tokens": 3}
    assert sampling_defaults(str(other), "SmolLM2-135M-Instruct").as_dict() == {"temperature": 0.1, "max_tokens": 3}


def test_startup_lines_say_what_vllm_says() -> None:
    lines = startup_lines(SamplingDefaults(temperature=0.2, top_p=0.9, source="somewhere"))
    assert lines[0].startswith("Default sampling parameters have been overridden by the model's generation config")
    assert "`--generation-config vllm`" in lines[0] and "somewhere" in lines[0]
    assert lines[1:] == ["Using default chat sampling params from model: {'temperature': 0.2, 'top_p': 0.9}",
                         "Using default completion sampling params from model: {'temperature': 0.2, 'top_p': 0.9}"]


@pytest.mark.parametrize("values, message", [
    ({"temperature": -1}, "temperature must be a finite number >= 0, got -1"),
    ({"temperature": "hot"}, 'temperature must be a finite number >= 0, got "hot"'),
    ({"top_p": 0}, r"top_p must be a number in \(0, 1\], got 0"),
    ({"top_p": 1.5}, r"top_p must be a number in \(0, 1\], got 1.5"),
    ({"top_k": 2.5}, "top_k must be an integer >= -1"),
    ({"top_k": True}, "top_k must be an integer >= -1"),
    ({"min_p": 2}, r"min_p must be a number in \[0, 1\], got 2"),
    ({"repetition_penalty": 0}, "repetition_penalty must be a finite number > 0, got 0"),
    ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1, got 0"),
    ({"max_new_tokens": "16"}, 'max_new_tokens must be an integer >= 1, got "16"'),
    ('{"temperature": NaN}', "is not valid JSON: NaN is not a JSON number"),
    ("{not json", "is not valid JSON"),
    ("[0.7]", "must hold a JSON object, not list"),
])
def test_bad_values_are_a_clear_error_naming_the_file_and_field(tmp_path: Path, values, message: str) -> None:
    folder = model_folder(tmp_path, values)
    for mode, model in (("auto", str(folder)), (str(folder), "SmolLM2-135M-Instruct")):
        with pytest.raises(GenerationConfigError, match=message) as caught:
            sampling_defaults(mode, model)
        assert str(folder / "generation_config.json") in str(caught.value)


DEEP_VALUE = "[" * 900 + "]" * 900  # parses (under the recursion limit); written whole, 1800 characters of message


@pytest.mark.parametrize("text, message", [
    ("[" * 100_000 + "]" * 100_000, "is not valid JSON: it nests too deeply"),
    ('{"a":' * 100_000 + "1" + "}" * 100_000, "is not valid JSON: it nests too deeply"),
    ('{"temperature": ' + DEEP_VALUE + "}", "temperature must be a finite number >= 0, got a JSON array"),
    ('{"top_k": {"a": ' + DEEP_VALUE + "}}",
     r"top_k must be an integer >= -1 \(0 or -1: no top-k\), got a JSON object"),
    ('{"min_p": "' + "x" * 100_000 + '"}', 'min_p must be a number in \\[0, 1\\], got "xxx'),
])
def test_a_deeply_nested_or_huge_file_is_a_clear_one_line_error(tmp_path: Path, text: str, message: str) -> None:
    folder = model_folder(tmp_path, text)
    with pytest.raises(GenerationConfigError, match=message) as caught:
        sampling_defaults(str(folder), "SmolLM2-135M-Instruct")
    assert str(folder / "generation_config.json") in str(caught.value) and len(str(caught.value)) < 300


@pytest.mark.parametrize("command", ["serve", "up"])
def test_serve_and_up_name_themselves_in_a_bad_generation_config_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, command: str) -> None:
    from kvbridge import cli
    from kvbridge.launcher import cluster
    started: list[dict] = []
    monkeypatch.setattr(cluster, "run_cluster", lambda **kwargs: started.append(kwargs) or 0)
    folder = model_folder(tmp_path, "[" * 100_000 + "]" * 100_000)
    assert cli.main([command, "--generation-config", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvbridge {command}: error: {folder / 'generation_config.json'}") and "nests" in err, err
    assert len(err.strip().splitlines()) == 1 and started == []


def test_a_folder_mode_needs_a_folder_with_a_generation_config(tmp_path: Path) -> None:
    with pytest.raises(GenerationConfigError, match="not auto, vllm or a folder"):
        sampling_defaults(str(tmp_path / "missing"), "SmolLM2-135M-Instruct")
    with pytest.raises(GenerationConfigError, match="the folder has no generation_config.json"):
        sampling_defaults(str(model_folder(tmp_path, None)), "SmolLM2-135M-Instruct")


def test_serve_with_a_bad_generation_config_fails_at_start_up_before_loading(tmp_path: Path) -> None:
    folder = model_folder(tmp_path, {"temperature": -0.5})
    serve = subprocess.run([sys.executable, "-m", "kvbridge.cli", "serve", str(folder), "--port", "0"],
                           capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert serve.returncode == 2, serve.stderr
    assert serve.stderr.strip().endswith(f"kvbridge serve: error: {folder / 'generation_config.json'}: "
                                         "temperature must be a finite number >= 0, got -0.5")


# ---------------------------------------------------------------- a request's values against the defaults

DEFAULTS = SamplingDefaults(temperature=0.3, top_p=0.8, top_k=5, min_p=0.1, repetition_penalty=1.2, max_tokens=9)


@pytest.mark.parametrize("chat", [False, True])
def test_omitted_fields_take_the_defaults_and_given_ones_win(chat: bool) -> None:
    base = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    cls = p.ChatCompletionRequest if chat else p.CompletionRequest
    omitted = cls.model_validate(base).to_sampling_params(4, DEFAULTS)
    assert (omitted.temperature, omitted.top_p, omitted.top_k, omitted.min_p, omitted.repetition_penalty) == \
        (0.3, 0.8, 5, 0.1, 1.2)
    given = cls.model_validate({**base, "temperature": 0, "top_p": 1.0, "top_k": -1, "min_p": 0,
                                "repetition_penalty": 1.0}).to_sampling_params(4, DEFAULTS)
    assert (given.temperature, given.top_p, given.top_k, given.min_p, given.repetition_penalty) == \
        (0.0, 1.0, 0, 0.0, 1.0)
    neutral = cls.model_validate(base).to_sampling_params(4, NO_DEFAULTS)
    assert (neutral.temperature, neutral.top_p, neutral.top_k, neutral.min_p, neutral.repetition_penalty) == \
        (1.0, 1.0, 0, 0.0, 1.0)
