"""The TIR protocol in one place: prompt, code-block and answer grammar, turn kinds, feedback.

See :mod:`megatron_tir.tir.markup` for the grammar and the stop-string scheme.
"""

from megatron_tir.tir.feedback import (
    FEEDBACK_HEADER,
    FINAL_ANSWER_PRELUDE,
    FeedbackConfig,
    format_feedback,
    program_for,
    truncate_middle,
)
from megatron_tir.tir.markup import (
    CodeBlock,
    TurnClass,
    TurnKind,
    answer_in_model_text,
    classify_turn,
    extract_code,
    find_boxed,
    last_boxed,
    parse,
    stop_strings,
)
from megatron_tir.tir.prompt import PromptConfig, PromptMode, build_prompt_ids, build_prompt_text, problem_text

__all__ = [
    "FEEDBACK_HEADER", "FINAL_ANSWER_PRELUDE", "FeedbackConfig", "format_feedback", "program_for",
    "truncate_middle", "CodeBlock", "TurnClass", "TurnKind", "answer_in_model_text", "classify_turn",
    "extract_code", "find_boxed", "last_boxed", "parse", "stop_strings", "PromptConfig", "PromptMode",
    "build_prompt_ids", "build_prompt_text", "problem_text",
]
