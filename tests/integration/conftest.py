"""The tiny-model fixtures for the tests that run a model in this process (one file per producer)."""

from tests.helpers.model_fixtures import gpt2, llama, t5, tokenizer  # noqa: F401  (fixtures)
