"""Cache manager actor: radix prefix tree, KV page ledger, leases, census, row reclaim.

`core.CacheManagerCore` is the pure core; `actor.run(config, bus)` is its async shell.
"""
