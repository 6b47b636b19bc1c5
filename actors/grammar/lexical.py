"""The lexical pieces of JSON Schema's patterns (json_schema.py): string formats and
numeric ranges as regular expressions.

Theory of operation: a `format` is a fixed pattern of the string's content (RFC 3339
dates and times, ISO 8601 durations, addresses, UUIDs, URIs). A numeric range is
written digit by digit: the integers from lo to hi split by length, each length by
the first digit that differs (as a range-to-regex tool does), so `{"minimum": 18,
"maximum": 99}` admits exactly 18..99. Decimals keep to integer bounds: an integer
part strictly between them takes any fraction, one at an upper bound only zeros, one
at an unreached lower bound a fraction that is not all zeros.

Invariants: every pattern keeps to regex.py's syntax (and Python's `re`); a range is
exact for integers, and for decimals never admits a value outside its bounds.
"""

from __future__ import annotations

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
