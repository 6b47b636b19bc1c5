"""KV store writes exactly the named slots and nothing else."""

from __future__ import annotations

import pytest
import torch

from shunter.kernels.kv_store import kv_store, kv_store_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_store_writes_only_its_slots(dtype):
    g = torch.Generator().manual_seed(0)
    num_slots, hkv, d = 37, 3, 10
    slots = torch.tensor([36, 0, 17, 5, 22], dtype=torch.int64)
    k = torch.randn(5, hkv, d, generator=g).to(dtype)
    v = torch.randn(5, hkv, d, generator=g).to(dtype)
    results = []
    for fn in (kv_store, kv_store_ref):
        kc = torch.zeros(num_slots, hkv, d, dtype=dtype)
        vc = torch.full((num_slots, hkv, d), 7.0, dtype=dtype)
        fn(kc, vc, slots, k, v)
        for i, s in enumerate(slots.tolist()):
            assert torch.equal(kc[s], k[i]) and torch.equal(vc[s], v[i])
        untouched = torch.ones(num_slots, dtype=torch.bool)
        untouched[slots] = False
        assert torch.all(kc[untouched] == 0) and torch.all(vc[untouched] == 7)
        results.append((kc, vc))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_kv_store_rejects_mismatched_shapes():
    kc, vc = torch.zeros(8, 2, 4), torch.zeros(8, 2, 4)
    with pytest.raises(ValueError):
        kv_store(kc, vc, torch.tensor([1, 2]), torch.zeros(2, 3, 4), torch.zeros(2, 3, 4))
    with pytest.raises(ValueError):
        kv_store(kc, vc, torch.tensor([1]), torch.zeros(2, 2, 4), torch.zeros(2, 2, 4))
