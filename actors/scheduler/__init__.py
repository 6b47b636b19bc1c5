"""The scheduler actor: admission, continuous batching, chunked prefill, retraction.

`core.SchedulerCore` is the pure state machine (messages in, messages out);
`actor.run` is its async shell on the bus. See core.py's docstring for the theory of
operation.
"""
