"""Incremental detokenization and stop-string matching, one request at a time.

Theory of operation
-------------------
Detokenizer (the prefix-offset method): keep every id seen; `prefix_offset..read_offset`
is a window of ids whose text was already emitted. For new ids, decode the window and
the window plus the new ids; the new text is the difference. When the longer decode
ends in U+FFFD (a multi-byte character split across tokens), only the text before that
partial character is released (found by dropping up to 4 trailing ids), and its ids stay
held, so the bytes complete on a later token. A few prompt tokens seed the
window, so decoders that drop a piece's leading space see it in context.

Stop strings: text that has been decoded but not yet sent is held in `pending`. After
each chunk the pending text is searched for every stop string (earliest match wins);
without a match, the longest suffix of the pending text that could still begin a stop
string is held back and the rest is released. Stop regexes (stop_regex.py) read each
chunk once, as it comes; the first match to complete stops the request, and text from
the earliest position where a match may still start is held back as well. Where a stop string
and a regex both match in one chunk, the match starting first wins.

Invariants
----------
- Released text never ends inside a UTF-8 character, except at `flush` (the request is
  over). After MAX_HELD_IDS ids that never completed one (invalid bytes), the invalid
  bytes are released as U+FFFD up to a cut no character straddles, the last ids still
  held: the chunks join to the full decode.
- A stop string can only start inside `pending`: any earlier start would have made a
  longer suffix a prefix of that stop string, and it would have been held.
- Text released before a stop match plus the final chunk equals the decoded output cut
  at the match (plus the stop string itself when `no_stop_trim`).
- `_base` is the offset, in the text the regex scanners have read, of `pending`'s first
  character: scanners and the pending text always cover the same text.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Protocol

from shunter.actors.tokenizer.stop_regex import RegexScanner, StopRegex

REPLACEMENT_CHAR = "\ufffd"
# A UTF-8 character is at most 4 bytes, so at most 4 byte-level tokens; more held ids
# that still end in U+FFFD are invalid bytes, released as they are (bounds the work).
MAX_HELD_IDS = 6
MAX_BYTES_PER_CHAR = 4


class Decoder(Protocol):
    def decode(
        self,
        ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text chunks that end on whole characters."""

    def __init__(
        self,
        decoder: Decoder,
        context_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        # One bound function per request: this runs for every token of every request.
        fast = getattr(decoder, "decode_fn", None)
        if fast is not None:
            self._decode = fast(skip_special_tokens, spaces_between_special_tokens)
        else:
            self._decode = functools.partial(
                decoder.decode,
                skip_special_tokens=skip_special_tokens,
                spaces_between_special_tokens=spaces_between_special_tokens,
            )
        ctx = list(context_ids)
        # A context that itself ends mid-character would corrupt the first difference.
        if ctx and REPLACEMENT_CHAR in self._decode(ctx):
            ctx = []
        self._ids: list[int] = ctx
        self._prefix_offset = 0
        self._read_offset = len(ctx)

    @property
    def num_held_ids(self) -> int:
        """Ids received whose text has not been released yet."""
        return len(self._ids) - self._read_offset

    def push(self, new_ids: Sequence[int]) -> str:
        """Add ids; return the newly completed text (possibly "")."""
        self._ids.extend(new_ids)
        return self._step(final=False)

    def flush(self) -> str:
        """The request is over: release whatever is held, partial characters included."""
        return self._step(final=True)

    def _step(self, *, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        complete = len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR)
        if complete or final:
            return self._release(prefix_text, new_text, len(self._ids))
        # The tail is a partial character: release what comes before it.
        for k in range(1, MAX_BYTES_PER_CHAR + 1):
            end = len(self._ids) - k
            if end <= self._read_offset:
                break
            text = self._decode(self._ids[self._prefix_offset : end])
            if len(text) > len(prefix_text) and not text.endswith(REPLACEMENT_CHAR):
                return self._release(prefix_text, text, end)
        if self.num_held_ids > MAX_HELD_IDS:  # can no longer complete: invalid bytes
            return self._release_invalid(prefix_text, new_text)
        return ""

    def _release_invalid(self, prefix_text: str, new_text: str) -> str:
        """Release held invalid bytes, but not the last MAX_BYTES_PER_CHAR - 1 ids (a
        character the next ids complete may start there): cut at the latest boundary no
        character straddles (both sides decoded apart give the whole), so that what is
        released reads as the full decode will. A decoder that changes pieces decoded
        alone (no clean cut found) gets everything released, as a bound on the work."""
        p, ids = self._prefix_offset, self._ids
        for end in range(len(ids) - (MAX_BYTES_PER_CHAR - 1), self._read_offset, -1):
            head = self._decode(ids[p:end])
            if head + self._decode(ids[end:]) == new_text:
                return self._release(prefix_text, head, end)
        return self._release(prefix_text, new_text, len(ids))

    def _release(self, prefix_text: str, text: str, end: int) -> str:
        self._prefix_offset = self._read_offset
        self._read_offset = end
        return text[len(prefix_text) :]


class StopStringMatcher:
    """Finds stop strings and stop regexes in streamed text and holds back what could
    begin a match."""

    def __init__(self, stops: Sequence[str], *, no_stop_trim: bool = False,
                 regexes: Sequence[StopRegex] = ()) -> None:  # fmt: skip
        self._stops = [s for s in stops if s]
        self._no_trim = no_stop_trim
        self._max_len = max((len(s) for s in self._stops), default=0)
        self._first_chars = frozenset(s[0] for s in self._stops)
        self._scanners = [RegexScanner(r) for r in regexes]
        self._base = 0
        self.pending = ""

    def push(self, chunk: str, *, final: bool = False) -> tuple[str, str | None]:
        """Add text; return (text to release, the stop string or the pattern of the stop
        regex that matched, or None). After a match the request is over: the caller
        stops pushing."""
        buf = self.pending + chunk
        if not self._stops and not self._scanners:
            self.pending = ""
            return buf, None
        best_pos, best_end, best = -1, -1, None
        for s in self._stops:
            pos = buf.find(s)
            if pos >= 0 and (
                best is None or pos < best_pos or (pos == best_pos and len(s) > len(best))
            ):
                best_pos, best_end, best = pos, pos + len(s), s
        for scanner in self._scanners:
            hit = scanner.feed(chunk)
            if hit is not None and (best is None or hit[0] - self._base < best_pos):
                best_pos, best_end, best = (
                    hit[0] - self._base,
                    hit[1] - self._base,
                    scanner.regex.pattern,
                )
        if best is not None:
            self.pending = ""
            return buf[: best_end if self._no_trim else best_pos], best
        if final:
            self.pending = ""
            return buf, None
        cut = len(buf) - self._held_suffix_len(buf)
        for scanner in self._scanners:
            live = scanner.earliest_live_start()
            if live is not None:
                cut = min(cut, live - self._base)
        self.pending = buf[cut:]
        self._base += cut
        return buf[:cut], None

    def _held_suffix_len(self, buf: str) -> int:
        first_chars = self._first_chars
        n = len(buf)
        for k in range(min(n, self._max_len - 1), 0, -1):
            if buf[n - k] not in first_chars:
                continue
            tail = buf[n - k :]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0
