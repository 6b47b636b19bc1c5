"""The lexical pieces of JSON Schema's patterns (json_schema.py): string formats and
numeric ranges as regular expressions.

Theory of operation: a `format` is a fixed pattern of the string's content (RFC 3339
dates and times, ISO 8601 durations, addresses, UUIDs, URIs). A numeric range is
written digit by digit: the integers from lo to hi split by length, each length by
the first digit that differs (as a range-to-regex tool does), so `{"minimum": 18,
"maximum": 99}` admits exactly 18..99. Decimals keep to integer bounds: an integer
part strictly between them takes any fraction, one at an upper bound only zeros, one
at an unreached lower bound a fraction that is not all zeros.

A `multipleOf` step is read as the decimal it is written as and bounds as exact
fractions: x is a multiple of the step when x * 10**p is a multiple of k = step *
10**p (p: the step's fraction digits; for an integer x, p = 0 and k is the step's
numerator, so 2.5 asks for multiples of 5). Where k divides 10**n, the last n digits decide: the digits above them are a range
as above and the n digits a listed set (the multiples of 8 end in 000, 008, ...,
992); for a decimal step whose k divides 10**p (0.01, 0.5, 0.25, 0.125) the fraction
alone decides, and each length a fraction may be written in (0.5 or 0.50) is such a
set. Any other step (3, 0.3, 1.5, 16, more than 16 fraction digits) lists the values
when both bounds leave at most MAX_LISTED of them, and is Irregular otherwise. Numbers with a step have no exponent;
-0 is written 0.

Invariants: every pattern keeps to regex.py's syntax (and Python's `re`); a range is
exact for integers, and for decimals never admits a value outside its bounds; a
multipleOf pattern admits exactly the multiples within the bounds (at most
MAX_DIGITS integer digits and 17 fraction digits).
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

MAX_DIGITS = 18  # integers and integer parts have at most this many digits
FRACTION = r"\.[0-9]{1,17}"


def alt(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


_DATE = r"[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])"
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:(?:[0-5][0-9]|60)(?:\.[0-9]{1,9})?(?:[Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_H16 = r"[0-9A-Fa-f]{1,4}"


def _some(parts: list[str]) -> str:
    """One or more of `parts`, in their order."""
    return alt([parts[i] + "".join(f"(?:{p})?" for p in parts[i + 1 :]) for i in range(len(parts))])


_SECONDS = _some(["[0-9]{1,9}H", "[0-9]{1,9}M", r"[0-9]{1,9}(?:\.[0-9]{1,9})?S"])
FORMATS = {  # the string formats of JSON Schema's validation vocabulary that we shape
    "date-time": _DATE + r"[Tt ]" + _TIME,
    "date": _DATE,
    "time": _TIME,
    "duration": "P(?:[0-9]{1,9}W|" + _some(["[0-9]{1,9}Y", "[0-9]{1,9}M", "[0-9]{1,9}D"])
                + "(?:T" + _SECONDS + ")?|T" + _SECONDS + ")",
    "email": r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]{1,64}(?:\.[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]{1,64}){0,8}"
             r"@" + _LABEL + r"(?:\." + _LABEL + r"){0,8}",
    "hostname": _LABEL + r"(?:\." + _LABEL + r"){0,8}",
    "ipv4": _OCTET + r"(?:\." + _OCTET + r"){3}",
    "ipv6": "(?:" + "|".join(  # eight groups, or at most seven around one "::"
        [f"(?:{_H16}:){{7}}{_H16}"]
        + [(f"(?:{_H16}:){{{i - 1}}}{_H16}" if i else "") + "::"
           + (f"(?:(?:{_H16}:){{0,{6 - i}}}{_H16})?" if i < 7 else "") for i in range(8)]) + ")",
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "uri": r"[A-Za-z][A-Za-z0-9+.-]{0,31}:[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=%]{1,256}",
}  # fmt: skip


def _digits_between(lo: str, hi: str) -> str:
    """The decimal strings of one length from lo to hi (lo <= hi, no sign)."""
    if lo == hi:
        return lo
    if len(lo) == 1:
        return f"[{lo}-{hi}]"
    if lo[0] == hi[0]:
        return lo[0] + _digits_between(lo[1:], hi[1:])
    rest = len(lo) - 1
    low_full, high_full = lo[1:] == "0" * rest, hi[1:] == "9" * rest
    first, last = int(lo[0]) + (not low_full), int(hi[0]) - (not high_full)
    parts = [] if low_full else [lo[0] + _digits_between(lo[1:], "9" * rest)]
    if first <= last:
        parts.append(f"[{first}-{last}][0-9]{{{rest}}}")
    if not high_full:
        parts.append(hi[0] + _digits_between("0" * rest, hi[1:]))
    return alt(parts)


def _naturals(lo: int, hi: int | None) -> str:
    """0 <= lo <= n <= hi (hi None: up to MAX_DIGITS digits), without leading zeros."""
    top = 10**MAX_DIGITS - 1
    hi = top if hi is None else min(hi, top)
    parts = []
    for n in range(len(str(lo)), len(str(hi)) + 1):
        a, b = max(lo, 10 ** (n - 1) if n > 1 else 0), min(hi, 10**n - 1)
        if a <= b:
            parts.append(_digits_between(str(a), str(b)))
    return alt(parts)


Bound = tuple[int, bool]  # an integer part and whether it may be reached exactly


def bounds(node: dict) -> tuple[Bound | None, Bound | None]:
    """A numeric node's lower and upper bounds (None: unbounded) as (integer, reached):
    between them any value; at an integer bound, the bound itself if `reached`; a
    bound that is no integer is rounded inward and is reached."""
    import math

    def bound(inclusive: str, exclusive: str, inward, tighter) -> Bound | None:
        found = []
        for key in (inclusive, exclusive):
            v = node.get(key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                continue
            found.append((inward(v), key == inclusive or inward(v) != v))
        return tighter(found) if found else None

    lo = bound(
        "minimum", "exclusiveMinimum", math.ceil, lambda b: max(b, key=lambda x: (x[0], not x[1]))
    )
    hi = bound(
        "maximum", "exclusiveMaximum", math.floor, lambda b: min(b, key=lambda x: (x[0], x[1]))
    )
    return lo, hi


def integers(lo: Bound | None, hi: Bound | None) -> str | None:
    """The integers between two bounds, or None where there are none."""
    a = None if lo is None else lo[0] + (not lo[1])
    b = None if hi is None else hi[0] - (not hi[1])
    if a is not None and b is not None and a > b:
        return None
    parts = []
    if b is None or b >= 0:
        parts.append(_naturals(max(a or 0, 0), b))
    if a is None or a < 0:
        parts.append("-" + _naturals(max(-b, 1) if b is not None else 1, None if a is None else -a))
    return alt(parts)


def _magnitudes(lo: Bound, hi: Bound | None) -> str | None:
    """Non-negative decimals x (no exponent) with lo <= x <= hi as _bounds reads them:
    an unreached lower bound needs a fraction that is not all zeros, a reached upper
    bound may only have zeros after it."""
    (a, a_in), top = lo, hi
    b = None if top is None else top[0]
    if b is not None and (a > b or (a == b and not (a_in and top[1]))):
        return None
    parts = []
    if not a_in:
        parts.append(f"{a}" + r"\.[0-9]{0,16}[1-9]")
        a += 1
    if b is None or a <= b - 1:
        parts.append(_naturals(a, None if b is None else b - 1) + f"(?:{FRACTION})?")
    if b is not None and top[1] and a <= b:
        parts.append(str(b) + r"(?:\.0{1,17})?")
    return alt(parts) if parts else None


def numbers(lo: Bound | None, hi: Bound | None) -> str | None:
    """The decimals between two bounds (zero or more on each side of 0), or None."""
    parts = []
    if hi is None or hi[0] >= 0:
        pos_lo = lo if lo is not None and lo[0] >= 0 else (0, True)
        parts.append(_magnitudes(pos_lo, hi))
    if lo is None or lo[0] < 0:
        neg_lo = (-hi[0], hi[1]) if hi is not None and hi[0] < 0 else (0, False)
        neg = _magnitudes(neg_lo, None if lo is None else (-lo[0], lo[1]))
        parts.append(None if neg is None else "-" + neg)
    parts = [p for p in parts if p is not None]
    return alt(parts) if parts else None


# ---- multipleOf ----------------------------------------------------------------------
MAX_SUFFIX_DIGITS = 600  # a divisor of 10**n: the digits of its multiples below 10**n
MAX_LISTED = 256  # any other step, by listing the values between two bounds
_ZEROS = r"(?:\.0{1,17})?"  # an integer written as a number


class Irregular(ValueError):
    """A multipleOf that no pattern of reasonable size expresses (module docstring)."""


def _chars(chars: list[str]) -> str:
    """One of `chars` (sorted) as a literal or a class, runs of digits as ranges."""
    if len(chars) == 1:
        return re.escape(chars[0])
    runs: list[list[str]] = []
    for c in chars:
        if runs and c.isdigit() and ord(c) == ord(runs[-1][-1]) + 1:
            runs[-1].append(c)
        else:
            runs.append([c])
    return "[" + "".join(r[0] + "-" + r[-1] if len(r) > 2 else "".join(r) for r in runs) + "]"


def _trie(texts: list[str]) -> str:
    """The alternatives `texts` as a prefix tree, first characters that lead on alike
    merged into one class (the multiples of 8 below 100: 0[08]|1[6]|...)."""
    heads: dict[str, list[str]] = {}
    for t in texts:
        if t:
            heads.setdefault(t[0], []).append(t[1:])
    by_rest: dict[str, list[str]] = {}
    for c in sorted(heads):
        by_rest.setdefault(_trie(heads[c]), []).append(c)
    if not by_rest:
        return ""
    body = alt([_chars(chars) + rest for rest, chars in by_rest.items()])
    return f"(?:{body})?" if "" in texts else body


def _suffix_digits(k: int) -> int | None:
    """The n for which divisibility by k is decided by the last n digits (k divides
    10**n), or None where k has a prime factor but 2 and 5 or its n-digit multiples
    pass MAX_SUFFIX_DIGITS digits in all (16: 625 endings; 8: 125 of 3 digits)."""
    twos = fives = 0
    while k % 2 == 0:
        k, twos = k // 2, twos + 1
    while k % 5 == 0:
        k, fives = k // 5, fives + 1
    n = max(twos, fives)
    return n if k == 1 and n * 2 ** (n - twos) * 5 ** (n - fives) <= MAX_SUFFIX_DIGITS else None


def _then(head: str, tail: str | None) -> str | None:
    return None if tail is None else head + tail


def _multiples(a: int, b: int | None, k: int, width: int | None = None) -> str | None:
    """The multiples of k from a to b (0 <= a; b None: any) written without leading
    zeros (at most MAX_DIGITS digits), or zero-padded to `width` digits; None if there
    are none. k divides 10**n (_suffix_digits): the last n digits are listed, the
    digits above them a range."""
    n = _suffix_digits(k)
    assert n is not None, k
    unit = 10**n
    b = min(10 ** (width or MAX_DIGITS) - 1, b if b is not None else 10**MAX_DIGITS)
    if a > b:
        return None

    def listed(lo: int, hi: int, pad: int | None) -> str | None:  # pad None: unpadded
        values = range(-(-lo // k) * k, hi + 1, k)
        texts = [str(v) if pad is None else str(v).zfill(pad) if pad else "" for v in values]
        return _trie(texts) if texts else None

    def high(lo: int, hi: int) -> str:
        if width is None:
            return _naturals(lo, hi)
        return _digits_between(str(lo).zfill(width - n), str(hi).zfill(width - n))

    if width is not None and width <= n:
        return listed(a, b, width)
    parts = []
    if width is None and a < unit:  # below 10**n a number is its last digits, unpadded
        parts.append(listed(a, min(b, unit - 1), None))
        a = unit
    if a <= b:
        (ha, la), (hb, lb) = divmod(a, unit), divmod(b, unit)
        if ha == hb:
            parts.append(_then(high(ha, ha), listed(la, lb, n)))
        else:
            full_lo, full_hi = ha + (la > 0), hb - (lb < unit - 1)
            if la > 0:
                parts.append(_then(high(ha, ha), listed(la, unit - 1, n)))
            if full_lo <= full_hi:
                parts.append(_then(high(full_lo, full_hi), listed(0, unit - 1, n)))
            if lb < unit - 1:
                parts.append(_then(high(hb, hb), listed(0, lb, n)))
    kept = [p for p in parts if p is not None]
    return alt(kept) if kept else None


def _fractions(a: int, b: int, k: int, places: int) -> str | None:
    """The fraction texts (point included; none at all for 0) of the multiples of k
    from a to b, written as `places` digits (k divides 10**places): shorter where they
    end in zeros, longer with zeros after them; None if there are none."""
    digits, num_free = [], 0  # num_free: the texts this short are any digits
    for num_digits in range(1, places + 1):  # the text's digits padded with zeros are in range
        scale = 10 ** (places - num_digits)
        step = k // math.gcd(k, scale)
        lo, hi = -(-a // scale), b // scale
        if step == 1 and lo == 0 and hi == 10**num_digits - 1:
            num_free = num_digits
            continue
        text = _multiples(lo, hi, step, width=num_digits)
        if text is not None:
            digits.append(text + (f"0{{0,{17 - places}}}" if num_digits == places else ""))
    if num_free:
        zeros = f"0{{0,{17 - places}}}" if num_free == places else ""
        digits.insert(0, f"[0-9]{{1,{num_free}}}" + zeros)
    if not digits:
        return None
    return rf"(?:\.{alt(digits)})?" if a == 0 else rf"\.{alt(digits)}"


def _decimals(a: int, b: int | None, k: int, places: int) -> str | None:
    """The non-negative numbers x with x * 10**places a multiple of k from a to b, k
    dividing 10**places (so the fraction alone decides): the integer parts strictly
    between the bounds' take every such fraction, those at the bounds the ones in
    range."""
    unit = 10**places
    (ia, fa), (ib, fb) = divmod(a, unit), (None, None) if b is None else divmod(b, unit)
    if ia == ib:
        return _then(str(ia), _fractions(fa, fb, k, places))
    parts = [_then(str(ia), _fractions(fa, unit - 1, k, places))]
    if ib is None or ia + 1 <= ib - 1:
        whole = _fractions(0, unit - 1, k, places)
        parts.append(_naturals(ia + 1, None if ib is None else ib - 1) + whole)
    if ib is not None:
        parts.append(_then(str(ib), _fractions(0, fb, k, places)))
    kept = [p for p in parts if p is not None]
    return alt(kept) if kept else None


def _listed(a: int, b: int, k: int, places: int, integral: bool) -> str | None:
    """The multiples of k from a to b, scaled down by 10**places, each as its shortest
    decimal (numbers may add zeros to the fraction)."""
    groups: dict[int, list[str]] = {}  # by the number of fraction digits
    for m in range(-(-a // k) * k, b + 1, k):
        whole, fraction = divmod(abs(m), 10**places)
        digits = str(fraction).zfill(places).rstrip("0") if places else ""
        text = "-" * (m < 0) + str(whole) + ("." + digits if digits else "")
        groups.setdefault(len(digits), []).append(text)
    parts = []
    for num_digits, texts in sorted(groups.items()):
        zeros = "" if integral else _ZEROS if num_digits == 0 else f"0{{0,{17 - num_digits}}}"
        parts.append(_trie(texts) + zeros)
    return alt(parts) if parts else None


def _places(step: Fraction) -> int:
    """The fraction digits of a decimal step (0.25: 2); Irregular past 16."""
    places = 0
    while (step * 10**places).denominator != 1:
        places += 1
        if places > 16:
            raise Irregular(f"multipleOf {step} has more than 16 fraction digits")
    return places


def exact(value) -> Fraction | None:
    """A JSON number as the decimal it is written as (a float's shortest repr); None
    for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return Fraction(repr(value)) if isinstance(value, float) else Fraction(value)


def _scaled_bounds(node: dict, scale: int) -> tuple[int | None, int | None]:
    """The least and greatest integers m with m / scale within node's bounds."""
    rounded = {"minimum": math.ceil, "exclusiveMinimum": lambda v: math.floor(v) + 1,
               "maximum": math.floor, "exclusiveMaximum": lambda v: math.ceil(v) - 1}  # fmt: skip
    ends = {key: round_(v * scale) for key, round_ in rounded.items()
            if (v := exact(node.get(key))) is not None}  # fmt: skip
    lows = [ends[key] for key in ("minimum", "exclusiveMinimum") if key in ends]
    highs = [ends[key] for key in ("maximum", "exclusiveMaximum") if key in ends]
    return max(lows, default=None), min(highs, default=None)


def multiples(node: dict, step: Fraction, integral: bool) -> str | None:
    """The integers (integral) or decimals within node's bounds that are multiples of
    step, exactly; None if there are none. Irregular where no pattern of reasonable
    size says it (module docstring)."""
    places = 0 if integral else _places(step)
    k = step.numerator if integral else int(step * 10**places)
    a, b = _scaled_bounds(node, 10**places)  # x * 10**places from a to b, a multiple of k
    if a is not None and b is not None and a > b:
        return None
    if _suffix_digits(k) is None or (places and 10**places % k):
        if a is None or b is None or b // k - -(-a // k) >= MAX_LISTED:
            raise Irregular(f"multipleOf {step}")
        return _listed(a, b, k, places, integral)

    def magnitudes(lo: int, hi: int | None) -> str | None:
        if places:
            return _decimals(lo, hi, k, places)
        text = _multiples(lo, hi, k)
        return text if text is None or integral else text + _ZEROS

    parts = []
    if b is None or b >= 0:
        parts.append(magnitudes(max(a or 0, 0), b))
    if a is None or a < 0:  # -0 is left to 0
        neg = magnitudes(1 if b is None else max(-b, 1), None if a is None else -a)
        parts.append(_then("-", neg))
    kept = [p for p in parts if p is not None]
    return alt(kept) if kept else None
