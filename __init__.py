"""shunter: an LLM inference server built as an asyncio actor system.

Every state change travels the bus as a typed message (`shunter.bus.messages`), so a
running engine can be watched live (`busctl tail`), recorded and replayed.
"""

import os as _os
import sys as _sys

__version__ = "0.1.0"

# This directory is the package (a checkout's root is `shunter`). With it on sys.path
# (`python -m ...` run from a checkout puts the working directory there) its
# subpackages would also import as top-level `kernels`, `ops`, `bus`, ... and shadow
# installed packages of those names: transformers imports the Hub's `kernels`. So the
# entry goes, before anything else is imported (ops/run.sh also sets PYTHONSAFEPATH).
_here = _os.path.dirname(_os.path.abspath(__file__))
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _here]
del _here
