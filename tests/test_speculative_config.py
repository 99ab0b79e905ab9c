"""``SpeculativeConfig``: vLLM's dict form, validated once with messages that say what to do,
and reachable as ``LLM(speculative_config=...)`` / ``--speculative-config JSON``."""

from __future__ import annotations

import argparse

import pytest

from loraplex.config import SpeculativeConfig, speculative_config_of
from loraplex.engine_args import add_engine_arguments, engine_config, from_args, knobs_of


def test_the_vllm_dict_forms() -> None:
    ngram = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}
    )  # fmt: skip
    assert (ngram.method, ngram.lookup_min, ngram.lookup_max) == ("ngram", 2, 4)
    draft = SpeculativeConfig.from_dict(
        {"method": "draft_model", "model": "/m", "num_speculative_tokens": 3}
    )
    assert draft.model == "/m" and draft.num_speculative_tokens == 3 and draft.adaptive


def test_lookup_defaults_follow_the_one_given() -> None:
    assert SpeculativeConfig("ngram", 4).lookup_min == 2
    assert SpeculativeConfig("ngram", 4).lookup_max == 4
    assert SpeculativeConfig("ngram", 4, prompt_lookup_max=1).lookup_min == 1
    assert SpeculativeConfig("ngram", 4, prompt_lookup_min=6).lookup_max == 6


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"method": "eagle", "num_speculative_tokens": 4}, "method must be one of ngram"),
        ({"method": "ngram"}, "needs num_speculative_tokens"),
        ({"num_speculative_tokens": 2}, "needs method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "from 1 to 16"),
        ({"method": "ngram", "num_speculative_tokens": 17}, "from 1 to 16"),
        ({"method": "ngram", "num_speculative_tokens": True}, "from 1 to 16"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "at least 1"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5,
             "prompt_lookup_max": 3},
            r"prompt_lookup_min \(5\) must not exceed prompt_lookup_max \(3\)",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "/m"}, "for method 'draft_model'"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
        (
            {"method": "draft_model", "model": "/m", "num_speculative_tokens": 2,
             "prompt_lookup_max": 3},
            "for method 'ngram'",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "num_lookahead": 3}, "unknown key"),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "at least 1"),
        ({"method": "ngram", "num_speculative_tokens": 2, "adaptive": "yes"}, "true or false"),
    ],
)  # fmt: skip
def test_bad_configs_say_what_to_do(data: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(data)


def test_it_is_an_engine_knob() -> None:
    config = engine_config(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert config.speculative_config == SpeculativeConfig("ngram", 3)
    assert engine_config().speculative_config is None
    assert engine_config(**knobs_of(config)) == config
    with pytest.raises(ValueError, match="must be a dict"):
        speculative_config_of("ngram")

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']
    )
    assert from_args(args).speculative_config == SpeculativeConfig("ngram", 2)
    env = argparse.ArgumentParser()
    with pytest.raises(ValueError, match="LORAPLEX_SPECULATIVE_CONFIG"):
        add_engine_arguments(
            env, env=True, environ={"LORAPLEX_SPECULATIVE_CONFIG": '{"method": "ngram"}'}
        )
