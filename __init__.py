"""shunter: an LLM inference server built as an asyncio actor system.

Every state change travels the bus as a typed message (`shunter.bus.messages`), so a
running engine can be watched live (`busctl tail`), recorded and replayed.
"""

__version__ = "0.1.0"
