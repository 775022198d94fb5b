"""A fake grammar backend for tests: it allows exactly the characters of a fixed text, one byte token each, and
then nothing at all (a dead end, which llguidance reports as an error)."""

from __future__ import annotations

import json

import torch

from deepserve.core.structured import GrammarBackend, GrammarMatcher


class DeadEndMatcher(GrammarMatcher):
    """Allows exactly `allowed[0]`, `allowed[1]`, ..., then no token at all."""

    def __init__(self, allowed: list[int], text: str) -> None:
        self.allowed, self.text, self.num_consumed = allowed, text, 0

    def consume(self, token_id):
        self.num_consumed += 1
        return self.num_consumed <= len(self.allowed) and token_id == self.allowed[self.num_consumed - 1]

    def fill_bitmask(self, bitmask, row):
        bitmask[row] = 0
        if self.num_consumed < len(self.allowed):
            token = self.allowed[self.num_consumed]
            bitmask[row, token // 32] = 1 << (token % 32)

    def is_terminated(self):
        return False

    def is_error(self):
        return self.num_consumed >= len(self.allowed)

    def error_message(self):
        return f"nothing may follow {self.text!r}" if self.is_error() else ""

    def rollback(self, num_tokens):
        self.num_consumed -= num_tokens


def dead_end_backend(text: str) -> type[GrammarBackend]:
    """A backend class (the factory the grammar hook registers) whose matchers allow `text`, then nothing."""

    class DeadEndBackend(GrammarBackend):
        name = "dead-end"

        def __init__(self, tokenizer) -> None:
            self.vocab_size = tokenizer.vocab_size
            vocab = json.loads(tokenizer.tokenizer_json)["model"]["vocab"]  # the demo's byte tokens
            self.allowed = [vocab[ch] for ch in text]

        def compile(self, spec):
            return spec

        def new_matcher(self, compiled):
            return DeadEndMatcher(self.allowed, text)

        def allocate_bitmask(self, num_rows):
            return torch.full((num_rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)

    return DeadEndBackend


class SlowBackend(GrammarBackend):
    """A backend whose compile of a regex holding "slow" never ends (as a pathological grammar's), compiled in
    child processes like outlines'; any other spec compiles at once, to itself."""

    name = "slow"
    isolated_compiles = True

    def __init__(self, tokenizer) -> None:
        self.vocab_size = tokenizer.vocab_size

    def compile(self, spec):
        if "slow" in spec.spec:
            import time

            while True:  # busy, as a DFA build is: only ending the process stops it
                time.sleep(0.01)
        return spec.spec

    def new_matcher(self, compiled):
        return DeadEndMatcher([], compiled)

    def allocate_bitmask(self, num_rows):
        return torch.full((num_rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
