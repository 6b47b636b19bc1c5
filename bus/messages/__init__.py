"""The message catalog: every message that travels the bus, declared once.

Each actor declares its inbox as a union of these types and decodes with a typed
decoder, so a message it does not expect is a decode error event, not a silent miss.
"""

from __future__ import annotations

from typing import Union

from shunter.bus.messages.base import Envelope, FinishReason, Msg, topic_of
from shunter.bus.messages.cache import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheStats,
    Census,
    CensusBroken,
    ChunkCached,
    DropTree,
    FreeRefused,
    LeaseGranted,
    LeaseRequest,
    LeaseReturned,
    Matched,
    PagesEvictable,
    RefreshMatch,
    SchedulerCensus,
    SequenceReleased,
    TreeDropped,
)
from shunter.bus.messages.flip import (
    AdmissionPaused,
    FlipBegin,
    FlipCutover,
    FlipDone,
    FlipQuiesced,
    MemoryState,
    ReleaseMemory,
    ResumeMemory,
    UpdateWeights,
    WeightsQuery,
    WeightsSlice,
    WeightsUpdated,
)
from shunter.bus.messages.health import (
    ActorDied,
    BusGap,
    DecodeFailed,
    HealthPing,
    HealthPong,
    Heartbeat,
    Ready,
    Shutdown,
)
from shunter.bus.messages.profile import ProfileStart, ProfileStatus, ProfileStop
from shunter.bus.messages.request import (
    AbortRequest,
    ChatMessage,
    GenerateRequest,
    RequestFailed,
    SamplingParams,
)
from shunter.bus.messages.sched import (
    LAST_SAMPLED,
    ForwardBatch,
    RequestOutput,
    RowOpen,
    SchedulerConfigured,
    SchedulerStats,
    StepResult,
    Tick,
    TokensOut,
)
from shunter.bus.messages.spill import (
    BlocksErased,
    ClearStore,
    EraseBlocks,
    FetchPages,
    LoadPages,
    PagesFetched,
    PagesLoaded,
    PagesSpilled,
    PagesStored,
    SpillPages,
    StoreCleared,
    StoreListed,
    StorePages,
)
from shunter.bus.messages.tokenizer import (
    DetokenizeQuery,
    DetokenizeReply,
    TextDelta,
    TextDeltas,
    Tokenized,
    TokenizeQuery,
    TokenizeReply,
    TopLogprob,
)

ALL_MESSAGES: tuple[type[Msg], ...] = (
    GenerateRequest, AbortRequest, RequestFailed,
    Tokenized, TextDeltas, TokenizeQuery, TokenizeReply, DetokenizeQuery, DetokenizeReply,
    Matched, RefreshMatch, LeaseRequest, LeaseGranted, LeaseReturned, ChunkCached,
    SequenceReleased, SchedulerCensus, Census, CensusBroken, FreeRefused, DropTree,
    TreeDropped, BlockStored, BlockRemoved, AllBlocksCleared, PagesEvictable, CacheStats,
    ForwardBatch, StepResult, TokensOut, Tick, SchedulerStats, SchedulerConfigured,
    SpillPages, PagesSpilled, LoadPages, PagesLoaded, StorePages, PagesStored, FetchPages,
    PagesFetched, StoreListed, ClearStore, StoreCleared, EraseBlocks, BlocksErased,
    FlipBegin, AdmissionPaused, FlipCutover, FlipDone, FlipQuiesced, UpdateWeights,
    WeightsUpdated, Ready, Heartbeat, HealthPing, HealthPong, ActorDied, Shutdown, BusGap, DecodeFailed,
    ProfileStart, ProfileStop, ProfileStatus, ReleaseMemory, ResumeMemory, MemoryState,
    WeightsQuery, WeightsSlice,
)  # fmt: skip

# Any message at all: what the recorder and `busctl` decode with.
AnyMessage = Union[ALL_MESSAGES]  # type: ignore[valid-type]  # noqa: UP007

TOPICS: dict[str, type[Msg]] = {topic_of(m): m for m in ALL_MESSAGES}
assert len(TOPICS) == len(ALL_MESSAGES), "two messages share a tag"

__all__ = [
    "ALL_MESSAGES", "LAST_SAMPLED", "TOPICS", "AbortRequest", "ActorDied", "AdmissionPaused",
    "AllBlocksCleared", "AnyMessage", "BlockRemoved", "BlockStored", "BlocksErased", "BusGap",
    "CacheStats", "Census", "CensusBroken", "ChatMessage", "ChunkCached", "ClearStore",
    "DecodeFailed", "DetokenizeQuery", "DetokenizeReply", "DropTree", "Envelope", "EraseBlocks",
    "FetchPages", "FinishReason", "FlipBegin", "FlipCutover", "FlipDone", "FlipQuiesced",
    "ForwardBatch", "FreeRefused", "GenerateRequest", "HealthPing", "HealthPong", "Heartbeat",
    "LeaseGranted", "LeaseRequest", "LeaseReturned", "LoadPages", "Matched", "MemoryState",
    "Msg", "PagesEvictable", "PagesFetched", "PagesLoaded", "PagesSpilled", "PagesStored",
    "ProfileStart", "ProfileStatus", "ProfileStop", "Ready", "RefreshMatch", "ReleaseMemory",
    "RequestFailed", "RequestOutput", "ResumeMemory", "RowOpen", "SamplingParams",
    "SchedulerCensus", "SchedulerConfigured", "SchedulerStats", "SequenceReleased", "Shutdown",
    "SpillPages", "StepResult", "StoreCleared", "StoreListed", "StorePages", "TextDelta",
    "TextDeltas", "Tick", "TokenizeQuery", "TokenizeReply", "Tokenized", "TokensOut",
    "TopLogprob", "TreeDropped", "UpdateWeights", "WeightsQuery", "WeightsSlice",
    "WeightsUpdated", "topic_of"
]  # fmt: skip
