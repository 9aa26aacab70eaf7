"""The two tools of the FastMCP "local runtime bridge" demo, as ironcell local tools.

    ironcell serve --tools examples/local-runtime-bridge/tools.py

Each function marked `@tool` becomes an MCP tool: its name is the function's, its description
the docstring, its input schema the type hints. Every call runs in ironcell's sandbox (no
network, no files outside the session), never in the server process.
"""

import re
from typing import Literal, TypedDict

from mcp import tool


class TextComplexity(TypedDict):
    word_count: int
    sentence_count: int
    average_word_length: float
    average_sentence_length: float
    complexity: Literal["simple", "moderate", "complex"]


@tool
def analyze_text_complexity(text: str) -> TextComplexity:
    """Analyze how complex a text is: word and sentence counts, average word and sentence
    length, and a complexity rating (simple, moderate or complex).

    Args:
        text: The text to analyze.
    """
    words = re.findall(r"[A-Za-z0-9']+", text)
    sentences = [s for s in re.split(r"[.!?]+", text) if s.strip()]
    word_count = len(words)
    sentence_count = len(sentences) or (1 if word_count else 0)
    avg_word = sum(len(w) for w in words) / word_count if word_count else 0.0
    avg_sentence = word_count / sentence_count if sentence_count else 0.0
    if avg_word < 4.5 and avg_sentence < 12:
        complexity = "simple"
    elif avg_word < 5.5 and avg_sentence < 20:
        complexity = "moderate"
    else:
        complexity = "complex"
    return {
        "word_count": word_count,
        "sentence_count": sentence_count,
        "average_word_length": round(avg_word, 2),
        "average_sentence_length": round(avg_sentence, 2),
        "complexity": complexity,
    }


@tool
def safe_divide_numbers(a: float, b: float) -> str:
    """Divide a by b, answering a clear message instead of failing when b is zero.

    Args:
        a: The dividend.
        b: The divisor.
    """
    if b == 0:
        return f"Error: cannot divide {a:g} by zero. Division by zero is undefined; use a divisor other than 0."
    return f"{a:g} / {b:g} = {a / b:g}"
