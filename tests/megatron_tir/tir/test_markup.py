"""The TIR grammar: code blocks, boxed answers, turn kinds and stop strings (hand-checked cases)."""

import pytest

from megatron_tir.tir import (
    TurnKind,
    answer_in_model_text,
    classify_turn,
    extract_code,
    find_boxed,
    last_boxed,
    parse,
    stop_strings,
)

# ----------------------------------------------------------------------------- blocks


def test_python_block_complete():
    text = "First compute it.\n```python\nx = 6 * 7\nprint(x)\n```"
    assert extract_code(text) == "x = 6 * 7\nprint(x)"
    c = classify_turn(text, "stop")
    assert c.kind is TurnKind.CODE and c.lang == "python"
    assert c.code_end == len(text)


@pytest.mark.parametrize("tag", ["py", "python3", "", "Python", "python  "])
def test_executable_language_tags(tag):
    text = f"```{tag}\nprint(1)\n```\n"
    assert extract_code(text) == "print(1)"


@pytest.mark.parametrize("tag", ["output", "bash", "text", "c++"])
def test_non_python_blocks_are_text(tag):
    text = f"```{tag}\nls -l\n```\nno code here"
    assert extract_code(text) is None
    c = classify_turn(text, "eos")
    assert c.kind is TurnKind.VOID
    assert repr(tag) in c.reason and "EOS without code or answer" in c.reason


def test_non_python_block_then_python_block():
    text = "```output\n3\n```\nNow real code:\n```python\nprint(2)\n```"
    assert extract_code(text) == "print(2)"


def test_fence_inside_string_does_not_close():
    text = '```python\ns = "```"\nprint(s + "```x")\n```'
    assert extract_code(text) == 's = "```"\nprint(s + "```x")'


def test_line_starting_with_fence_inside_string_closes_the_block():
    # Documented limit of the grammar: a line that starts with ``` closes the block.
    text = '```python\ns = """\n```\n"""\n```'
    assert extract_code(text) == 's = """'


def test_nested_fence_closes_at_first_line_start_fence():
    text = "```python\nprint('a')\n```python\nprint('b')\n```"
    assert extract_code(text) == "print('a')"
    m = parse(text)
    # the trailing "print('b')" opens nothing: the fence line after it is a new, open block
    assert m.blocks[0].closed and m.blocks[0].code == "print('a')"
    assert m.open_block is not None and m.open_block.code == ""


def test_indented_fences_up_to_three_spaces():
    assert extract_code("   ```python\n   x = 1\n   ```") == "x = 1"
    # four spaces: an indented code line, not a fence
    assert extract_code("    ```python\nx = 1\n    ```") is None


def test_inline_triple_backticks_are_not_fences():
    text = "Use ```python``` blocks. And mid-line ```python\nprint(1)\n```"
    m = parse(text)
    # the only fence is the last line, which opens a (still unfinished) bare block
    assert len(m.blocks) == 1 and m.open_block is not None and m.open_block.start == len(text) - 3
    assert extract_code(text) is None


def test_first_complete_block_wins():
    text = "```python\nprint(1)\n```\n```python\nprint(2)\n```"
    assert extract_code(text) == "print(1)"


def test_empty_block_is_complete_code():
    c = classify_turn("```python\n```", "stop")
    assert c.kind is TurnKind.CODE and c.code == "" and "empty" in c.reason


# Issue 13: an indented fence's indentation is removed from the code lines (CommonMark).
def test_code_in_a_list_item_is_dedented_and_runs():
    text = "1. First compute:\n   ```python\n   for i in range(2):\n       print(i)\n   ```\n"
    code = extract_code(text)
    assert code == "for i in range(2):\n    print(i)"
    exec(compile(code, "<block>", "exec"), {})  # no IndentationError


def test_dedent_removes_at_most_the_fence_indent():
    # CommonMark example: fence indented 2, lines indented 0, 1, 2 and 4 spaces
    text = "  ```\nx\n y\n  z\n    w\n  ```"
    assert extract_code(text) == "x\ny\nz\n  w"


# Issue 13: an info string with attributes takes its first word as the language.
@pytest.mark.parametrize(("info", "lang"), [('python title="a.py"', "python"), ("py {.numberLines}", "py"),
                                            ("  python3   ", "python3"), ('latex title="x"', "latex")])
def test_info_string_first_word_is_the_language(info, lang):
    text = f"```{info}\nprint(1)\n```"
    block = parse(text).blocks[0]
    assert block.lang == lang and block.closed
    assert (extract_code(text) == "print(1)") == (lang != "latex")


# Issue 13: a lone \r is a line ending (and \r\n is one line ending).
@pytest.mark.parametrize("eol", ["\r", "\r\n"])
def test_carriage_return_line_endings(eol):
    text = eol.join(["Compute:", "```python", "x = 6 * 7", "print(x)", "```"])
    assert extract_code(text) == "x = 6 * 7\nprint(x)"
    assert classify_turn(text, "stop").code_end == len(text)
    assert sorted(stop_strings("```python" + eol + "x = 1")) == sorted(CLOSING)
    assert stop_strings("```python" + eol) == ("```",)


# ---------------------------------------------------------------------------- answers


def test_boxed_nested_and_several():
    text = r"so \boxed{\frac{1}{2}} or rather \boxed{ \frac{\sqrt{3}}{2} }."
    assert find_boxed(text) == [r"\frac{1}{2}", r"\frac{\sqrt{3}}{2}"]
    assert last_boxed(text) == r"\frac{\sqrt{3}}{2}"


def test_boxed_escaped_braces_and_space():
    assert find_boxed(r"\boxed {\{1, 2\}}") == [r"\{1, 2\}"]


def test_boxed_cut_is_ignored():
    assert find_boxed(r"\boxed{3} then \boxed{\frac{1}{") == ["3"]
    assert last_boxed(r"\boxed{\frac{1}{") is None


# Issue 13: a complete \boxed{} after an unbalanced \boxed{ is found.
def test_complete_boxed_after_an_unbalanced_one():
    text = "Answer: \\boxed{5\n\nOops. Final: \\boxed{5}"
    assert find_boxed(text) == ["5"]
    c = classify_turn(text, "eos")
    assert c.kind is TurnKind.ANSWER and c.answer == "5"
    assert find_boxed(r"\boxed{\frac{1}{2} \boxed{7} and \boxed{8}") == ["7", "8"]
    assert find_boxed(r"\boxed{x + \boxed{5}") == ["5"]


# Issue 13: \\ before a brace is a LaTeX line break, not an escaped brace.
def test_double_backslash_is_a_line_break_not_an_escape():
    assert find_boxed(r"\boxed{x\\}") == [r"x\\"]
    assert find_boxed(r"\boxed{\begin{matrix}1\\2\end{matrix}} then \boxed{3}") == [
        r"\begin{matrix}1\\2\end{matrix}", "3"]
    assert find_boxed(r"\boxed{\\{1\}}") == []  # \\ then an unescaped {: one brace never closes
    assert find_boxed(r"\boxed{a\\\}b}") == [r"a\\\}b"]  # \\ then an escaped }


# Issue 13: a \boxed{} inside a non-Python block is text, so it is an answer in prose.
@pytest.mark.parametrize("lang", ["latex", "output", "text", "math"])
def test_boxed_inside_a_non_python_block_is_an_answer(lang):
    text = f"The result:\n```{lang}\n\\boxed{{12}}\n```\n"
    assert answer_in_model_text(text) == "12"
    c = classify_turn(text, "eos")
    assert c.kind is TurnKind.ANSWER and c.answer == "12"
    # an unclosed non-Python block is text too
    assert answer_in_model_text(f"```{lang}\n\\boxed{{3}}") == "3"
    # and a later python block's code stays out of the prose
    text2 = f"```{lang}\n\\boxed{{4}}\n```\n```python\nprint('\\\\boxed{{9}}')\n```"
    assert answer_in_model_text(text2) == "4"


def test_boxed_inside_code_is_not_an_answer():
    text = "```python\nprint('\\\\boxed{5}')\n```"
    assert answer_in_model_text(text) is None
    assert answer_in_model_text("The answer is \\boxed{7}.\n```python\nprint('\\\\boxed{5}')\n```") == "7"


# ------------------------------------------------------------------------- turn kinds


def test_answer_turn():
    c = classify_turn(r"Hence the answer is \boxed{204}.", "eos")
    assert c.kind is TurnKind.ANSWER and c.answer == "204" and c.reason == "boxed final answer"


def test_answer_then_length_cut_is_still_an_answer():
    c = classify_turn(r"\boxed{204} and then I keep talking", "length")
    assert c.kind is TurnKind.ANSWER and "length" in c.reason


@pytest.mark.parametrize(
    ("text", "finish", "reason"),
    [
        ("Let me think about it more", "eos", "EOS without code or answer"),
        ("Let me think about it more", "length", "length cut without code or answer"),
        ("```python\nx = 1\nprint(x", "length", "length cut inside a code block (partial code)"),
        ("```python\nx = 1\n", "eos", "EOS inside an unclosed code block (partial code)"),
        ("```pyth", "length", "length cut inside a 'pyth' block (partial code)"),
        ("", "eos", "EOS without code or answer"),
    ],
)
def test_void_turns(text, finish, reason):
    c = classify_turn(text, finish)
    assert c.kind is TurnKind.VOID and c.void
    assert c.reason == reason


def test_an_aborted_turn_is_not_void():
    c = classify_turn("so so so so", "abort")
    assert c.kind is TurnKind.ABORTED and not c.void and c.reason == "aborted by the engine"


def test_code_beats_answer_and_answer_is_reported():
    c = classify_turn("Guess \\boxed{3}; check:\n```python\nprint(3)\n```", "stop")
    assert c.kind is TurnKind.CODE and c.answer == "3"


def test_unknown_finish_reason_rejected():
    with pytest.raises(ValueError, match="finish_reason"):
        classify_turn("x", "timeout")


# ----------------------------------------------------------------------- stop strings


# The expected stop strings are written out, not read from the module's constants.
CLOSING = ("\n```", "\n ```", "\n  ```", "\n   ```", "\r```", "\r ```", "\r  ```", "\r   ```")


def test_stops_outside_a_block_pause_on_any_fence():
    assert stop_strings("") == ("```",)
    assert stop_strings("We compute") == ("```",)
    assert stop_strings("Done ```python``` inline\nnext") == ("```",)


def test_stops_inside_a_block_mid_line_only_match_line_start_fences():
    assert sorted(stop_strings("```python")) == sorted(CLOSING)  # opening line unfinished
    assert sorted(stop_strings("```python\nx = 1")) == sorted(CLOSING)


def test_stops_at_line_start_catch_a_fence_split_across_requests():
    assert stop_strings("```python\nx = 1\n") == ("```",)
    assert stop_strings("```python\nx = 1\n  ") == ("```",)
    assert stop_strings("```python\nx = 1\n`") == ("``",)
    assert stop_strings("```python\nx = 1\n ``") == ("`",)
    assert sorted(stop_strings("```python\nx = 1\n    ")) == sorted(CLOSING)  # 4 spaces: no fence here


def _engine_cut(text: str, stops: tuple[str, ...]) -> int:
    """Where an engine that matches stop strings in its own output would stop."""
    hits = [text.find(s) + len(s) for s in stops if s in text]
    return min(hits) if hits else len(text)


@pytest.mark.parametrize(
    "full",
    [
        "Let me check.\n```python\nprint('```')\nx = 1\n```\nafter",
        "```\nprint(1)\n```\nafter",
        "Text ```inline``` then\n  ```py\n  y = 2\n  ```\n",
        "```output\n5\n```\nThen:\n```python\nprint(5)\n```\n",
        "```python\n```\n",
        "Compute:\r```python\rx = 1\rprint(x)\r```\rafter",
        "Compute:\r\n  ```py title=\"a.py\"\r\n  y = 2\r\n  ```\r\n",
        "1. list item\n   ```python\n   print(1)\n   ```\n",
    ],
)
def test_phased_stops_end_exactly_at_the_closing_fence(full):
    """Simulate the driver: generate in phases with stop_strings(); the turn must end at
    the closing fence of the first executable block, never later, whatever the phases."""
    expected_end = classify_turn(full).code_end
    assert expected_end is not None
    for first_cut in range(len(full)):  # also start the simulation at every offset
        done = full[:first_cut]
        if classify_turn(done).kind is TurnKind.CODE:
            break
        while True:
            rest = full[len(done):]
            cut = _engine_cut(rest, stop_strings(done))
            done += rest[:cut]
            c = classify_turn(done)
            if c.kind is TurnKind.CODE:
                assert len(done) == expected_end, (first_cut, done)
                break
            assert cut > 0 and len(done) < len(full)
