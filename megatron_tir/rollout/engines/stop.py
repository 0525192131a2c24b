"""Stop-string matching on generated tokens only.

The TIR driver stops a turn when a code block closes, so a stop string must match in
the text the model *generated* -- never across the prompt boundary (HF's
``stop_strings`` does match there, which would end a turn on the prompt's own fence).

After each sampled token the matcher decodes a tail window of the generated ids and
looks for every stop string in it. Because it runs after every token, the first window
that contains a stop string is the step on which that string was completed, and the
token that completed it is kept in the output (SGLang's ``no_stop_trim=True``). The
window spans ``4 * longest_stop + 4`` tokens: a character takes at most four byte-level
tokens, so any stop string ending in the newest token lies inside it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class _Decoder(Protocol):
    def decode(self, token_ids: Sequence[int], **kwargs) -> str: ...


class StopStringMatcher:
    """Finds the first completed stop string in generated token ids."""

    __slots__ = ("_tokenizer", "_stops", "_window")

    def __init__(self, tokenizer: _Decoder, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self._tokenizer = tokenizer
        self._stops = tuple(stops)
        self._window = 4 * max((len(s) for s in stops), default=0) + 4

    def __bool__(self) -> bool:
        return bool(self._stops)

    def check(self, generated_ids: Sequence[int]) -> str | None:
        """The stop string completed by the last id of ``generated_ids``, if any.

        Call after every new token. When several complete at once, the one that starts
        earliest in the text wins.
        """
        if not self._stops or not generated_ids:
            return None
        tail = self._tokenizer.decode(
            list(generated_ids[-self._window :]), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        best: tuple[int, str] | None = None
        for stop in self._stops:
            at = tail.find(stop)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        return None if best is None else best[1]
