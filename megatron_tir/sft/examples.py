"""What ``megatron-tir sft`` trains on: multi-turn TIR trajectories as token ids with the RL loss mask.

One :class:`Example` per trajectory: ``prompt_ids``, ``response_ids`` and ``loss_mask`` (1 on a
token the model wrote, 0 on feedback: tool output), exactly the arrays of
:class:`~megatron_tir.rollout.trajectory.Trajectory`. Files (:func:`load_examples`):

* **Trajectory records** (``.jsonl`` / ``.jsonl.gz``): ``megatron-tir collect`` output, a training
  run's rollout dumps (``RUN_DIR/rollouts/step_N.jsonl.gz`` written with
  ``trainer.log.dump_tokens=true``), ``megatron-tir eval --out`` files written with ``--out-tokens``.
  Their ids are what the engine sampled and what the driver appended: nothing is re-tokenized.
  ``only_correct`` keeps the records with ``reward > 0`` (a dump holds every sampled row).
* **Messages** (a verl-style ``.parquet`` with a ``messages`` column, or ``.jsonl`` rows
  ``{"messages": [...]}``): rendered by the rollout protocol the way a rollout lays them out --
  the messages before the first ``assistant`` are the prompt (``TIRProtocol.prompt_ids``: plain
  prefix or chat template), then each ``assistant`` message is model tokens (mask 1) and each
  ``tool`` message is the program's output, turned into feedback text by the protocol
  (``TIRProtocol.feedback`` of a successful run; a message that already starts with the
  protocol's feedback header is taken as it is) and tokenized as the driver does
  (``add_special_tokens=False``: mask 0). The tokenizer's EOS closes the last assistant message
  (a sampled answer turn ends with it). ``only_correct`` does not apply (messages carry no reward).

Every malformed input is one ``ValueError`` naming the file and the row (1-based line of a JSONL file).
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_tir.rollout.driver import RolloutConfig

ID_FIELDS = ("prompt_ids", "response_ids", "loss_mask")


@dataclass(frozen=True, slots=True)
class Example:
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]  # per response token: 1 model, 0 feedback
    where: str  # file:row, for messages about it

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def model_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass(frozen=True, slots=True)
class _Run:
    """A successful program run with ``stdout`` (what a ``tool`` message says the program printed)."""
    stdout: str
    stderr: str = ""
    status: str = "ok"
    exit_code: int | None = 0
    stdout_truncated: bool = False


def load_examples(paths: Sequence[str | os.PathLike], tokenizer, rollout: RolloutConfig, *,
                  only_correct: bool = True) -> list[Example]:
    """Every example of ``paths`` in order; ValueError naming the file (and row) on bad input, and
    when a file yields no example."""
    out: list[Example] = []
    for path in map(Path, paths):
        if not path.is_file():
            raise ValueError(f"{path}: no such file")
        if path.suffix == ".parquet":
            rows = _parquet_rows(path)
        elif path.name.endswith((".jsonl", ".jsonl.gz", ".json.gz")):
            rows = _jsonl_rows(path)
        else:
            raise ValueError(f"{path}: not a .jsonl, .jsonl.gz or .parquet file")
        mine = []
        for where, row in rows:
            ex = _example(row, where, tokenizer, rollout, only_correct=only_correct)
            if ex is not None:
                mine.append(ex)
        if not mine:
            kept = " with reward > 0 (sft.only_correct)" if only_correct else ""
            raise ValueError(f"{path}: no trajectory{kept} in it (records with {', '.join(ID_FIELDS)}, "
                             f"or rows with 'messages')")
        out += mine
    return out


def _jsonl_rows(path: Path):
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError, EOFError) as exc:
        raise ValueError(f"{path}: not a readable JSONL file ({exc})") from None
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{i}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{i}: expected a JSON object, got {type(row).__name__}")
        yield f"{path}:{i}", row


def _parquet_rows(path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise ValueError(f"{path}: not a readable parquet file ({exc})") from None
    if "messages" not in table.column_names and not all(c in table.column_names for c in ID_FIELDS):
        raise ValueError(f"{path}: no 'messages' column (nor {', '.join(ID_FIELDS)}); columns: "
                         f"{', '.join(table.column_names)}")
    for i, row in enumerate(table.to_pylist()):
        yield f"{path}: row {i}", row


def _example(row: dict, where: str, tokenizer, rollout: RolloutConfig, *, only_correct: bool) -> Example | None:
    if all(k in row for k in ID_FIELDS):
        if only_correct and not (isinstance(row.get("reward"), (int, float)) and row["reward"] > 0):
            return None
        return _from_ids(row, where)
    if "messages" in row:
        return render_messages(row["messages"], tokenizer, rollout, where=where)
    if "response" in row and "turns" in row:
        raise ValueError(f"{where}: a trajectory record without token ids ({', '.join(ID_FIELDS)}): write it with "
                         f"`megatron-tir collect`, `eval --out-tokens`, or a training dump with "
                         f"trainer.log.dump_tokens=true")
    raise ValueError(f"{where}: neither a trajectory record ({', '.join(ID_FIELDS)}) nor a row with 'messages'")


def _int_list(value, name: str, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                              for v in value):
        raise ValueError(f"{where}: {name} must be a list of token ids (integers >= 0)")
    return tuple(value)


def _from_ids(row: dict, where: str) -> Example:
    prompt = _int_list(row["prompt_ids"], "prompt_ids", where)
    response = _int_list(row["response_ids"], "response_ids", where)
    mask = row["loss_mask"]
    if not isinstance(mask, list) or any(m not in (0, 1) or isinstance(m, bool) for m in mask):
        raise ValueError(f"{where}: loss_mask must be a list of 0 / 1")
    if not prompt:
        raise ValueError(f"{where}: prompt_ids is empty")
    if len(mask) != len(response):
        raise ValueError(f"{where}: loss_mask has {len(mask)} entries for {len(response)} response_ids")
    return Example(prompt_ids=prompt, response_ids=response, loss_mask=tuple(mask), where=where)


def render_messages(messages, tokenizer, rollout: RolloutConfig, *, where: str) -> Example:
    """One conversation rendered as a rollout lays it out (see the module docstring)."""
    msgs = _check_messages(messages, where)
    first = next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), None)
    if first is None:
        raise ValueError(f"{where}: messages have no assistant message (nothing to train on)")
    if msgs[-1]["role"] != "assistant":
        raise ValueError(f"{where}: the last message is {msgs[-1]['role']!r}; a trajectory ends with the model's turn")
    protocol = rollout.make_protocol()
    try:
        prompt_ids = list(protocol.prompt_ids(msgs[:first], tokenizer))
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    prefix = protocol.response_prefix  # the prompt ends inside the first turn: that text is not the model's
    response: list[int] = []
    mask: list[int] = []
    turn, previous = 0, ""
    for i, m in enumerate(msgs[first:]):
        text = m["content"]
        if m["role"] == "assistant":
            if i == 0 and prefix and text.startswith(prefix):
                text = text[len(prefix):]
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            if i == len(msgs) - first - 1 and tokenizer.eos_token_id is not None:
                ids.append(int(tokenizer.eos_token_id))
            response += ids
            mask += [1] * len(ids)
            previous = text
        elif m["role"] == "tool":
            feedback = _feedback_text(protocol, text, turn=turn, max_turns=rollout.max_turns, previous=previous,
                                      rollout=rollout)
            ids = list(tokenizer.encode(feedback, add_special_tokens=False)) if feedback else []
            response += ids
            mask += [0] * len(ids)
            turn += 1
        else:
            raise ValueError(f"{where}: message {first + i} has role {m['role']!r}; after the first assistant "
                             f"message only 'assistant' and 'tool' messages are a trajectory")
    return Example(prompt_ids=tuple(prompt_ids), response_ids=tuple(response), loss_mask=tuple(mask), where=where)


def _check_messages(messages, where: str) -> list[dict]:
    if isinstance(messages, (str, bytes)) or messages is None:
        raise ValueError(f"{where}: 'messages' must be a list of {{role, content}} messages")
    try:
        items = list(messages)
    except TypeError:
        raise ValueError(f"{where}: 'messages' must be a list of {{role, content}} messages") from None
    out = []
    for j, m in enumerate(items):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: message {j} needs string 'role' and 'content'")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _feedback_text(protocol, output: str, *, turn: int, max_turns: int, previous: str, rollout: RolloutConfig) -> str:
    """The feedback the protocol appends after a code turn whose program printed ``output``; ``output``
    itself when it is already feedback (starts with the protocol's header)."""
    if output.lstrip("\n").startswith(feedback_header(protocol).lstrip("\n")):
        return output
    return protocol.feedback(_Run(stdout=output), turn_index=turn, max_turns=max_turns, turn_text=previous,
                             timeout=rollout.tool_timeout_s, memory_mb=rollout.tool_memory_mb)


def feedback_header(protocol) -> str:
    """The text every feedback of ``protocol`` starts with (after a leading newline)."""
    from megatron_tir.tir import FEEDBACK_HEADER
    from megatron_tir.tir.protocol import ProtocolName
    from megatron_tir.tir.simpletir import FEEDBACK_PREFIX

    return FEEDBACK_PREFIX if protocol.name is ProtocolName.SIMPLETIR else FEEDBACK_HEADER
