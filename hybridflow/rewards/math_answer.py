r"""MATH (Hendrycks et al.) rule reward: the last \boxed{...} answer, normalised, against the reference.

Normalisation removes what does not change the answer (spacing, \left/\right,
units in \text{...}, degree and percent signs, dfrac vs frac, '.5' vs '0.5',
'1/2' vs '\frac{1}{2}', thousands commas). Plain numbers and fractions of plain
numbers are then compared exactly as rationals, so '0.5' equals '\frac12', but
'0.333' does not equal '\frac{1}{3}'.
"""

from __future__ import annotations

import re
from fractions import Fraction

DATA_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "math")

_BOX = re.compile(r"\\(?:boxed|fbox)")


def _braced(text: str, start: int) -> tuple[str, int] | None:
    """The content of the {...} group opening at text[start], and the index after it; None if unbalanced."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i], i + 1
    return None


def last_boxed(text: str) -> str | None:
    r"""Content of the last \boxed{...} (or \fbox{...}, or '\boxed 5'); None when absent or unbalanced."""
    matches = list(_BOX.finditer(text))
    if not matches:
        return None
    rest_at = matches[-1].end()
    if text[rest_at : rest_at + 1] == "{":
        found = _braced(text, rest_at)
        return None if found is None else found[0]
    bare = re.match(r"\s+([^\s$]+)", text[rest_at:])  # '\boxed 5$' in old solutions
    return bare.group(1) if bare else None


def _fix_fracs(s: str) -> str:
    r"""'\frac12' -> '\frac{1}{2}', '\frac1{b}' -> '\frac{1}{b}': give both arguments braces."""
    out, i = [], 0
    while True:
        j = s.find("\\frac", i)
        if j < 0:
            out.append(s[i:])
            return "".join(out)
        out.append(s[i : j + 5])
        i = j + 5
        for _ in range(2):  # numerator, denominator
            if i >= len(s):
                break
            if s[i] == "{":
                found = _braced(s, i)
                if found is None:
                    break
                out.append("{" + found[0] + "}")
                i = found[1]
            else:
                out.append("{" + s[i] + "}")
                i += 1


_UNIT = r"\\(?:text|mbox|mathrm)\{[^{}]*\}(?:\^\{?\d\}?)?"


def normalize(answer: str) -> str:
    """Canonical string form of a MATH answer (see the module docstring)."""
    s = answer.strip().replace("\n", "")
    s = s.replace("\\!", "").replace("\\,", "").replace("\\;", "").replace("\\:", "").replace("\\ ", " ")
    s = s.replace("\\\\", "\\").replace("\\displaystyle", "")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = re.sub(r"\\(?:left|right)(?![a-zA-Z])", "", s)  # keeps \rightarrow
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "").replace("$", "")
    # A trailing unit ('5 \text{ cm}^2') goes; a lone \text{...} is the answer itself ('\text{(A)}').
    s = re.sub(r"(\S)\s*" + _UNIT + r"\s*$", r"\1", s)
    s = re.sub(r"\\(?:text|mbox|mathrm)\{([^{}]*)\}", r"\1", s)
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    # 'x = 5' and 'k=5' -> '5' (a short variable name on the left, as MATH solutions write it).
    parts = s.split("=")
    if len(parts) == 2 and len(parts[0].strip()) <= 2:
        s = parts[1]
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    s = re.sub(r"\s+", "", s)
    s = _fix_fracs(s)
    s = re.sub(r"^(-?\d+)/(\d+)$", r"\\frac{\1}{\2}", s)
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    return s.rstrip(".")


_PLAIN = r"-?\d+(?:\.\d+)?"


def _as_rational(s: str) -> Fraction | None:
    r"""A normalised answer that is a plain number or \frac of plain numbers, as an exact rational."""
    try:
        if re.fullmatch(_PLAIN, s):
            return Fraction(s)
        m = re.fullmatch(r"(-?)\\frac\{(" + _PLAIN + r")\}\{(" + _PLAIN + r")\}", s)
        if m:
            value = Fraction(m.group(2)) / Fraction(m.group(3))
            return -value if m.group(1) else value
    except ZeroDivisionError:
        return None
    return None


def is_equiv(a: str | None, b: str | None) -> bool:
    """True when two answers agree after normalisation; a missing answer (None) never agrees."""
    if a is None or b is None:
        return False
    na, nb = normalize(a), normalize(b)
    if na == nb:
        return True
    ra, rb = _as_rational(na), _as_rational(nb)
    return ra is not None and ra == rb


def compute_score(solution_str: str, ground_truth: str) -> float:
    r"""1.0 when the last \boxed answer equals the reference (itself boxed or plain), else 0.0."""
    reference = str(ground_truth)
    if _BOX.search(reference):
        reference = last_boxed(reference)
    return 1.0 if is_equiv(last_boxed(solution_str), reference) else 0.0
