"""Token-level automata for constrained decoding: which tokens may come next so that the
output can still match a regular expression whole.

Theory of operation: the pattern's NFA (regex.py) is determinized lazily: a DFA state
is the set of NFA states a prefix of the output leaves live, numbered as first met,
and its transitions are filled into a [state, character] table only when a character
is first read from it. `allowed(state)` walks every token of the vocabulary through
that table at once (numpy, one position of all tokens per pass): a token is allowed
if its whole text leaves some NFA state live, and an end-of-sequence id iff the state
accepts (the output so far matches whole). Each state's mask is kept; a generation
then costs one table walk per sampled token (`advance`). A TokenFsm belongs to one
pattern and one vocabulary and may be shared by every request that uses the pattern.

A token's text is what it adds to the output (TokenVocab); ids that add nothing, or
only part of a character (a byte-level piece of a multi-byte character), are never
allowed while a constraint holds, so a constrained output is spelled with tokens that
each carry whole characters.

Invariants: states and masks are pure functions of the pattern, the vocabulary and
the tokens read (no clock, no randomness); DEAD (-1) is the state nothing leaves live,
and no allowed token leads to it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np

from shunter.actors.grammar.regex import MAX_CONSTRAINT_CHARS, Nfa

DEAD, _UNKNOWN = -1, -2
MAX_DFA_STATES = 4096  # per pattern, met while reading: past it a row may only end (allowed)
MAX_NFA_STATES = 8000  # json_object()'s NFA has about 1,900
MAX_REGEX_CHARS = MAX_CONSTRAINT_CHARS


@functools.lru_cache(maxsize=128)
def constraint_nfa(pattern: str) -> Nfa:
    """The NFA of a constraint's pattern (matched whole, JSON string groups allowed);
    ValueError if refused."""
    return Nfa(pattern, param="regex", max_states=MAX_NFA_STATES, end_anchor=True,
               max_chars=MAX_REGEX_CHARS, extensions=True)  # fmt: skip


@functools.lru_cache(maxsize=256)
def constraint_error(pattern: str) -> str | None:
    """Why a constraint's pattern is refused, or None: constraint_nfa's verdict, kept for
    the latest patterns (requests of one schema send one pattern again and again, and
    compiling json_object()'s takes milliseconds)."""
    try:
        constraint_nfa(pattern)
    except ValueError as e:
        return str(e)
    return None


class TokenVocab:
    """Each token id's text (None where a token adds no whole characters) and the
    end-of-sequence ids, with the texts as a [V, L] array of character numbers."""

    def __init__(self, texts: Sequence[str | None], eos_ids: Sequence[int]) -> None:
        self.texts = list(texts)
        self.eos_ids = sorted(set(eos_ids))
        chars = sorted({c for t in self.texts if t for c in t})
        self.chars = chars
        self.char_ids = {c: i for i, c in enumerate(chars)}
        width = max((len(t) for t in self.texts if t), default=1)
        self.codes = np.full((len(self.texts), width), -1, dtype=np.int32)
        self.lengths = np.zeros(len(self.texts), dtype=np.int32)
        for i, t in enumerate(self.texts):
            if t:
                self.codes[i, : len(t)] = [self.char_ids[c] for c in t]
                self.lengths[i] = len(t)

    @classmethod
    def from_decoder(
        cls, decode_batch: Callable[[list[list[int]]], list[str]], vocab_size: int,
        eos_ids: Sequence[int], prefix_id: int,
    ) -> TokenVocab:  # fmt: skip
        """Texts by decoding [prefix_id, t] and dropping the prefix's own text, so that
        decoders that strip a piece's leading space at the start of a text keep it;
        a text ending in U+FFFD (part of a character) counts as none."""
        (prefix,) = decode_batch([[prefix_id]])
        pairs = decode_batch([[prefix_id, t] for t in range(vocab_size)])
        texts: list[str | None] = []
        for t in pairs:
            text = t[len(prefix) :] if t.startswith(prefix) else None
            texts.append(text if text and "\ufffd" not in text else None)
        return cls(texts, eos_ids)


class TokenFsm:
    """One pattern's token-level automaton over one vocabulary (the module docstring).
    The pattern must match whole: a leading ^ and a trailing $ change nothing."""

    def __init__(self, pattern: str, vocab: TokenVocab) -> None:
        self.nfa = constraint_nfa(pattern)
        self.vocab = vocab
        self._sets: list[tuple[int, ...]] = []
        self._ids: dict[tuple[int, ...], int] = {}
        self._table = np.full((16, max(len(vocab.chars), 1)), _UNKNOWN, dtype=np.int32)
        self._masks: dict[int, np.ndarray] = {}  # state -> its mask, packed
        self.initial = self._state(self.nfa.start_closure)

    @property
    def num_states(self) -> int:
        return len(self._sets)

    def accepting(self, state: int) -> bool:
        return state >= 0 and self.nfa.accept in self._sets[state]

    def _state(self, nfa_states: tuple[int, ...]) -> int:
        if not nfa_states:
            return DEAD
        sid = self._ids.get(nfa_states)
        if sid is None:
            if len(self._sets) >= MAX_DFA_STATES:
                raise ValueError(f"regex {self.nfa.pattern!r}: over {MAX_DFA_STATES} states "
                                 "as tokens are read")  # fmt: skip
            sid = self._ids[nfa_states] = len(self._sets)
            self._sets.append(nfa_states)
            if sid >= self._table.shape[0]:
                grown = np.full((2 * sid, self._table.shape[1]), _UNKNOWN, dtype=np.int32)
                grown[: self._table.shape[0]] = self._table
                self._table = grown
        return sid

    def _fill(self, state: int, char_id: int) -> int:
        step = self.nfa.step
        ch = self.vocab.chars[char_id]
        targets = [st[1] for s in self._sets[state] if (st := step[s]) is not None and st[0](ch)]
        nxt = self._state(self.nfa.close(targets)) if targets else DEAD
        self._table[state, char_id] = nxt
        return nxt

    def allowed(self, state: int) -> np.ndarray:
        """bool [V]: the tokens that may come next in `state` (kept per state, packed to
        a bit a token). Past MAX_DFA_STATES only the end-of-sequence ids: the row ends
        rather than fail."""
        packed = self._masks.get(state)
        if packed is None:
            try:
                mask = self._walk(state)
            except ValueError:
                mask = eos_only(self.vocab)
            packed = self._masks[state] = np.packbits(mask)
            return mask
        return np.unpackbits(packed, count=len(self.vocab.texts)).view(bool)

    def _walk(self, state: int) -> np.ndarray:
        v = self.vocab
        cur = np.full(len(v.texts), state, dtype=np.int32)
        alive = v.lengths > 0
        for pos in range(v.codes.shape[1]):
            idx = np.nonzero(alive & (v.lengths > pos))[0]
            if not len(idx):
                break
            st, ch = cur[idx], v.codes[idx, pos]
            nxt = self._table[st, ch]
            unknown = nxt == _UNKNOWN
            if unknown.any():
                width = self._table.shape[1]
                for key in np.unique(st[unknown].astype(np.int64) * width + ch[unknown]).tolist():
                    self._fill(*divmod(key, width))
                nxt = self._table[st, ch]
            cur[idx] = nxt
            alive[idx[nxt == DEAD]] = False
        mask = alive
        mask[v.eos_ids] = self.accepting(state)
        if not mask.any():  # nothing leads on and nothing ends: end anyway (never stall)
            mask[v.eos_ids] = True
        return mask

    def advance(self, state: int, token: int) -> int:
        """The state after `token` (DEAD for a token the state did not allow; the
        state itself for an end-of-sequence id)."""
        if state < 0 or token in self.vocab.eos_ids:
            return state
        text = self.vocab.texts[token] if 0 <= token < len(self.vocab.texts) else None
        if not text:
            return DEAD
        try:
            for c in text:
                cid = self.vocab.char_ids[c]
                nxt = int(self._table[state, cid])
                state = self._fill(state, cid) if nxt == _UNKNOWN else nxt
                if state == DEAD:
                    return DEAD
        except ValueError:  # past MAX_DFA_STATES
            return DEAD
        return state


def eos_only(vocab: TokenVocab) -> np.ndarray:
    """The mask of a row that may only end."""
    mask = np.zeros(len(vocab.texts), dtype=bool)
    mask[vocab.eos_ids] = True
    return mask


class GrammarCache:
    """The executor's automata: one TokenFsm per pattern (the latest `size` used), over
    the vocabulary `load_vocab` gives when the first constrained request comes."""

    def __init__(self, load_vocab: Callable[[], TokenVocab], size: int = 64) -> None:
        self._load_vocab = load_vocab
        self._vocab: TokenVocab | None = None
        self._fsms: dict[str, TokenFsm] = {}
        self.size = size

    def __call__(self, pattern: str) -> TokenFsm:
        fsm = self._fsms.pop(pattern, None)
        if fsm is None:
            if self._vocab is None:
                self._vocab = self._load_vocab()
            fsm = TokenFsm(pattern, self._vocab)
            while len(self._fsms) >= self.size:
                self._fsms.pop(next(iter(self._fsms)))
        self._fsms[pattern] = fsm  # most recently used last
        return fsm


def load_token_vocab(model_path: str | None, tokenizer_path: str | None) -> TokenVocab:
    """The TokenVocab of a model's tokenizer (the tokenizer actor's loading, blocking)."""
    from shunter.actors.tokenizer.config import TokenizerConfig
    from shunter.actors.tokenizer.loading import load_codec

    codec = load_codec(TokenizerConfig(model_path=model_path, tokenizer_path=tokenizer_path))
    prefix = codec.encode("a", add_special_tokens=False)[0]
    return TokenVocab.from_decoder(
        lambda batch: codec.tk.decode_batch(batch, skip_special_tokens=True), codec.vocab_size,
        codec.eos_token_ids, prefix,
    )  # fmt: skip
